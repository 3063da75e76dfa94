"""Padding-free training against the stock padded path: real tokens per second, memory, and the loss it reaches.

    python -m benchmarks.bench_packing --out runs/bench/packing.json --doc docs/benchmarks.md

For each model (the demo's SmolLM2-135M-Instruct with LoRA, and a full fine-tune of the tiny random-init chat model),
the same rows (the dialogue recipe's chitchat + chatterbot rows, the demo's lengths: up to 96 prompt and 32 reply
tokens), the same DeepSpeed ZeRO-2 config, the same seed and epochs, on 2 ranks: stock ``transformers.Trainer``
padding each micro-batch to its longest row, hf-ext's ``padding_free`` with the ``batch_rebalance`` sampler, and TRL's
``SFTTrainer(padding_free=True)`` (benchmarks.packing_worker, one fresh 2-rank launch per run, paths alternating
launch by launch). Every path trains on every row once per epoch, so all of them have seen the same real tokens when
their eval loss is taken.

Reported: steady real tokens per second (the Trainer's own count of non-padding tokens, from the end of step
``--warmup`` to the last step), its ratio to stock, the peak resident memory per rank above the level before the model
loaded (both paths with glibc returning freed memory to the OS, ``harness.FREED_MEMORY_TO_OS_ENV``), and the eval
loss after training with its difference from stock's. Both paths run one torch thread per rank (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks import harness
from hf_ext.deepspeed.resolve import load_deepspeed_config

MODULE = "benchmarks.bench_packing"
PATHS = ("stock", "hf-ext", "trl")
#: model name -> (model to build, worker flags): the demo's LoRA run, and a full fine-tune of the tiny chat model
MODELS = {
    "smollm2-lora": ("smollm2", ["--lora", "--learning_rate", "3e-3"]),
    "chat-tiny-full": ("chat-tiny", ["--learning_rate", "1e-3"]),
}


def steady_tokens_per_second(rank0: dict, warmup: int) -> float:
    steps = rank0["steps"]
    (t0, n0), (t1, n1) = steps[warmup - 1], steps[-1]
    return (n1 - n0) / (t1 - t0)


def run_row(model: str, path: str, repeat: int, ranks: list[dict], warmup: int, wall: float) -> dict:
    rank0 = next(r for r in ranks if r["rank"] == 0)
    return {
        "model": model, "path": path, "repeat": repeat, "steps": len(rank0["steps"]),
        "real_tokens": rank0["steps"][-1][1], "tokens_per_s": steady_tokens_per_second(rank0, warmup),
        "samples_per_s": rank0["global_batch"] * (len(rank0["steps"]) - warmup)
        / (rank0["steps"][-1][0] - rank0["steps"][warmup - 1][0]),
        "peak_increment_bytes_per_rank": [r["peak_increment_bytes"] for r in sorted(ranks, key=lambda r: r["rank"])],
        "eval_loss": rank0["eval_loss"], "final_loss": rank0["final_loss"], "wall_s": round(wall, 1),
        "torch_threads": rank0["torch_threads"],
    }  # fmt: skip


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        med = {}
        for path in PATHS:
            group = [r for r in rows if r["model"] == model and r["path"] == path]
            if group:
                med[path] = {
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in group),
                    "samples_per_s": statistics.median(r["samples_per_s"] for r in group),
                    "peak_mib": statistics.median(max(r["peak_increment_bytes_per_rank"]) for r in group) / 2**20,
                    "eval_loss": statistics.median(r["eval_loss"] for r in group),
                    "real_tokens": group[0]["real_tokens"],
                    "runs": len(group),
                }
        stock = med["stock"]
        for m in med.values():
            m["tokens_ratio"] = m["tokens_per_s"] / stock["tokens_per_s"]
            m["eval_loss_vs_stock"] = m["eval_loss"] / stock["eval_loss"] - 1
        out.append({"model": model, "paths": med})
    return out


def table(summary: list[dict]) -> str:
    header = ["model", "path", "real tokens trained", "real tokens/s", "÷ stock", "samples/s", "peak MiB per rank",
              "eval loss", "vs stock"]  # fmt: skip
    rows = []
    for s in summary:
        for path, m in s["paths"].items():
            rows.append([
                s["model"], path, f"{m['real_tokens']:,}", f"{m['tokens_per_s']:.0f}",
                f"**{m['tokens_ratio']:.2f}×**" if path != "stock" else "1", f"{m['samples_per_s']:.2f}",
                f"{m['peak_mib']:.0f}", f"{m['eval_loss']:.4f}",
                f"{100 * m['eval_loss_vs_stock']:+.2f} %" if path != "stock" else "–",
            ])  # fmt: skip
    return harness.markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--n_train", type=int, default=160)
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch and rank")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    parser.add_argument("--repeats", type=int, default=1, help="launches per path and model")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every path")
    parser.add_argument("--reuse", action="store_true", help="reuse the launches an interrupted run left")
    parser.add_argument("--out", default="runs/bench/packing.json")
    parser.add_argument("--doc", default=None, help="write the table into this Markdown file's packing section")
    args = parser.parse_args(argv)
    out = Path(args.out)
    work = out.with_suffix("")
    config = work.parent / f"{work.name}_zero2.json"
    harness.write_json(config, load_deepspeed_config("zero2"))
    env = {"OMP_NUM_THREADS": args.threads, **harness.FREED_MEMORY_TO_OS_ENV}
    host_before = harness.host_info()
    rows = []
    for name in args.models:
        size, flags = MODELS[name]
        model = harness.ensure_model(size)
        for repeat in range(args.repeats):
            order = args.paths if repeat % 2 == 0 else list(reversed(args.paths))
            for path in order:
                started = time.time()
                result = harness.launch_worker(
                    ["--model", str(model), "--path", path, "--config", str(config), "--epochs", str(args.epochs),
                     "--n_train", str(args.n_train), "--batch", str(args.batch), *flags],
                    Path(f"{work}_{name}_{path}_{repeat}"), env, target="benchmarks.packing_worker", reuse=args.reuse,
                )  # fmt: skip
                if isinstance(result, str):
                    raise SystemExit(f"{name} {path}: {result}")
                row = run_row(name, path, repeat, result, args.warmup, time.time() - started)
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = summarize(rows)
    report = {
        "command": harness.command(MODULE, argv), "world_size": 2, "config": "zero2", "epochs": args.epochs,
        "n_train": args.n_train, "batch": args.batch, "warmup": args.warmup, "threads": args.threads,
        "host_before": host_before, "load_average_after": harness.load_average(), "rows": rows, "summary": summary,
    }  # fmt: skip
    text = table(summary)
    if args.doc:
        harness.write_section(args.doc, "packing", f"`{report['command']}`\n\n{text}")
    return harness.finish(report, text, out)


if __name__ == "__main__":
    main()
