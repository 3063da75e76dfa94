#!/usr/bin/env python
"""Training throughput of the tiny recipe under every launcher, and hf-ext's CPU thread placement vs stock's.

    python scripts/bench_launchers.py --out runs/bench/launchers.json [--steps 60]

Runs recipes/blenderbot.py (configs/tiny.yaml) for ``--steps`` optimizer steps under ``deepspeed --num_gpus 2``,
``torchrun --nproc_per_node 2 --deepspeed``, ``accelerate launch`` (ZeRO-2) and plain ``python``, then once more under
``deepspeed`` with the thread count stock transformers/accelerate picks on this machine (set through
OMP_NUM_THREADS, which hf-ext respects). Prints a markdown table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


STOCK_PROBE = """
import torch
from transformers import TrainingArguments
args = TrainingArguments(output_dir="{out}", use_cpu=True, deepspeed="zero2")
print("THREADS", torch.get_num_threads(), flush=True)
"""


def stock_threads_per_rank(tmp: str) -> int:
    """The intra-op threads a rank gets from stock transformers/accelerate under `deepspeed --num_gpus 2`."""
    probe = Path(tmp) / "stock_probe.py"
    probe.write_text(STOCK_PROBE.format(out=Path(tmp) / "probe"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port(), str(probe)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    return max(int(line.split()[1]) for line in out.splitlines() if line.startswith("THREADS"))


def launch(name: str, model_dir: str, out: Path, steps: int, env_extra: dict) -> dict:
    recipe = str(ROOT / "recipes" / "blenderbot.py")
    prefix = {
        "deepspeed": [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port(), recipe],
        "torchrun": [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port(), recipe],
        "accelerate": [
            str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "recipes/accelerate/zero2.yaml"),
            "--main_process_port", port(), recipe,
        ],
        "python": [sys.executable, recipe],
    }[name.split("+")[0]]  # fmt: skip
    extra = ["--deepspeed", "zero2"] if name.startswith("torchrun") else []
    cmd = prefix + [
        "--config", "recipes/configs/tiny.yaml", "--model_name_or_path", model_dir, "--output_dir", str(out),
        "--max_steps", str(steps), "--samples_to_print", "0", "--do_eval", "false", "--logging_steps", "1000",
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env.update(env_extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    return {
        "launcher": name,
        "samples_per_second": results["train_samples_per_second"],
        "train_loss": results["train_loss"],
        **{k: results["run"][k] for k in ("world_size", "engine", "zero_stage", "torch_threads")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/launchers.json")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    from chat_e.models import build

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build(f"{tmp}/tiny", "tiny", seed=0))
        rows = []
        for name in ("deepspeed", "torchrun", "accelerate", "python"):
            rows.append(launch(name, model_dir, Path(tmp) / name, args.steps, {}))
            print(rows[-1], flush=True)
        stock = {"OMP_NUM_THREADS": str(stock_threads_per_rank(tmp))}
        rows.append(launch("deepspeed+stock-threads", model_dir, Path(tmp) / "stock", args.steps, stock))
        print(rows[-1], flush=True)
    ours = rows[0]["samples_per_second"]
    speedup = ours / rows[-1]["samples_per_second"]
    result = {"steps": args.steps, "cores": os.cpu_count(), "rows": rows, "speedup_vs_stock_threads": speedup}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        "\n| launcher | world size | engine | ZeRO | threads/rank | samples/s | final loss |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['launcher']} | {r['world_size']} | {r['engine']} | {r['zero_stage']} | {r['torch_threads']} | "
            f"{r['samples_per_second']:.1f} | {r['train_loss']:.4f} |"
        )
    print(f"\nhf-ext thread placement vs stock under `deepspeed`: {result['speedup_vs_stock_threads']:.2f}x")


if __name__ == "__main__":
    main()
