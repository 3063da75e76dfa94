"""BLEU generation eval: scores equal sacrebleu's, generations equal the stock HF path's, length buckets change
nothing but speed, and 2-rank ZeRO-2/ZeRO-3 runs (eval-only and best-model training) agree with one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
import transformers
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

import hf_ext
from chat_e.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from hf_ext.evaluation.bleu import (
    BleuEvalCallback,
    BleuEvalConfig,
    compute_bleu_chrf,
    format_samples_table,
    generate_in_order,
    length_batches,
    metric_prefix,
    shard_batches,
)

from ..conftest import ROOT, launcher_cmd, run

WORKER = ROOT / "tests" / "distributed" / "workers" / "bleu_eval_worker.py"
N_EVAL = 18  # 5 batches of 4 on 2 ranks: one rank runs an extra, discarded generate() call under ZeRO-3
GEN = dict(num_beams=1, max_length=24, min_length=1)
EOS = 2


# ---------------------------------------------------------------------------------------------- scores
HYPS = ["the cat sat on the mat", "", "hello there general kenobi", "", "a completely different answer"]
REFS = ["the cat sat on the mat", "i am fine thank you", "hello there general kenobi", "nothing", "the right one"]


@pytest.mark.parametrize(
    "hyps,refs",
    [
        (HYPS, REFS),  # mixed, with empty hypotheses
        (REFS, REFS),  # perfect match
        (["", ""], ["some words here", "more words"]),  # all empty
        (["a b c d e f"], ["a b c d x y"]),
    ],
)
def test_scores_equal_sacrebleu(hyps, refs):
    scores = compute_bleu_chrf(hyps, refs)
    assert scores["bleu"] == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert scores["chrf"] == sacrebleu.corpus_chrf(hyps, [refs]).score


def test_perfect_match_is_100_and_empty_is_0():
    assert compute_bleu_chrf(REFS, REFS) == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0)}
    assert compute_bleu_chrf(["", ""], ["a b c", "d e f"]) == {"bleu": 0.0, "chrf": 0.0}
    assert compute_bleu_chrf([None, "x"], ["a", "x"]) == compute_bleu_chrf(["", "x"], ["a", "x"])
    assert compute_bleu_chrf([], []) == {"bleu": 0.0, "chrf": 0.0}
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        compute_bleu_chrf(["a", "b"], ["a"])


# ---------------------------------------------------------------------------------------------- batching helpers
def test_length_batches_and_shards_cover_every_row_once():
    lengths = [5, 17, 3, 17, 9, 1, 12, 12, 30, 2, 8]
    bucketed = length_batches(lengths, 3)
    flat = [i for b in bucketed for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    assert flat.index(1) < flat.index(3) and flat.index(6) < flat.index(7)  # ties keep their order
    assert [i for b in length_batches(lengths, 3, bucket=False) for i in b] == list(range(len(lengths)))
    shards = [shard_batches(bucketed, r, 2) for r in range(2)]
    assert sorted(i for s in shards for b in s for i in b) == list(range(len(lengths)))
    assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_metric_prefix_and_table():
    assert metric_prefix({"eval_loss": 1.0, "eval_runtime": 2.0}) == "eval"
    assert metric_prefix({"eval_chat_loss": 1.0, "eval_chat_runtime": 2.0}) == "eval_chat"
    table = format_samples_table(
        [{"index": 0, "context": "x " * 80 + "newest", "generation": "hi", "reference": "yo"}]
    )
    assert "newest" in table and "hi" in table and "yo" in table
    with pytest.raises(ValueError, match="generation_batch_size"):
        BleuEvalConfig(generation_batch_size=0)


# ---------------------------------------------------------------------------------------------- a model with varied lengths
def eval_dataset(tokenizer, n: int = N_EVAL):
    """Same rows as tests/distributed/workers/bleu_eval_worker.py's ``eval_split``."""
    data_args = DataArguments(max_target_length=32)
    return tokenize_dataset(load_dialogue_dataset(data_args)["train"].select(range(n)), tokenizer, data_args)


