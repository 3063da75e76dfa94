"""Stock and hf-ext training, taking turns inside one 2-rank launch (used by scripts/bench_train.py --interleave).

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 scripts/throughput_worker.py --model DIR --config ds.json \
        --segments 8 --steps 5 --out result

The launch trains ``--segments`` times, ``--steps`` optimizer steps each, alternating the path in the order
stock, hf-ext, hf-ext, stock, … (so a slow or fast stretch of the machine, and anything the process learns from an
earlier segment, falls on both paths alike). Every segment starts from nothing: its own TrainingArguments (stock's
with the JSON's "auto"s left to transformers, or hf-ext's, which resolves them), a freshly loaded model, its own
Trainer and DeepSpeed engine, all dropped before the next segment. Between launches the same path's throughput moves
5-10% on a shared host; segments a minute apart share the launch's placement (though not a host's faster drift).

Each rank writes ``OUT.rank<N>.json`` with one entry per segment: path, step end times (from ``train()``), CPU
usage per step, the time to build TrainingArguments, the engine start-up time, the final loss, the ZeRO stage the
engine ran with, and after the segment was torn down the resident set (it must not grow segment by segment) and
the number of DeepSpeed engines still alive (it must not grow either). It also times hf-ext's own callbacks
(``HookClock``): the extension's code that runs inside the training loop, measured directly rather than as the
difference of two noisy throughputs. ``--trace`` also counts every Python call of the training steps by package and
names the hf-ext functions among them (``StepCodeTracer``; it slows the steps, so not for timing).
Under ZeRO-3 that needs ``release_zero3_globals``: without it every dropped engine stays alive, with its partitions.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import transformers
from deepspeed import DeepSpeedEngine
from memory_worker import StepTimer, build_arguments, build_trainer

import hf_ext
from hf_ext.memory.measure import current_rss

ORDER = ("stock", "hf-ext", "hf-ext", "stock")


def release_zero3_globals() -> None:
    """Drop what DeepSpeed's ZeRO-3 keeps at module and class level after its engine is gone: the module stack of
    the forward hooks (the last model stays on it) and a method-level ``lru_cache`` of the parameter coordinator
    (keyed by the coordinator and the submodules). Left alone, each engine and its partitions stay alive."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK.clear()
    cached = vars(PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    # the cache sits under DeepSpeed's nvtx wrapper, which keeps it in its closure
    for candidate in (cached, *(cell.cell_contents for cell in cached.__closure__ or ())):
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()


class HookClock:
    """Wall time spent inside hf-ext's own callbacks, by event: the extension's code on the training loop's path.

    The Trainer calls each callback's ``on_<event>`` through ``getattr``; the instance's methods are replaced by
    timed ones. Stock segments have no hf-ext callback, so nothing is timed there.
    """

    ONCE = ("on_init_end", "on_train_begin", "on_train_end")  # not per step

    def __init__(self, trainer):
        self.seconds: dict[str, float] = {}
        for callback in trainer.callback_handler.callbacks:
            if type(callback).__module__.partition(".")[0] != "hf_ext":
                continue
            for name in dir(callback):
                if name.startswith("on_"):
                    setattr(callback, name, self._timed(name, getattr(callback, name)))

    def _timed(self, name, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        return timed

    def per_step_seconds(self, steps: int) -> float:
        return sum(t for name, t in self.seconds.items() if name not in self.ONCE) / steps


class StepCodeTracer(transformers.TrainerCallback):
    """Which Python functions run during the training steps, counted by package (``--trace``).

    A profile function (``sys.setprofile``) sees every Python call of the training thread from the first step's
    begin to the last step's end: the counts per package say how much interpreter work a step does on each path, and
    the hf-ext functions seen are the extension's own code on the step path (by name). Calls of this worker's own
    instruments (StepTimer, HookClock) count as ``benchmark``. Tracing slows a step several times over, so a traced
    segment's throughput means nothing.
    """

    PACKAGES = ("hf_ext", "transformers", "accelerate", "deepspeed", "torch")

    def __init__(self):
        self.calls: Counter = Counter()
        self.hf_ext_functions: Counter = Counter()
        self.steps = 0
        self._roots = {name: self._package_dir(name) for name in self.PACKAGES}
        self._roots["benchmark"] = str(Path(__file__).resolve().parent) + "/"  # this worker's timers and wrappers
        self._package_of: dict[str, str] = {}  # by code file, so that each file is classified once

    @staticmethod
    def _package_dir(name: str) -> str:
        module = sys.modules.get(name) or __import__(name)
        return str(Path(module.__file__).resolve().parent) + "/"

    def _package(self, filename: str) -> str:
        package = self._package_of.get(filename)
        if package is None:
            resolved = str(Path(filename).resolve())
            package = next((n for n, root in self._roots.items() if resolved.startswith(root)), "other")
            self._package_of[filename] = package
        return package

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        package = self._package(code.co_filename)
        self.calls[package] += 1
        if package == "hf_ext":
            self.hf_ext_functions[f"{Path(code.co_filename).name}:{getattr(code, 'co_qualname', code.co_name)}"] += 1

    def on_step_begin(self, args, state, control, **kwargs):
        if self.steps == 0:  # the first step: trace from here
            sys.setprofile(self._profile)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if state.global_step >= state.max_steps:
            sys.setprofile(None)

    def result(self) -> dict:
        return {
            "python_calls_per_step": {name: n / self.steps for name, n in sorted(self.calls.items())},
            "hf_ext_functions_in_steps": dict(self.hf_ext_functions),
        }


def segment(opts, path: str, index: int) -> tuple[dict, int]:
    args, trainer_class, args_seconds = build_arguments(opts, path, f"{opts.out}.run/{index}")
    timer = StepTimer()
    tracer = StepCodeTracer() if opts.trace else None
    trainer, _ = build_trainer(opts, args, trainer_class, timer, *([tracer] if tracer else []))
    hooks = HookClock(trainer)
    train_called = time.perf_counter()
    trainer.train()
    engine_config = args.hf_deepspeed_config.config
    result = {
        "segment": index,
        "path": path,
        "args_seconds": args_seconds,
        "engine_start_seconds": timer.train_begin - train_called,
        "step_end_times": [t - train_called for t in timer.step_ends],
        "step_usage": timer.step_usage,
        "final_loss": next(e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e),
        "hf_ext_hook_seconds": hooks.seconds,  # by event, summed over the segment
        "hf_ext_hook_seconds_per_step": hooks.per_step_seconds(len(timer.step_ends)),
        "zero_stage": engine_config["zero_optimization"]["stage"],
        "train_batch_size": engine_config["train_batch_size"],
        "engine_config": engine_config,  # the whole config the engine ran with: both paths' must be identical
        "global_batch": args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps,
        **(tracer.result() if tracer else {}),
    }
    # drop everything the segment built, as transformers does between hyper-parameter search trials
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        engine.destroy()  # DeepSpeed's own release (ZeRO-3's hooks)
    trainer.accelerator.free_memory()
    del trainer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    release_zero3_globals()
    gc.collect()
    result["rss_after_bytes"] = current_rss()
    result["engines_alive"] = sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())
    return result, args.process_index


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True, help="a DeepSpeed JSON path (both paths get the same file)")
    parser.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per segment")
    parser.add_argument("--segments", type=int, default=4, help="a multiple of 4 gives each path each position alike")
    parser.add_argument("--trace", action="store_true", help="count the Python calls of each step (slows steps)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()
    # what build_arguments reads for hf-ext (no memory plan, no activation checkpointing, glibc left alone)
    opts.activation_checkpointing, opts.memory_per_device, opts.release_freed_memory = False, None, "off"

    results, rank = [], 0
    for index in range(opts.segments):
        result, rank = segment(opts, ORDER[index % len(ORDER)], index)
        results.append(result)
    with open(f"{opts.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "segments": results}, f, indent=2)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
