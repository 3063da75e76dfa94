"""Generation eval: stock ``Seq2SeqTrainer(predict_with_generate=True)`` + a sacrebleu ``compute_metrics`` against
hf-ext's BLEU eval, same model, same eval set, same generation settings, in one process.

    python -m benchmarks.bench_eval --out runs/bench/eval.json
    python -m benchmarks.bench_eval --size small --train_steps 300 --num_beams 10 --out runs/bench/eval_small.json

The model is a BlenderBot from chat_e.data.models (``tiny`` by default), trained ``--train_steps`` steps on the
offline corpus first (0 = random init) so that replies end at different lengths. The eval set is the offline corpus'
validation + test rows (varied lengths). Each path is timed end to end (``trainer.evaluate()``: loss pass,
generation, decoding, scoring); the order of the two paths alternates across ``--repeats`` and the best time of each
is kept. hf-ext is measured with ``generation_batch_size`` equal to the eval batch size (bucketing only) and, when
``--generation_batch_size`` is given, with that too.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import sacrebleu
import torch
import transformers
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

import hf_ext
from benchmarks import harness
from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from chat_e.data.models import build
from hf_ext.evaluation.bleu import length_batches


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/eval.json", help="JSON results path.")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="chat_e.data.models size.")
    p.add_argument("--model_dir", default=None, help="Reuse (or create) the trained model here.")
    p.add_argument("--train_steps", type=int, default=100, help="Training steps before the benchmark (0: random).")
    p.add_argument("--n_eval", type=int, default=256, help="Eval rows (validation + test of the offline corpus).")
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--generation_batch_size", type=int, default=64, help="Also measure hf-ext with this size.")
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--min_length", type=int, default=20)
    p.add_argument("--max_length", type=int, default=64)
    p.add_argument("--no_repeat_ngram_size", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    return p.parse_args(argv)


def train_model(model_dir: Path, size: str, steps: int) -> None:
    build(str(model_dir), size, seed=0)
    if not steps:
        return
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_args = DataArguments(max_source_length=128, max_target_length=64)
    train = tokenize_dataset(load_dialogue_dataset(data_args)["train"], tokenizer, data_args)
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
    args = hf_ext.Seq2SeqTrainingArguments(
        str(model_dir / "run"), max_steps=steps, per_device_train_batch_size=16, learning_rate=2e-3,
        warmup_steps=10, report_to="none", save_strategy="no", generation_eval=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    hf_ext.Seq2SeqTrainer(model=model, args=args, train_dataset=train, data_collator=collator).train()
    model.save_pretrained(model_dir)


def eval_set(tokenizer, n: int) -> datasets.Dataset:
    data_args = DataArguments(max_source_length=128, max_target_length=64)
    raw = load_dialogue_dataset(data_args)
    rows = datasets.concatenate_datasets([raw["validation"], raw["test"]])
    if n > len(rows):
        raise SystemExit(f"--n_eval {n}: the offline validation + test splits hold {len(rows)} rows.")
    return tokenize_dataset(rows.select(range(n)), tokenizer, data_args)


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def run_stock(model, tokenizer, dataset, opts, workdir: Path) -> dict:
    hyps: list[str] = []

    def compute_metrics(pred):
        preds = np.where(pred.predictions != -100, pred.predictions, tokenizer.pad_token_id)
        labels = np.where(pred.label_ids != -100, pred.label_ids, tokenizer.pad_token_id)
        hyps[:] = [h.strip() for h in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        refs = [r.strip() for r in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score}

    args = transformers.Seq2SeqTrainingArguments(
        str(workdir / "stock"), per_device_eval_batch_size=opts.per_device_eval_batch_size, predict_with_generate=True,
        generation_num_beams=opts.num_beams, generation_max_length=opts.max_length, report_to="none", use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    torch.set_num_threads(opts.threads)
    start = time.perf_counter()
    metrics = trainer.evaluate(min_length=opts.min_length, no_repeat_ngram_size=opts.no_repeat_ngram_size)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bleu": metrics["eval_bleu"], "chrf": metrics["eval_chrf"], "generations": hyps}


def run_hf_ext(model, tokenizer, dataset, opts, workdir: Path, generation_batch_size: int) -> dict:
    args = hf_ext.Seq2SeqTrainingArguments(
        str(workdir / f"hf_ext_{generation_batch_size}"), per_device_eval_batch_size=opts.per_device_eval_batch_size,
        generation_batch_size=generation_batch_size, generation_num_beams=opts.num_beams,
        generation_max_length=opts.max_length, generation_min_length=opts.min_length,
        generation_no_repeat_ngram_size=opts.no_repeat_ngram_size, report_to="none", log_samples=0,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
    )
    torch.set_num_threads(opts.threads)
    start = time.perf_counter()
    metrics = trainer.evaluate()
    seconds = time.perf_counter() - start
    rows = trainer.bleu_eval_callback.last_evaluation.rows
    return {
        "seconds": seconds,
        "bleu": metrics["eval_bleu"],
        "chrf": metrics["eval_chrf"],
        "gen_len": metrics["eval_gen_len"],
        "generations": [r["generation"] for r in rows],
    }


def main(argv: list[str] | None = None) -> dict:
    opts = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    workdir = Path(tempfile.mkdtemp(prefix="bench_eval_"))
    model_dir = Path(opts.model_dir) if opts.model_dir else workdir / f"model_{opts.size}"
    start = time.perf_counter()
    if not (model_dir / "config.json").exists():
        train_model(model_dir, opts.size, opts.train_steps)
    prep_seconds = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir).eval()
    dataset = eval_set(tokenizer, opts.n_eval)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    bs = opts.per_device_eval_batch_size
    in_order = [list(range(i, min(i + bs, len(lengths)))) for i in range(0, len(lengths), bs)]
    bucketed = length_batches(lengths, bs)

    sizes = [bs] + ([opts.generation_batch_size] if opts.generation_batch_size not in (None, bs) else [])
    best: dict[str, dict] = {}
    for repeat in range(opts.repeats):
        order = ["stock", *sizes] if repeat % 2 == 0 else [*sizes, "stock"]
        for name in order:
            if name == "stock":
                result, key = run_stock(model, tokenizer, dataset, opts, workdir), "stock"
            else:
                result, key = run_hf_ext(model, tokenizer, dataset, opts, workdir, name), f"hf_ext_gen_bs{name}"
            print(
                f"{key}: {result['seconds']:.1f} s, bleu {result['bleu']:.4f}, chrf {result['chrf']:.4f}", flush=True
            )
            if key not in best or result["seconds"] < best[key]["seconds"]:
                best[key] = result

    stock = best["stock"]
    report = {
        "command": harness.command("benchmarks.bench_eval", argv),
        "model": {"size": opts.size, "train_steps": opts.train_steps, "parameters": model.num_parameters()},
        "eval_set": {
            "rows": len(lengths),
            "source": "chatterbot validation+test",
            "input_tokens_min_mean_max": [min(lengths), round(sum(lengths) / len(lengths), 1), max(lengths)],
            "padded_input_tokens_in_order": padded_tokens(lengths, in_order),
            "padded_input_tokens_bucketed": padded_tokens(lengths, bucketed),
        },
        "generation": {
            "num_beams": opts.num_beams,
            "min_length": opts.min_length,
            "max_length": opts.max_length,
            "no_repeat_ngram_size": opts.no_repeat_ngram_size,
            "per_device_eval_batch_size": bs,
        },
        "threads": opts.threads,
        "repeats": opts.repeats,
        "host": harness.host_info(),
        "model_prep_seconds": round(prep_seconds, 1),
        "stock": {k: v for k, v in stock.items() if k != "generations"},
        "hf_ext": {},
    }
    for key, result in best.items():
        if key == "stock":
            continue
        report["hf_ext"][key] = {
            **{k: v for k, v in result.items() if k != "generations"},
            "speedup_vs_stock": stock["seconds"] / result["seconds"],
            "identical_bleu": result["bleu"] == stock["bleu"],
            "identical_chrf": result["chrf"] == stock["chrf"],
            "identical_generations": result["generations"] == stock["generations"],
            "differing_generations": sum(a != b for a, b in zip(result["generations"], stock["generations"])),
        }
    harness.write_json(opts.out, report)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
