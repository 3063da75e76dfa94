"""A model DDP cannot train on this machine: GPT-2 pre-training from scratch (``from_config``, like the blog's GPT-2 XL
run), planned for DDP and ZeRO on 2 ranks, then trained under ZeRO-3 with CPU offload (``--config``).

    python -m benchmarks.bench_gpt2 --n_embd 1280 --n_layer 28 --n_head 20 --out runs/bench/gpt2_615m.json

1. The planner (``hf-ext ds plan``'s ``run_plan``, budget = available RAM ÷ 2 ranks, fp32 as this CPU trains) for
   every configuration: DDP needs the whole model, its gradients and Adam's state on each rank; ZeRO-3 splits them.
2. A fresh 2-rank launch of the training worker (``benchmarks.worker --from_config``, micro-batch 1) under
   ``--config`` (an hf-ext preset) trains ``--steps`` steps and reports each rank's peak resident memory.

DDP is not launched: the plan says it cannot fit, and an OOM-killed run would take the machine's other work with it.
On a CPU-only host offloaded states stay in the same RAM; offload still lowers the peak because the optimizer step
then runs on the offloaded fp32 state, without the transient a device-side ZeRO-3 step allocates (the planner's
``step_transient`` term; each term is in the JSON).
Prints a Markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_gpt2"
GiB = 2**30


def write_config(model_dir: Path, n_embd: int, n_layer: int, n_head: int, seq_len: int) -> Path:
    from transformers import GPT2Config

    model_dir.mkdir(parents=True, exist_ok=True)
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=max(1024, seq_len),
                        architectures=["GPT2LMHeadModel"])  # fmt: skip
    config.save_pretrained(model_dir)
    return model_dir


def table(report: dict) -> str:
    rows = []
    for row in report["plan"]["rows"]:
        if row["config"] not in (
            "DDP",
            "ZeRO-2",
            "ZeRO-3",
            "ZeRO-3 + offload optimizer",
            "ZeRO-3 + offload optimizer+param",
        ):
            continue
        at_one = row.get("plan_at_micro_batch") or row["plan_at_max"]
        verdict = "fits" if row["max_micro_batch"] else "does not fit"
        rows.append([row["config"], f"{at_one['total_bytes'] / GiB:.2f}", verdict, row["max_micro_batch"] or "—"])
    measured = report.get("trained")
    if measured:
        peaks = " / ".join(f"{p / GiB:.2f}" for p in measured["peak_bytes"])
        rows.append([f"{measured['config']}, trained: measured peak RSS per rank", peaks,
                     f"trained {measured['steps']} steps", 1])  # fmt: skip
    header = ["configuration", "GiB per rank at micro-batch 1", f"budget {report['plan']['budget_bytes'] / GiB:.2f}"
              " GiB per rank", "largest micro-batch"]  # fmt: skip
    return harness.markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_embd", type=int, default=1280)
    parser.add_argument("--n_layer", type=int, default=36)
    parser.add_argument("--n_head", type=int, default=20)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--config", default="zero3_offload", help="the hf-ext DeepSpeed preset of the trained run")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: runs/bench_gpt2)")
    opts = parser.parse_args(argv)

    from hf_ext.memory.report import jsonable, run_plan

    workdir = Path(opts.workdir or harness.ROOT / "runs" / "bench_gpt2")
    model = write_config(workdir / f"gpt2-{opts.n_embd}x{opts.n_layer}", opts.n_embd, opts.n_layer, opts.n_head,
                         opts.seq_len)  # fmt: skip
    plan = jsonable(run_plan(str(model), 2, seq_len=opts.seq_len, micro_batch=1, precision="fp32"))
    report = {"command": harness.command(MODULE, argv), "parameters": plan["num_params"], "plan": plan,
              "host": harness.host_info()}  # fmt: skip
    args = ["--model", str(model), "--from_config", "--config", opts.config, "--path", "hf-ext", "--batch", "1",
            "--seq_len", str(opts.seq_len), "--steps", str(opts.steps)]  # fmt: skip
    results = harness.launch_worker(args, workdir / opts.config)
    if isinstance(results, str):
        report["trained_error"] = results
    else:
        report["trained"] = {"config": opts.config, "steps": opts.steps, "peak_bytes": [r["peak_bytes"] for r in results],
                               "increment_bytes": [r["increment_bytes"] for r in results],
                               "final_loss": results[0]["final_loss"], "plan": results[0]["plan"]}  # fmt: skip
    return harness.finish(report, table(report), opts.out)


if __name__ == "__main__":
    main()
