"""Preemption: seconds from a SIGTERM to every rank exited with its checkpoint, and what the per-step agreement costs.

    python -m benchmarks.bench_preemption --repeats 3 --out runs/bench/preemption.json --doc docs/benchmarks.md

Both parts run ``recipes/blenderbot.py`` under ``torchrun --nproc_per_node 2`` (CPU ranks, gloo), ``--do_eval false
--samples_to_print 0``:

* **signal to exit**: for each engine (ZeRO-2, ZeRO-3) and model (the tiny BlenderBot of ``recipes/configs/tiny.yaml``;
  SmolLM2-135M-Instruct, the 100M-class chat model of ``recipes/configs/demo.yaml`` without LoRA: a full
  fine-tune, the largest checkpoint), rank 1 sends SIGTERM to torchrun at the end of step ``--signal_step``
  (``tests/launched/signal_at.py``, the tests' hook, on ``PYTHONPATH``); torchrun passes it to both ranks, which
  agree on a step, write the checkpoint and exit. The time runs from the signal to torchrun's exit (every rank gone),
  and the checkpoint's size is read from disk.
* **agreement cost**: the tiny recipe for ``--steps`` steps with ``save_on_preemption`` on (one all-reduce of two
  integers after every step) and off, alternating, ``--repeats`` times; the ratio of ``train_steps_per_second``
  (on / off) per pair, and its geometric mean with a 95 % interval.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness
from hf_ext.sizes import dir_bytes

RECIPE = harness.ROOT / "recipes" / "blenderbot.py"
CONFIGS = harness.ROOT / "recipes" / "configs"
SIGNAL_SITE = harness.ROOT / "tests" / "launched"
MODELS = {  # name: recipe arguments
    "tiny BlenderBot": ["--config", str(CONFIGS / "tiny.yaml")],
    "SmolLM2-135M (full)": ["--config", str(CONFIGS / "demo.yaml"), "--use_peft", "false"],
}
ENGINES = {"ZeRO-2": "zero2", "ZeRO-3": "zero3"}
SIGNAL_LINE = re.compile(r"SIGTERM to launcher \(pid \d+\) at step \d+ at ([\d.]+)")


def recipe(out: Path, *extra: str) -> list[str]:
    return harness.launcher_cmd("torchrun", RECIPE) + ["--output_dir", str(out), "--do_eval", "false",
                                                        "--samples_to_print", "0", *extra]  # fmt: skip


def signal_to_exit(work: Path, model: str, engine: str, step: int) -> dict:
    out = work / f"signal-{ENGINES[engine]}-{model.split()[0]}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = recipe(out, *MODELS[model], "--deepspeed", ENGINES[engine], "--max_steps", str(step + 20))
    env = harness.launch_env({"HF_EXT_TEST_SIGNAL_AT": f"{step}:SIGTERM:launcher"})
    env["PYTHONPATH"] = f"{SIGNAL_SITE}:{env['PYTHONPATH']}"
    proc = subprocess.run(cmd, cwd=harness.ROOT, env=env, capture_output=True, text=True)
    ended = time.time()
    log = proc.stdout + proc.stderr
    sent = SIGNAL_LINE.search(log)
    saved = sorted(out.glob("checkpoint-*"))
    if sent is None or len(saved) != 1:
        return {"model": model, "engine": engine, "error": log[-500:]}
    return {"model": model, "engine": engine, "seconds": round(ended - float(sent.group(1)), 2),
            "checkpoint": saved[0].name, "checkpoint_mib": round(dir_bytes(saved[0]) / harness.MiB, 1)}  # fmt: skip


def steps_per_second(work: Path, on: bool, steps: int) -> float:
    out = work / f"cost-{'on' if on else 'off'}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = recipe(out, *MODELS["tiny BlenderBot"], "--deepspeed", "zero2", "--max_steps", str(steps),
                 "--save_on_preemption", str(on).lower(), "--logging_steps", str(steps))  # fmt: skip
    code = harness.run(cmd, out.with_suffix(".log"))
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}: see {out.with_suffix('.log')}")
    return json.loads((out / "all_results.json").read_text())["train_steps_per_second"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--signal_step", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--work", default="runs/bench/preemption")
    harness.add_publish_arguments(parser, out=None, section="bench-preemption")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    exits = [signal_to_exit(work, model, engine, args.signal_step) for model in args.models for engine in ENGINES]
    pairs = []
    for _ in range(args.repeats):
        on, off = steps_per_second(work, True, args.steps), steps_per_second(work, False, args.steps)
        pairs.append({"on": on, "off": off, "ratio": on / off})
    mean, low, high = harness.geometric_mean_interval([p["ratio"] for p in pairs]) if pairs else (None, None, None)

    exit_rows = [[e["model"], e["engine"], e.get("checkpoint", "-"), e.get("checkpoint_mib", "-"),
                  e.get("seconds", "failed")] for e in exits]  # fmt: skip
    text = "\n\n".join([
        f"`{harness.command('benchmarks.bench_preemption', argv)}`",
        harness.markdown_table(["model", "engine", "checkpoint", "size (MiB)", "SIGTERM to every rank exited (s)"],
                               exit_rows),
    ] + ([
        harness.markdown_table(["steps/s, save_on_preemption on", "off", "ratio on / off"],
                               [[f"{p['on']:.3f}", f"{p['off']:.3f}", f"{p['ratio']:.3f}"] for p in pairs]),
        f"Agreement cost: on / off = **{mean:.3f}** (95 % interval {low:.3f}-{high:.3f}, {args.repeats} pairs of "
        f"{args.steps} steps of the tiny recipe, ZeRO-2, 2 CPU ranks).",
    ] if pairs else []))  # fmt: skip
    report = {"host": harness.host_info(), "exits": exits, "cost_pairs": pairs,
              "cost_ratio": {"mean": mean, "low": low, "high": high}}  # fmt: skip
    if args.doc:
        harness.write_section(args.doc, args.section, text)
    return harness.finish(report, text, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
