"""Generation eval under ZeRO-3 on 2 ranks: stock ``Seq2SeqTrainer(predict_with_generate=True)`` against hf-ext's
BLEU eval on the partitioned model (a gather per layer per decoding step) and with the weights gathered once.

    python -m benchmarks.bench_eval_zero3 --size 400m --n_eval 16 --out runs/bench/eval_zero3_400m.json
    python -m benchmarks.bench_eval_zero3 --size tiny --n_eval 64 --out runs/bench/eval_zero3_tiny.json

Each path is its own ``deepspeed --num_gpus 2`` launch (fresh processes, freed memory returned to the OS in all of
them) on the same random-init BlenderBot of the given shape (chat_e.data.models), the same eval rows (the offline corpus'
validation + test), the same resolved ZeRO-3 config (hf-ext's ``zero3`` preset resolved once for 2 ranks, handed to
stock as a file) and the same generation settings (beam search). Measured per rank: ``trainer.evaluate()`` wall time
(loss pass, generation, scoring) and peak RSS above the level before the call, sampled every 2 ms. The generations of
the three paths are compared row by row. Prints a Markdown table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_eval_zero3"
PATHS = ("stock", "per-token", "gathered")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="400m", help="model shape from chat_e.data.models")
    p.add_argument("--n_eval", type=int, default=16)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--max_length", type=int, default=32)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank")
    p.add_argument("--bf16", action="store_true", help="bf16 on every path (the config's bf16 must be enabled)")
    p.add_argument("--out", default="runs/bench/eval_zero3.json")
    p.add_argument("--doc", default=None, help="also write the table into this Markdown file (docs/benchmarks.md)")
    # worker side
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--ds_config", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args(argv)


def eval_rows(tokenizer, n: int):
    import datasets

    from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset

    data_args = DataArguments(max_source_length=128, max_target_length=64)
    raw = load_dialogue_dataset(data_args)
    rows = datasets.concatenate_datasets([raw["validation"], raw["test"]]).select(range(n))
    return tokenize_dataset(rows, tokenizer, data_args)


def worker(opts) -> None:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

    import hf_ext
    from hf_ext.evaluation.bleu import compute_bleu_chrf
    from hf_ext.runtime import return_freed_memory_to_os, start_deepspeed_comm

    transformers.utils.logging.set_verbosity_error()
    return_freed_memory_to_os()  # every path: RSS follows live allocations
    torch.set_num_threads(opts.threads)  # every path: the same threads per rank
    work = Path(opts.workdir)
    common = dict(output_dir=str(work / opts.path), per_device_eval_batch_size=opts.per_device_eval_batch_size,
                  generation_num_beams=opts.num_beams, generation_max_length=opts.max_length, report_to=[],
                  disable_tqdm=True, deepspeed=json.loads(Path(opts.ds_config).read_text()),
                  bf16=opts.bf16)  # fmt: skip
    if opts.path == "stock":
        args = transformers.Seq2SeqTrainingArguments(predict_with_generate=True, use_cpu=not torch.cuda.is_available(),
                                                     **common)  # fmt: skip
        start_deepspeed_comm()  # on CPU stock's arguments start torch.distributed but not DeepSpeed's comm
        trainer_class = transformers.Seq2SeqTrainer
    else:
        gather = "true" if opts.path == "gathered" else "false"
        args = hf_ext.Seq2SeqTrainingArguments(generation_gather_weights=gather, log_samples=0,
                                               save_generations=False, **common)  # fmt: skip
        trainer_class = hf_ext.Seq2SeqTrainer
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model = BlenderbotForConditionalGeneration.from_pretrained(opts.model)  # after the arguments: partitioned
    dataset = eval_rows(tokenizer, opts.n_eval)
    generations: list[str] = []

    def compute_metrics(pred):  # stock: decode what predict_with_generate returned
        ids = np.where(pred.predictions != -100, pred.predictions, tokenizer.pad_token_id)
        generations[:] = [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        return {}

    trainer = trainer_class(
        model=model, args=args, eval_dataset=dataset, processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        compute_metrics=compute_metrics if opts.path == "stock" else None,
    )  # fmt: skip
    trainer.accelerator.wait_for_everyone()
    with harness.PeakRSS() as rss:
        start = time.perf_counter()
        metrics = trainer.evaluate()
        seconds = time.perf_counter() - start
    if opts.path != "stock":
        generations = [row["generation"] for row in trainer.bleu_eval_callback.last_evaluation.rows]
    labels = [[t for t in row if t != -100] for row in dataset["labels"]]
    references = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
    scores = compute_bleu_chrf(generations, references)  # every path scored alike, on the decoded labels
    result = {"path": opts.path, "rank": args.process_index, "seconds": round(seconds, 3),
              "peak_extra_rss_bytes": rss.extra, "rss_before_bytes": rss.base, "generations": generations,
              "bleu": scores["bleu"], "chrf": scores["chrf"]}  # fmt: skip
    if opts.path != "stock":
        result["generation_path"] = trainer.bleu_eval_callback.last_evaluation.stats.get("path")
        result["generation_seconds"] = metrics["eval_gen_runtime"]  # the rest: the loss pass and scoring
        result["gather_seconds"] = trainer.bleu_eval_callback.last_evaluation.stats.get("gather_seconds")
    harness.write_json(work / f"{opts.path}.rank{args.process_index}.json", result)
    hf_ext.end_distributed()


def resolved_config(model: Path, opts, workdir: Path, world_size: int = 2, hardware=None) -> Path:
    """hf-ext's zero3 preset resolved once for ``world_size`` ranks: the one config every path runs. ``hardware``
    (an ``hf_ext.runtime.Hardware``): resolve for it (a GPU's precision and bucket sizes) instead of this CPU."""
    import hf_ext
    from hf_ext.deepspeed.resolve import resolve_deepspeed_config

    args = hf_ext.Seq2SeqTrainingArguments(str(workdir / "resolve"), per_device_eval_batch_size=opts.per_device_eval_batch_size,
                                           report_to=[], use_cpu=True)  # fmt: skip
    extra = {"hardware": hardware} if hardware is not None else {}
    config = resolve_deepspeed_config("zero3", args, model=model, world_size=world_size, num_training_steps=1, **extra)
    for section in ("optimizer", "scheduler"):  # eval only: stock's inference set-up refuses step-count mismatches
        config.pop(section, None)
    return harness.write_json(workdir / "ds_config.json", config)


def launch(path: str, model: Path, config: Path, opts, workdir: Path) -> list[dict]:
    cmd = harness.launcher_cmd("deepspeed", MODULE) + ["--worker", "--path", path, "--model", str(model),
                                                       "--ds_config", str(config), "--workdir", str(workdir)]  # fmt: skip
    cmd += ["--n_eval", str(opts.n_eval), "--per_device_eval_batch_size", str(opts.per_device_eval_batch_size)]
    cmd += ["--num_beams", str(opts.num_beams), "--max_length", str(opts.max_length), "--threads", str(opts.threads)]
    log = workdir / f"{path}.log"
    if harness.run(cmd, log):
        raise SystemExit(f"{path} launch failed (see {log}):\n{log.read_text()[-3000:]}")
    return [json.loads((workdir / f"{path}.rank{rank}.json").read_text()) for rank in (0, 1)]


def table(report: dict) -> str:
    stock = max(r["seconds"] for r in report["paths"]["stock"])
    rows = []
    for path in PATHS:
        ranks = report["paths"][path]
        seconds = max(r["seconds"] for r in ranks)
        peaks = " / ".join(f"{r['peak_extra_rss_bytes'] / 2**20:.0f}" for r in ranks)
        parts = "" if path == "stock" else f"{max(r['generation_seconds'] for r in ranks):.1f} s"
        if path == "gathered":
            parts += f" (gather {max(r['gather_seconds'] for r in ranks):.1f} s)"
        same = "reference" if path == "stock" else ("yes" if report["same_generations_as_stock"][path] else "NO")
        rows.append([path if path == "stock" else f"hf-ext, {path}", f"{seconds:.1f} s", parts or "—",
                     f"{stock / seconds:.2f}×", f"{peaks} MiB", same])  # fmt: skip
    header = ["eval (ZeRO-3, 2 ranks)", "evaluate() wall time", "of which generation", "speed-up vs stock",
              "peak extra RSS rank 0 / 1", "same generations as stock"]  # fmt: skip
    return harness.markdown_table(header, rows)


def main(argv=None) -> dict:
    opts = parse(argv)
    if opts.worker:
        worker(opts)
        return {}
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="bench_eval_zero3_"))
    model = harness.ensure_model(opts.size, workdir / f"model-{opts.size}")
    config = resolved_config(model, opts, workdir)
    paths = {}
    for path in PATHS:
        paths[path] = launch(path, model, config, opts, workdir)
        print(f"{path}: {max(r['seconds'] for r in paths[path]):.1f} s", flush=True)
    stock_gens = paths["stock"][0]["generations"]
    report = {
        "command": harness.command(MODULE, argv),
        "size": opts.size,
        "parameters": harness.parameter_count(model),
        "world_size": 2,
        "zero_stage": 3,
        "eval_rows": opts.n_eval,
        "generation": {
            "num_beams": opts.num_beams,
            "max_length": opts.max_length,
            "per_device_eval_batch_size": opts.per_device_eval_batch_size,
        },  # fmt: skip
        "host": harness.host_info(),
        "paths": paths,
        "same_generations_as_stock": {p: paths[p][0]["generations"] == stock_gens for p in PATHS[1:]},
        "speedup_gathered_vs_stock": max(r["seconds"] for r in paths["stock"])
        / max(r["seconds"] for r in paths["gathered"]),
        "speedup_per_token_vs_stock": max(r["seconds"] for r in paths["stock"])
        / max(r["seconds"] for r in paths["per-token"]),
    }
    harness.write_json(opts.out, report)
    text = table(report)
    print(text)
    if opts.doc:
        name = f"bench-eval-zero3-{opts.size}-beams{opts.num_beams}-len{opts.max_length}"
        harness.write_section(opts.doc, name, f"`{report['command']}`\n\n{text}")
    return report


if __name__ == "__main__":
    main()
