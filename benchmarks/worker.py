"""The training worker every training bench launches on 2 ranks: stock transformers or hf-ext, same model, data,
seed and DeepSpeed config.

    deepspeed --num_gpus 2 --module benchmarks.worker --model DIR --config zero3 --path hf-ext --out OUT
    torchrun --nproc_per_node 2 -m benchmarks.worker --model DIR --config ddp --path stock --out OUT
    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --module benchmarks.worker --model DIR --config ds.json \\
        --segments 4 --steps 5 --trace --out OUT

``--config`` is ``ddp`` (plain DistributedDataParallel under torchrun, no DeepSpeed), ``fsdp`` (``fsdp="full_shard"``,
under torchrun) or anything hf-ext's
``deepspeed=`` accepts (a preset name, ``auto``, a JSON path). The stock path gets the same config loaded as is (its
"auto"s left to transformers), the hf-ext path resolves it.

One run (the default, ``--segments 0``) trains ``--path`` once and measures its memory: each rank writes
``OUT.rank<N>.json`` with its RSS before the model exists (``baseline_bytes``), the peak from there to the end of
training (``peak_bytes``, ``increment_bytes``), the peak and RSS at each phase (engine built, each step), the plan
and the DeepSpeed config the engine ran with, and the step times. A launch is a fresh pair of processes, so each
configuration's memory starts from the same state.

Interleaved (``--segments N``): the launch trains N times, ``--steps`` steps each, the paths taking turns in the
order stock, hf-ext, hf-ext, stock, … (a slow or fast stretch of the machine, and anything the process learns from
an earlier segment, falls on both paths alike). Every segment starts from nothing: its own TrainingArguments, a
freshly loaded model, its own Trainer and engine, all dropped before the next segment. Both paths run with the torch
threads hf-ext places (``hf_ext.runtime.place_cpu_threads``: cores ÷ local ranks unless ``OMP_NUM_THREADS`` is set).
Each rank writes ``OUT.rank<N>.json`` with one entry per segment: step end times, CPU usage per step, the time to
build TrainingArguments, the engine start-up time, the final loss, the engine's config, and after the segment was
torn down the resident set and the number of DeepSpeed engines still alive (neither may grow segment by segment).
hf-ext's own callbacks are timed (``HookClock``): the extension's code inside the training loop, measured directly
rather than as the difference of two noisy throughputs. ``--trace`` also counts every Python call of the training
steps by package and names the hf-ext functions among them (``StepCodeTracer``; it slows the steps, so a traced
segment's throughput means nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, default_data_collator

import hf_ext
import hf_ext.trainer  # noqa: F401 (both paths' code imported before any segment: a first import lands in none)
from benchmarks.harness import synthetic_dataset
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.memory.measure import current_rss, peak_rss, reset_peak_rss
from hf_ext.model_info import is_sequence_classifier, model_class, random_init_model
from hf_ext.runtime import place_cpu_threads, run_summary, start_deepspeed_comm

ORDER = ("stock", "hf-ext", "hf-ext", "stock")
RELEASE = {"auto": None, "on": True, "off": False}  # --release_freed_memory -> TrainingArguments.release_freed_memory


# --- instruments --------------------------------------------------------------------------------------------------


class StepTimer(transformers.TrainerCallback):
    """When training began (engine built) and when each optimizer step ended, for steady-state throughput; with the
    process's CPU seconds (user, system) and minor page faults at each of those moments, to tell where time went."""

    def __init__(self):
        self.train_begin: float | None = None
        self.step_ends: list[float] = []
        self.step_usage: list[tuple[float, float, int]] = []

    def _usage(self):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.step_usage.append((usage.ru_utime, usage.ru_stime, usage.ru_minflt))

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_begin = time.perf_counter()
        self._usage()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.perf_counter())
        self._usage()


