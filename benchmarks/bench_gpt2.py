"""A model DDP cannot train on this machine: GPT-2 pre-training from scratch (``from_config``, like the blog's GPT-2 XL
run), planned for DDP and ZeRO on 2 ranks, then trained under ZeRO-3 (``--config``).

    python -m benchmarks.bench_gpt2 --n_embd 1280 --n_layer 28 --n_head 20 --steps 3 --out runs/bench/gpt2_617m.json

1. The planner (``hf-ext ds plan``'s ``run_plan``, budget = available RAM ÷ 2 ranks, fp32 as this CPU trains) for
   every configuration: DDP needs the whole model, its gradients and Adam's state on each rank; ZeRO-3 splits them.
   On a CPU-only host the ZeRO-3 rows are planned with the sizes hf-ext's presets run with there
   (``hf_ext.memory.formulas.CPU_ZERO3_GRANULARITY``).
2. A fresh 2-rank launch of the training worker (``benchmarks.worker --from_config``, micro-batch 1) under
   ``--config`` (an hf-ext preset) trains ``--steps`` steps with freed memory returned to the OS (as a planned run
   does) and reports each rank's peak resident memory above the process's own, beside the planner's row for it.

DDP is not launched: the plan says it cannot fit, and an OOM-killed run would take the machine's other work with it.
On a CPU-only host offloaded states stay in the same RAM, and ZeRO-3 offload costs a second gradient partition
(DeepSpeed keeps its gradient-accumulation partition beside the optimizer's fp32 copy): plain ZeRO-3 needs less.
Prints a Markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_gpt2"
GiB = 2**30
#: the planner's row for each preset the run can train
PRESET_ROWS = {"zero3": "ZeRO-3", "zero3_offload": "ZeRO-3 + offload optimizer+param"}


def write_config(model_dir: Path, n_embd: int, n_layer: int, n_head: int, seq_len: int) -> Path:
    from transformers import GPT2Config

    model_dir.mkdir(parents=True, exist_ok=True)
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=max(1024, seq_len),
                        architectures=["GPT2LMHeadModel"])  # fmt: skip
    config.save_pretrained(model_dir)
    return model_dir


def table(report: dict) -> str:
    rows = []
    measured = report.get("trained")
    for row in report["plan"]["rows"]:
        if row["config"] not in ("DDP", "ZeRO-2", *PRESET_ROWS.values()):
            continue
        at_one = row.get("plan_at_micro_batch") or row["plan_at_max"]
        low, high = at_one["band"]
        verdict = f"fits, up to micro-batch {row['max_micro_batch']}" if row["max_micro_batch"] else "does not fit"
        cells = [row["config"], f"{at_one['total_bytes'] / GiB:.2f} ({low / GiB:.2f}–{high / GiB:.2f})", verdict]
        if measured and row["config"] == PRESET_ROWS.get(measured["config"]):
            peak = max(measured["increment_bytes"])
            cells += [f"{peak / GiB:.2f}", f"{at_one['total_bytes'] / peak:.2f}"]
        else:
            cells += ["—", "—"]
        rows.append(cells)
    header = ["configuration", "planned GiB per rank at micro-batch 1 (band)",
              f"verdict, budget {report['plan']['budget_bytes'] / GiB:.2f} GiB per rank",
              "measured peak GiB per rank", "planned ÷ measured"]  # fmt: skip
    return harness.markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_embd", type=int, default=1280)
    parser.add_argument("--n_layer", type=int, default=36)
    parser.add_argument("--n_head", type=int, default=20)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config", default="zero3", choices=list(PRESET_ROWS), help="the trained run's hf-ext preset")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: runs/bench_gpt2)")
    opts = parser.parse_args(argv)

    from hf_ext.memory.report import jsonable, run_plan

    workdir = Path(opts.workdir or harness.ROOT / "runs" / "bench_gpt2")
    model = write_config(workdir / f"gpt2-{opts.n_embd}x{opts.n_layer}", opts.n_embd, opts.n_layer, opts.n_head,
                         opts.seq_len)  # fmt: skip
    # on this CPU host the plan uses the ZeRO-3 sizes the presets run with
    plan = jsonable(run_plan(str(model), 2, seq_len=opts.seq_len, micro_batch=1, precision="fp32"))
    report = {"command": harness.command(MODULE, argv), "parameters": plan["num_params"], "plan": plan,
              "host": harness.host_info()}  # fmt: skip
    args = ["--model", str(model), "--from_config", "--config", opts.config, "--path", "hf-ext", "--batch", "1",
            "--seq_len", str(opts.seq_len), "--steps", str(opts.steps), "--release_freed_memory", "on"]  # fmt: skip
    results = harness.launch_worker(args, workdir / opts.config)
    if isinstance(results, str):
        report["trained_error"] = results
    else:
        report["trained"] = {"config": opts.config, "steps": opts.steps, "peak_bytes": [r["peak_bytes"] for r in results],
                             "baseline_bytes": [r["baseline_bytes"] for r in results],
                             "increment_bytes": [r["increment_bytes"] for r in results],
                             "phases": [r["phases"] for r in results], "final_loss": results[0]["final_loss"]}  # fmt: skip
    return harness.finish(report, table(report), opts.out)


if __name__ == "__main__":
    main()
