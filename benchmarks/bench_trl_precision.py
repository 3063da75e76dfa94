"""TRL's default precision on a CPU beside hf-ext's: seconds per DPO step of a chat model with LoRA.

    python -m benchmarks.bench_trl_precision --model smollm2 --steps 3 --out runs/bench/trl_precision.json \
        --doc docs/benchmarks.md

Stock ``trl.DPOConfig`` turns ``bf16`` on unless ``fp16`` is set, on a CPU too; ``hf_ext.trl.DPOConfig`` takes the
hardware's default precision (``hf_ext.runtime.Hardware.default_precision``: fp32 on a CPU). Everything else is the
same and left as given: one process on the CPU (``use_cpu``), LoRA rank 16 on every linear layer, ``--batch`` pairs
per step of ``--seq_len`` token ids each (half prompt; bench_trl's seeded rows), activation checkpointing off, TRL's
other defaults. Each path runs in a fresh process, one after the other; a step's time is the time between two step
ends, the first step (warm-up) left out, and the median is reported.

``--model`` is a :func:`benchmarks.harness.ensure_model` name (``smollm2``: SmolLM2-135M-Instruct from the GGUF file
``make setup`` installs) or a model directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_trl_precision"
PATHS = ("stock", "hf_ext")


def worker(opts) -> None:
    """One path's run, its results written to ``opts.result``."""
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from benchmarks.bench_trl import preference_rows

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = preference_rows(opts.batch * opts.steps, tokenizer, opts.seq_len)
    common = dict(output_dir=opts.workdir, per_device_train_batch_size=opts.batch, max_steps=opts.steps,
                  max_length=2 * opts.seq_len, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                  seed=0, disable_tqdm=True, use_cpu=True, gradient_checkpointing=False)  # fmt: skip
    if opts.path == "stock":
        config_class, trainer_class = trl.DPOConfig, trl.DPOTrainer
    else:
        from hf_ext import trl as hf_trl

        config_class, trainer_class = hf_trl.DPOConfig, hf_trl.DPOTrainer
    args = config_class(**common)
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    import datasets

    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(opts.model),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[StepClock()],
    )
    trainer.train()
    steps = [b - a for a, b in zip(ends, ends[1:])]
    result = {
        "path": opts.path,
        "bf16": bool(args.bf16),
        "step_seconds": steps,
        "median_step_s": statistics.median(steps),
    }
    Path(opts.result).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="harness.ensure_model name or a model directory")
    parser.add_argument("--steps", type=int, default=3, help="steps per path (the first is warm-up)")
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--seq_len", type=int, default=110, help="token ids per pair (half prompt)")
    harness.add_publish_arguments(parser, out=None, section="trl_precision")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.steps < 2:
        parser.error("--steps must be at least 2: the first step is warm-up.")
    if opts.worker:
        worker(opts)
        return {}
    model = Path(opts.model) if Path(opts.model).is_dir() else harness.ensure_model(opts.model)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-trl-precision-") as tmp:
        for path in PATHS:  # fresh processes, one after the other
            result = Path(tmp) / f"{path}.json"
            cmd = [sys.executable, "-m", MODULE, "--worker", "--path", path, "--model", str(model), "--steps",
                   str(opts.steps), "--batch", str(opts.batch), "--seq_len", str(opts.seq_len), "--workdir",
                   str(Path(tmp) / path), "--result", str(result)]  # fmt: skip
            subprocess.run(cmd, check=True, env=harness.launch_env(), cwd=harness.ROOT)
            results[path] = json.loads(result.read_text())
    stock, ours = results["stock"], results["hf_ext"]
    ratio = stock["median_step_s"] / ours["median_step_s"]
    report = {"model": str(model), "batch": opts.batch, "seq_len": opts.seq_len, "steps": opts.steps,
              "paths": results, "stock_over_hf_ext": ratio}  # fmt: skip
    rows = [[name, "bf16 autocast" if r["bf16"] else "fp32", f"{r['median_step_s']:.1f}"]
            for name, r in (("stock trl.DPOConfig()", stock), ("hf_ext.trl.DPOConfig()", ours))]  # fmt: skip
    note = (
        f"`{Path(model).name}`, LoRA rank 16, DPO, {opts.batch} pairs of {opts.seq_len} token ids per step, one "
        f"process on the CPU; the median of {opts.steps - 1} steps after the first. hf-ext's default is "
        f"**{ratio:.1f}x faster** per step."
    )
    table = harness.markdown_table(["config (defaults)", "precision", "s/step"], rows)
    return harness.publish(MODULE, argv, [note, table], report, opts)


if __name__ == "__main__":
    main()
