"""BLEU generation eval in one process: generations equal the stock HF path's, length buckets change nothing but
speed, generation settings take precedence as documented, and the best LoRA adapter by BLEU is the one loaded."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
import transformers
from transformers import BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

import hf_ext
from hf_ext.evaluation.bleu import BleuEvalCallback, generate_in_order

from ..bleu_support import GEN, decoded_labels, eval_dataset, read_jsonl

pytestmark = pytest.mark.slow
# the same settings under the TrainingArguments names BleuEvalCallback takes
GEN_ARGS = {f"generation_{key}": value for key, value in GEN.items()}


def test_model_has_varied_lengths(single_rank):
    assert len({len(g.split()) for g in single_rank["generations"]}) >= 3


def test_stock_trainer_with_callback_equals_predict_with_generate(eval_model_dir, tokenizer, tmp_path, caplog):
    """The callback on the stock Seq2SeqTrainer gives the stock predict_with_generate path's generations and scores."""
    caplog.set_level(logging.INFO, logger="hf_ext.evaluation.bleu")
    dataset = eval_dataset(tokenizer)
    model = BlenderbotForConditionalGeneration.from_pretrained(eval_model_dir)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    callback = BleuEvalCallback(generation_batch_size=3, log_samples=4, **GEN_ARGS)
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

    assert [r["generation"] for r in callback.last_evaluation.rows] == stock_hyps
    for key in ("eval_bleu", "eval_chrf", "eval_gen_len", "eval_loss"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-9), key
    assert ours.state.log_history[-1]["eval_bleu"] == metrics["eval_bleu"]  # logged alongside eval_loss
    assert "eval_loss" in ours.state.log_history[-1]

    # samples: the logged table shows the first rows, the file holds every row in dataset order
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "hf_ext.evaluation.bleu")
    assert "eval generations at step 0" in logged
    rows = read_jsonl(tmp_path / "ours" / "generations" / "step-0.jsonl")
    assert [r["index"] for r in rows] == list(range(len(dataset)))
    assert [r["reference"] for r in rows] == decoded_labels(tokenizer, dataset)
    assert [r["generation"] for r in rows] == stock_hyps
    contexts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in dataset["input_ids"]]
    assert [r["context"] for r in rows] == contexts
    for row in rows[:4]:
        assert row["reference"][:20] in logged


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
    call = {"max_new_tokens": 5, "min_length": 2}
    assert callback.generation_kwargs(args, call=call) == {"num_beams": 1, "max_new_tokens": 5, "min_length": 2}
    assert BleuEvalCallback(generation_num_beams=3).generation_kwargs(args)["num_beams"] == 3
    assert callback.batch_size(args) == 4


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


def test_decoder_only_eval_equals_stock_generate_per_row(tiny_chat_model_dir, tmp_path):
    """A decoder-only chat model: batched, left-padded, bucketed generation from each row's prompt (the tokens before
    its first label) gives stock generate()'s reply for every row alone, and sacreBLEU of those against the raw
    replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chat_e.data.corpora import DataArguments, load_dialogue_dataset
    from chat_e.data.dialogue import encode_texts

    from ..app.support import make_sensitive_model

    model_dir = make_sensitive_model(tiny_chat_model_dir, tmp_path / "model", std=0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    dataset = eval_dataset(tokenizer, family="causal")
    raw = load_dialogue_dataset(DataArguments(max_target_length=32))["train"].select(range(len(dataset)))
    args = hf_ext.Seq2SeqTrainingArguments(
        str(tmp_path / "run"), per_device_eval_batch_size=4, generation_batch_size=4, generation_num_beams=1,
        generation_max_length=12, report_to="none", log_samples=0,
    )  # fmt: skip
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    rows = trainer.bleu_eval_callback.last_evaluation.rows
    expected = []
    for texts in raw["texts"]:
        ids = torch.tensor([encode_texts(tokenizer, texts, 128, family="causal")])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    assert [r["generation"] for r in rows] == expected
    assert len(set(expected)) > 3  # the replies depend on the prompt
    # references are the replies (cut at max_target_length=32 tokens, as trained)
    for row, label in zip(rows, raw["labels"]):
        label = " ".join(label.split())
        assert label.startswith(row["reference"]) and len(row["reference"]) > 0
        if len(tokenizer(label)["input_ids"]) < 30:
            assert row["reference"] == label
    bleu = sacrebleu.corpus_bleu(expected, [[r["reference"] for r in rows]]).score
    assert metrics["eval_bleu"] == pytest.approx(bleu)
    assert rows[0]["context"].startswith("system\n") and rows[0]["context"].endswith("assistant")