class PhaseRecorder(transformers.TrainerCallback):
    """Peak RSS reached by the end of each phase (engine built, each step), and the RSS then."""

    def __init__(self):
        self.phases: list[tuple[str, int, int]] = []

    def _mark(self, name):
        self.phases.append((name, peak_rss(), current_rss()))

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark("engine_ready")

    def on_step_end(self, args, state, control, **kwargs):
        self._mark(f"step{state.global_step}")


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
    the hf-ext functions seen are the extension's own code on the step path (by name). Calls of the benchmarks'
    own instruments (StepTimer, HookClock) count as ``benchmark``.
    """

    PACKAGES = ("hf_ext", "transformers", "accelerate", "deepspeed", "torch")

    def __init__(self):
        self.calls: Counter = Counter()
        self.hf_ext_functions: Counter = Counter()
        self.steps = 0
        self._roots = {name: self._package_dir(name) for name in self.PACKAGES}
        self._roots["benchmark"] = str(Path(__file__).resolve().parent) + "/"
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


# --- one path's arguments and trainer -----------------------------------------------------------------------------


def build_arguments(opts, path: str, output_dir: str):
    """TrainingArguments and Trainer class of ``path`` (stock or hf-ext) for ``opts``, with DeepSpeed's comm started;
    and the seconds that took (hf-ext resolves its DeepSpeed config there)."""
    batch = opts.batch if opts.batch == "auto" else int(opts.batch)
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        max_steps=opts.steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        activation_checkpointing=opts.activation_checkpointing,
        bf16=opts.bf16,
    )
    if opts.config == "fsdp":  # stock's own flag on both paths: on CPU ranks stock runs DDP with it, hf-ext FSDP2
        common["fsdp"] = "full_shard"
    deepspeed = None if opts.config in ("ddp", "fsdp") else opts.config
    started = time.perf_counter()
    if path == "stock":
        if deepspeed is not None:
            deepspeed = load_deepspeed_config(deepspeed)  # the preset's JSON, "auto"s left to transformers
        args = transformers.TrainingArguments(use_cpu=not torch.cuda.is_available(), deepspeed=deepspeed, **common)
        trainer_class = transformers.Trainer
    else:
        extra = {"release_freed_memory": RELEASE[opts.release_freed_memory]}
        if opts.memory_per_device or "auto" in (opts.config, opts.batch):
            extra.update(memory_per_device=opts.memory_per_device, plan_model=opts.model, plan_seq_len=opts.seq_len)
        args = hf_ext.TrainingArguments(deepspeed=deepspeed, **common, **extra)
        hf_ext.prepare_run(args)  # as the recipe does: threads and malloc set before the model loads
        trainer_class = hf_ext.Trainer
    if deepspeed is not None:
        start_deepspeed_comm()  # on CPU stock's arguments start torch.distributed but not DeepSpeed's comm
    return args, trainer_class, time.perf_counter() - started


def build_trainer(opts, args, trainer_class, *callbacks):
    """A ``trainer_class`` with ``callbacks`` on the seeded model from ``opts.model`` and synthetic rows; and the
    peak RSS once the model was loaded."""
    transformers.set_seed(0)
    config = AutoConfig.from_pretrained(opts.model)
    if opts.from_config:  # pre-training from scratch, as the blog's GPT-2 run (ZeRO-3: built partitioned)
        model = random_init_model(config, seed=0)
    else:
        model = model_class(config).from_pretrained(opts.model)
    if opts.lora:  # as the dialogue recipe's --use_peft: every attention and MLP projection
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    after_load = peak_rss()
    # enough rows that every step gets full micro-batches on every rank
    rows = max(64, int(args.per_device_train_batch_size) * args.world_size * opts.steps)
    num_labels = model.config.num_labels if is_sequence_classifier(model) else None
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=synthetic_dataset(rows, model.config.vocab_size, opts.seq_len, num_labels=num_labels),
        data_collator=default_data_collator,
    )
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer, after_load


def engine_config(args) -> dict | None:
    return getattr(getattr(args, "hf_deepspeed_config", None), "config", None)


def final_loss(trainer) -> float | None:
    return next((e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e), None)


def timing(args, timer: StepTimer, train_called: float) -> dict:
    return {
        "engine_start_seconds": (timer.train_begin or train_called) - train_called,
        "step_end_times": [t - train_called for t in timer.step_ends],
        "step_usage": timer.step_usage,  # (user s, system s, minor faults) at train begin and after each step
        "global_batch": args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps,
    }


# --- one run, memory measured -------------------------------------------------------------------------------------


def measured_run(opts) -> None:
    args, trainer_class, args_seconds = build_arguments(opts, opts.path, opts.out + ".run")
    startup_peak, baseline = peak_rss(), current_rss()
    reset_peak_rss()

    phases, timer = PhaseRecorder(), StepTimer()
    trainer, after_load = build_trainer(opts, args, trainer_class, phases, timer)
    train_called = time.perf_counter()
    trainer.train()
    peak = peak_rss()
    zero = (engine_config(args) or {}).get("zero_optimization", {})
    plan = getattr(args, "memory_plan", None)
    summary = run_summary(trainer)
    result = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "config": opts.config,
        "path": opts.path,
        "batch": args.per_device_train_batch_size,
        "seq_len": opts.seq_len,
        "activation_checkpointing": opts.activation_checkpointing,
        "baseline_bytes": baseline,
        "load_peak_bytes": after_load,
        "peak_bytes": peak,
        "increment_bytes": peak - baseline,
        "startup_peak_bytes": startup_peak,
        "phases": [(name, hwm - baseline, rss - baseline) for name, hwm, rss in phases.phases],
        "zero_stage": zero.get("stage"),
        "offload_optimizer": zero.get("offload_optimizer"),
        "engine": summary["engine"],
        "fsdp": summary["fsdp"],
        "bf16": opts.bf16,
        "plan": plan.to_dict() if plan is not None else None,
        "released_freed_memory": summary["released_freed_memory"],
        "torch_threads": summary["torch_threads"],
        "final_loss": final_loss(trainer),
        "memory_log": [e for e in trainer.state.log_history if "memory_peak_gib" in e],
        "args_seconds": args_seconds,
        **timing(args, timer, train_called),
    }
    with open(f"{opts.out}.rank{args.process_index}.json", "w") as f:
        json.dump(result, f, indent=2, default=str)


# --- interleaved segments -----------------------------------------------------------------------------------------


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


def segment_trainer(opts, path: str, output_dir: str, *callbacks):
    """This worker's segment: ``path``'s TrainingArguments and Trainer with ``callbacks``; the seconds the arguments
    took."""
    args, trainer_class, args_seconds = build_arguments(opts, path, output_dir)
    trainer, _ = build_trainer(opts, args, trainer_class, *callbacks)
    return args, trainer, args_seconds


def segment(opts, path: str, index: int, build=segment_trainer) -> tuple[dict, int]:
    """One segment of ``path``, built by ``build(opts, path, output_dir, *callbacks)`` (arguments, trainer, seconds
    the arguments took: :func:`segment_trainer`, or another bench's trainer), trained, measured and dropped."""
    timer = StepTimer()
    tracer = StepCodeTracer() if opts.trace else None
    args, trainer, args_seconds = build(opts, path, f"{opts.out}.run/{index}", timer, *([tracer] if tracer else []))
    hooks = HookClock(trainer)
    train_called = time.perf_counter()
    trainer.train()
    config = engine_config(args)
    result = {
        "segment": index,
        "path": path,
        "args_seconds": args_seconds,
        **timing(args, timer, train_called),
        "final_loss": final_loss(trainer),
        "hf_ext_hook_seconds": hooks.seconds,  # by event, summed over the segment
        "hf_ext_hook_seconds_per_step": hooks.per_step_seconds(len(timer.step_ends)),
        "zero_stage": config["zero_optimization"]["stage"],
        "train_batch_size": config["train_batch_size"],
        "engine_config": config,  # the whole config the engine ran with: both paths' must be identical
        "torch_threads": torch.get_num_threads(),
        **(tracer.result() if tracer else {}),
    }
    held = [trainer]
    del trainer  # the list holds the last reference, which drop_trainer releases
    result.update(drop_trainer(held))
    return result, args.process_index


def drop_trainer(held: list) -> dict:
    """Drop everything a segment built, as transformers does between hyper-parameter search trials: the trainer in
    ``held`` (its only element, and its last reference: the list is emptied), its DeepSpeed engines (the trainer's,
    and a reference model's where TRL started one) and the accelerator's references. Returns the resident set
    afterwards and the number of DeepSpeed engines still alive (neither may grow segment by segment)."""
    from deepspeed import DeepSpeedEngine
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer = held.pop()
    for name in ("deepspeed", "ref_model"):
        engine = getattr(trainer, name, None)
        if isinstance(engine, DeepSpeedEngine):
            engine.destroy()  # DeepSpeed's own release (ZeRO-3's hooks)
    trainer.accelerator.free_memory()
    del trainer
    unset_hf_deepspeed_config()
    release_zero3_globals()
    gc.collect()
    return {
        "rss_after_bytes": current_rss(),
        "engines_alive": sum(issubclass(type(o), DeepSpeedEngine) for o in gc.get_objects()),  # no __class__ reads
    }


def restore_environment(saved: dict) -> list[str]:
    """``os.environ`` back to ``saved`` (a copy taken at launch), for the next segment of the same process: what a
    segment's arguments set for their engine (accelerate's DeepSpeed and FSDP variables) goes with it. Returns the
    names the segment had added."""
    added = sorted(set(os.environ) - set(saved))
    os.environ.clear()
    os.environ.update(saved)
    return added


def interleaved_runs(opts, build=segment_trainer) -> None:
    """``opts.segments`` :func:`segment` s of trainers from ``build``, the paths taking turns (:data:`ORDER`)."""
    # one thread count for both paths, hf-ext's placement; set in the environment too, where accelerate reads it
    os.environ["OMP_NUM_THREADS"] = str(place_cpu_threads())
    results, rank = [], 0
    for index in range(opts.segments):
        result, rank = segment(opts, ORDER[index % len(ORDER)], index, build)
        results.append(result)
    with open(f"{opts.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "segments": results}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", default="zero2", help="ddp, or a DeepSpeed preset name / JSON path")
    parser.add_argument("--path", default="hf-ext", choices=["hf-ext", "stock"], help="the one path of a run")
    parser.add_argument("--batch", default="2", help="per-device micro-batch, or auto")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (per segment when interleaved)")
    parser.add_argument(
        "--segments", type=int, default=0,
        help="interleave stock and hf-ext in this many segments (a multiple of 4 puts each path in each position "
        "alike); 0: one run of --path, memory measured",
    )  # fmt: skip
    parser.add_argument("--trace", action="store_true", help="count the Python calls of each step (slows steps)")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (r=16, all-linear), as --use_peft")
    parser.add_argument("--from_config", action="store_true", help="random-init model from --model's config only")
    parser.add_argument("--memory_per_device", default=None)
    parser.add_argument(
        "--release_freed_memory", default="auto", choices=list(RELEASE),
        help="hf-ext's TrainingArguments.release_freed_memory (auto: on when the planner plans the run)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="results go to OUT.rank<N>.json")
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()
    if opts.segments:
        if opts.release_freed_memory == "on" or opts.memory_per_device or "auto" in (opts.config, opts.batch):
            parser.error("--segments runs stock in the same processes: no planner, and glibc left as stock leaves it")
        opts.release_freed_memory = "off"
        interleaved_runs(opts)
    else:
        measured_run(opts)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