@pytest.fixture(scope="module")
def eval_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny BlenderBot trained a few dozen steps, with its ``</s>`` logit bias set so that greedy replies end at
    many different lengths (a briefly trained model otherwise ends every reply at once, or never)."""
    out = tmp_path_factory.mktemp("bleu_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data_args = DataArguments(max_source_length=48, max_target_length=16)
    train = tokenize_dataset(load_dialogue_dataset(data_args)["train"].select(range(320)), tokenizer, data_args)
    torch.manual_seed(0)
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    args = hf_ext.Seq2SeqTrainingArguments(
        str(out / "run"), max_steps=40, per_device_train_batch_size=8, learning_rate=5e-3, report_to="none",
        save_strategy="no", generation_eval=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    hf_ext.Seq2SeqTrainer(model=model, args=args, train_dataset=train, data_collator=collator).train()
    model.eval()
    rows = list(eval_dataset(tokenizer))
    base = model.final_logits_bias[0, EOS].item()
    best = (0, 0.0, 0.0)
    for shift in np.arange(-2.0, 2.01, 0.5):
        model.final_logits_bias[0, EOS] = base + shift
        _, lengths, _ = generate_in_order(model, tokenizer, rows, GEN, batch_size=4)
        best = max(best, (len(set(lengths)), -abs(shift), float(shift)))
    model.final_logits_bias[0, EOS] = base + best[2]
    shutil.rmtree(out / "run", ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(eval_model_dir):
    return AutoTokenizer.from_pretrained(eval_model_dir)


def decoded_labels(tokenizer, dataset) -> list[str]:
    return [
        tokenizer.decode([t for t in ids if t >= 0], skip_special_tokens=True).strip() for ids in dataset["labels"]
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def single_rank(eval_model_dir, tokenizer, tmp_path_factory) -> dict:
    """hf-ext's Seq2SeqTrainer, one process, no DeepSpeed: the reference of the 2-rank runs."""
    out = tmp_path_factory.mktemp("single")
    model = BlenderbotForConditionalGeneration.from_pretrained(eval_model_dir)
    args = hf_ext.Seq2SeqTrainingArguments(
        str(out), per_device_eval_batch_size=4, generation_batch_size=4, generation_num_beams=1,
        generation_max_length=24, generation_min_length=1, report_to="none", log_samples=3,
    )  # fmt: skip
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=eval_dataset(tokenizer),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    rows = trainer.bleu_eval_callback.last_rows
    return {"metrics": metrics, "generations": [r["generation"] for r in rows], "out": out, "trainer": trainer}


def test_model_has_varied_lengths(single_rank):
    assert len({len(g.split()) for g in single_rank["generations"]}) >= 3


