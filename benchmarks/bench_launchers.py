"""Training throughput of the tiny recipe under every launcher, and hf-ext's CPU thread placement vs stock's.

    python -m benchmarks.bench_launchers --out runs/bench/launchers.json --steps 60

Runs recipes/blenderbot.py (configs/tiny.yaml) for ``--steps`` optimizer steps under ``deepspeed --num_gpus 2``,
``torchrun --nproc_per_node 2 --deepspeed``, ``accelerate launch`` (ZeRO-2) and plain ``python``, then once more under
``deepspeed`` with the thread count stock transformers/accelerate picks on this machine (set through
OMP_NUM_THREADS, which hf-ext respects). The threads, world size, engine and ZeRO stage of each run are the recipe's
own report (``hf_ext.runtime.run_summary``). Prints a markdown table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import harness

RECIPE = harness.ROOT / "recipes" / "blenderbot.py"
LAUNCHERS = {
    "deepspeed": ("deepspeed", []),
    "torchrun": ("torchrun", ["--deepspeed", "zero2"]),
    "accelerate": (f"accelerate:{harness.ROOT / 'recipes' / 'accelerate' / 'zero2.yaml'}", []),
    "python": ("python", []),
}
STOCK_PROBE = """
import torch
from transformers import TrainingArguments
args = TrainingArguments(output_dir="{out}", use_cpu=True, deepspeed="{config}")
print("THREADS", torch.get_num_threads(), flush=True)
"""


def stock_threads_per_rank(tmp: Path) -> int:
    """The intra-op threads a rank gets from stock transformers/accelerate under `deepspeed --num_gpus 2`."""
    from hf_ext.deepspeed.resolve import load_deepspeed_config

    config = harness.write_json(tmp / "zero2.json", load_deepspeed_config("zero2"))  # stock knows no preset names
    probe = tmp / "stock_probe.py"
    probe.write_text(STOCK_PROBE.format(out=tmp / "probe", config=config))
    log = tmp / "stock_probe.log"
    if harness.run(harness.launcher_cmd("deepspeed", probe), log):
        raise SystemExit(f"the stock thread probe failed:\n{log.read_text()[-3000:]}")
    return max(int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("THREADS"))


def launch(name: str, model_dir: str, out: Path, steps: int, env_extra: dict | None = None) -> dict:
    launcher, extra = LAUNCHERS[name.split("+")[0]]
    cmd = harness.launcher_cmd(launcher, RECIPE) + [
        "--config", "recipes/configs/tiny.yaml", "--model_name_or_path", model_dir, "--output_dir", str(out),
        "--max_steps", str(steps), "--samples_to_print", "0", "--do_eval", "false", "--logging_steps", "1000",
        *extra,
    ]  # fmt: skip
    log = Path(f"{out}.log")
    if harness.run(cmd, log, env_extra):
        raise SystemExit(f"{name} failed:\n{log.read_text()[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    return {
        "launcher": name,
        "samples_per_second": results["train_samples_per_second"],
        "train_loss": results["train_loss"],
        **{k: results["run"][k] for k in ("world_size", "engine", "zero_stage", "torch_threads")},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/launchers.json")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = str(harness.ensure_model("tiny", tmp / "tiny"))
        rows = []
        for name in LAUNCHERS:
            rows.append(launch(name, model_dir, tmp / name, args.steps))
            print(rows[-1], flush=True)
        stock = {"OMP_NUM_THREADS": stock_threads_per_rank(tmp)}
        rows.append(launch("deepspeed+stock-threads", model_dir, tmp / "stock", args.steps, stock))
        print(rows[-1], flush=True)
    speedup = rows[0]["samples_per_second"] / rows[-1]["samples_per_second"]
    result = {
        "command": harness.command("benchmarks.bench_launchers", argv),
        "steps": args.steps,
        "host": harness.host_info(),
        "rows": rows,
        "speedup_vs_stock_threads": speedup,
    }
    harness.write_json(args.out, result)
    header = ["launcher", "world size", "engine", "ZeRO", "threads/rank", "samples/s", "final loss"]
    print()
    print(harness.markdown_table(header, [
        [r["launcher"], r["world_size"], r["engine"], r["zero_stage"], r["torch_threads"],
         f"{r['samples_per_second']:.1f}", f"{r['train_loss']:.4f}"]
        for r in rows
    ]))  # fmt: skip
    print(f"\nhf-ext thread placement vs stock under `deepspeed`: {speedup:.2f}x")
    return result


if __name__ == "__main__":
    main()