def test_stock_trainer_with_callback_equals_predict_with_generate(eval_model_dir, tokenizer, tmp_path, capsys):
    """The callback on the stock Seq2SeqTrainer gives the stock predict_with_generate path's generations and scores."""
    dataset = eval_dataset(tokenizer)
    model = BlenderbotForConditionalGeneration.from_pretrained(eval_model_dir)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    callback = BleuEvalCallback(generation_batch_size=3, log_samples=4, **GEN)
    ours = transformers.Seq2SeqTrainer(
        model=model,
        args=transformers.Seq2SeqTrainingArguments(
            str(tmp_path / "ours"), per_device_eval_batch_size=4, report_to="none", use_cpu=True
        ),
        eval_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    metrics = ours.evaluate()

    stock_hyps = []

    def compute_metrics(pred):
        preds = np.where(pred.predictions != -100, pred.predictions, tokenizer.pad_token_id)
        labels = np.where(pred.label_ids != -100, pred.label_ids, tokenizer.pad_token_id)
        hyps = [h.strip() for h in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        refs = [r.strip() for r in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        stock_hyps.extend(hyps)
        return {
            "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
            "gen_len": float(np.mean([np.count_nonzero(p != tokenizer.pad_token_id) for p in preds])),
        }

    stock = transformers.Seq2SeqTrainer(
        model=model,
        args=transformers.Seq2SeqTrainingArguments(
            str(tmp_path / "stock"),
            per_device_eval_batch_size=4,
            predict_with_generate=True,
            report_to="none",
            generation_max_length=GEN["max_length"],
            generation_num_beams=GEN["num_beams"],
            use_cpu=True,
        ),  # fmt: skip
        eval_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    expected = stock.evaluate(min_length=GEN["min_length"])

    assert [r["generation"] for r in callback.last_rows] == stock_hyps
    for key in ("eval_bleu", "eval_chrf", "eval_gen_len", "eval_loss"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-9), key
    assert ours.state.log_history[-1]["eval_bleu"] == metrics["eval_bleu"]  # logged alongside eval_loss
    assert "eval_loss" in ours.state.log_history[-1]

    # samples: the console table shows the first rows, the file holds every row in dataset order
    printed = capsys.readouterr().out
    assert "eval generations at step 0" in printed
    rows = read_jsonl(tmp_path / "ours" / "generations" / "step-0.jsonl")
    assert [r["index"] for r in rows] == list(range(len(dataset)))
    assert [r["reference"] for r in rows] == decoded_labels(tokenizer, dataset)
    assert [r["generation"] for r in rows] == stock_hyps
    contexts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in dataset["input_ids"]]
    assert [r["context"] for r in rows] == contexts
    for row in rows[:4]:
        assert row["reference"][:20] in printed


def test_bucketed_equals_unbucketed_greedy(eval_model_dir, tokenizer):
    """Sorted batches of 6, batches of 6 in order and one row at a time (no padding) give the same generations."""
    model = BlenderbotForConditionalGeneration.from_pretrained(eval_model_dir).eval()
    rows = list(eval_dataset(tokenizer))
    one_by_one = generate_in_order(model, tokenizer, rows, GEN, 1, bucket=False)
    unbucketed = generate_in_order(model, tokenizer, rows, GEN, 6, bucket=False)
    bucketed = generate_in_order(model, tokenizer, rows, GEN, 6, bucket=True)
    assert bucketed[:2] == unbucketed[:2] == one_by_one[:2]


def test_generation_settings_precedence(single_rank):
    callback = single_rank["trainer"].bleu_eval_callback
    args = single_rank["trainer"].args
    assert callback.generation_kwargs(args) == {"num_beams": 1, "max_length": 24, "min_length": 1}
    callback.call_gen_kwargs = {"max_new_tokens": 5, "min_length": 2}
    try:
        assert callback.generation_kwargs(args) == {"num_beams": 1, "max_new_tokens": 5, "min_length": 2}
    finally:
        callback.call_gen_kwargs = {}
    assert BleuEvalCallback(num_beams=3).generation_kwargs(args)["num_beams"] == 3
    assert callback.batch_size(args) == 4


# ---------------------------------------------------------------------------------------------- 2 ranks
def launch_worker(model_dir: Path, out: Path, stage: int, *extra: str) -> list[dict]:
    run(launcher_cmd("deepspeed", WORKER) + [
        "--model", str(model_dir), "--out", str(out), "--stage", str(stage), "--n_eval", str(N_EVAL), *extra,
    ])  # fmt: skip
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]


def check_two_ranks_equal_one(results: list[dict], single: dict, tokenizer) -> None:
    for result in results:
        assert result["world_size"] == 2
        metrics = result["eval_only"]
        assert result["eval_only_generations"] == single["generations"]
        for key in ("eval_bleu", "eval_chrf", "eval_gen_len"):
            assert metrics[key] == single["metrics"][key], key
        # (eval_loss is the stock loop's: on 2 ranks it averages per-batch means over a sampler padded to 20 rows)
        assert "eval_loss" in metrics


@pytest.mark.distributed
def test_zero3_two_ranks_uneven_lengths_equal_one_rank(eval_model_dir, tokenizer, single_rank, tmp_path):
    # evaluate, then train with metric_for_best_model="bleu" (stock cannot train after a ZeRO-3 evaluate())
    results = launch_worker(eval_model_dir, tmp_path, 3, "--train_steps", "8", "--eval_steps", "4")
    stats = [r["eval_only_stats"] for r in results]
    # the scenario: ranks hold different numbers of batches and generate to different lengths ...
    assert sorted(s["batches"] for s in stats) == [2, 3]
    assert stats[0]["widths"][: len(stats[1]["widths"])] != stats[1]["widths"][: len(stats[0]["widths"])]
    # ... yet make the same number of generate() calls (synced), finish, and agree with one process
    assert stats[0]["calls"] == stats[1]["calls"] == 3
    check_two_ranks_equal_one(results, single_rank, tokenizer)
    check_best_model(results, tmp_path)


@pytest.mark.distributed
def test_zero2_eval_only_and_best_model(eval_model_dir, tokenizer, single_rank, tmp_path):
    results = launch_worker(eval_model_dir, tmp_path, 2, "--train_steps", "8", "--eval_steps", "4")
    assert not results[0]["engine_after_eval_only"]  # evaluated without building an inference engine
    check_two_ranks_equal_one(results, single_rank, tokenizer)
    rows = read_jsonl(tmp_path / "generations" / "step-0.jsonl")
    dataset = eval_dataset(tokenizer)
    assert [r["index"] for r in rows] == list(range(N_EVAL))
    assert [r["reference"] for r in rows] == decoded_labels(tokenizer, dataset)
    assert [r["generation"] for r in rows] == single_rank["generations"]
    check_best_model(results, tmp_path)


def check_best_model(results: list[dict], out: Path) -> None:
    """metric_for_best_model="bleu" picked the best evaluation and load_best_model_at_end loaded that model."""
    history = results[0]["log_history"]
    evals = [(h["step"], h["eval_bleu"]) for h in history if "eval_bleu" in h]
    assert [step for step, _ in evals] == [4, 8]
    best_step, best_bleu = max(evals, key=lambda e: (e[1], -e[0]))  # ties keep the first
    for result in results:
        assert result["best_metric"] == best_bleu
        assert Path(result["best_model_checkpoint"]).name == f"checkpoint-{best_step}"
        assert result["final"]["eval_bleu"] == best_bleu
    at_best = [r["generation"] for r in read_jsonl(out / "generations" / f"step-{best_step}.jsonl")]
    if best_step != 8:  # the final evaluation rewrote step-8.jsonl; the best one is intact
        assert results[0]["final_generations"] == at_best


def test_best_bleu_lora_adapter_is_loaded_at_end(eval_model_dir, tokenizer, tmp_path):
    """metric_for_best_model="bleu" + load_best_model_at_end with a LoRA model: adapter-only checkpoints, and the
    adapter of the best evaluation is the one in the model at the end."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file

    base = BlenderbotForConditionalGeneration.from_pretrained(eval_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = hf_ext.Seq2SeqTrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=3e-2, max_steps=8,
        eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4, metric_for_best_model="bleu",
        load_best_model_at_end=True, report_to="none", log_samples=2, seed=0, disable_tqdm=True,
        greater_is_better=False,  # the lower BLEU wins here, so that the chosen adapter is not the last one trained
        generation_num_beams=1, generation_max_length=24, generation_min_length=1, generation_batch_size=4,
    )  # fmt: skip
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=eval_dataset(tokenizer, 64),
        eval_dataset=eval_dataset(tokenizer),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
    )
    trainer.train()
    evals = [(h["step"], h["eval_bleu"]) for h in trainer.state.log_history if "eval_bleu" in h]
    assert [step for step, _ in evals] == [4, 8]
    best_step, best_bleu = min(evals, key=lambda e: (e[1], e[0]))
    assert best_step == 4  # else loading the best adapter would be indistinguishable from keeping the last one
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == f"checkpoint-{best_step}" and trainer.state.best_metric == best_bleu
    assert (best / "adapter_model.safetensors").is_file() and not (best / "model.safetensors").exists()
    saved = load_file(best / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k].cpu()) for k in saved)
    other = load_file(tmp_path / f"checkpoint-{12 - best_step}" / "adapter_model.safetensors")
    assert any(not torch.equal(other[k], saved[k]) for k in saved)  # the two evaluations saw different adapters
    assert trainer.evaluate()["eval_bleu"] == best_bleu
