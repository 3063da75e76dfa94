"""One oracle across engines: a tiny Llama trained on the same rows from the same seed under every layout, in one
2-rank launch, one segment after another in the same processes.

    torchrun --nproc_per_node 2 tests/distributed/workers/engine_oracle.py --model DIR --out FILE

Segments: hf-ext under DDP, ZeRO-0/1/2/3, ZeRO-3 with CPU offload (the ``zero3_offload`` preset) and FSDP2, each
with gradient accumulation 1 and 4 at the same global batch of 8 (micro-batch 4 and 1); stock transformers under the
layouts it runs the same way on CPU ranks (DDP, ZeRO-2, ZeRO-3; stock's ``fsdp`` runs DDP on CPU). The schedule is
the Trainer's ``linear`` with one warm-up step on every engine (the presets have no scheduler section).
Writes ``FILE`` (JSON, rank 0): per segment the per-step losses, grad norms and learning rates, the final weights'
largest difference from the first segment's (hf-ext DDP, accumulation 1) and what ran (engine, ZeRO stage, optimizer,
offload devices, whether a resolved config was left with an ``"auto"``).

Preempted segments (DDP, ZeRO-1, ZeRO-3 with CPU offload): rank 1 alone sends itself a signal at the end of step 1;
hf-ext's preemption callback makes both ranks save the agreed step's checkpoint and stop (``train()`` returns; a
script would then exit with status 75); the next segment resumes that checkpoint to step 4. Their results add each
rank's saved step and the checkpoints left in the output directory, and the resumed run's weights are compared with
the same layout's uninterrupted segment. ZeRO-1's checkpoint is also converted with ``hf-ext convert`` and resumed
under FSDP2 to step 4.

A JIT segment (ZeRO-2, stock's ``enable_jit_checkpoint=True``): rank 1 alone sends itself SIGTERM at the end of step 1
and stays in that step end past stock's kill wait; hf-ext agrees on the request during step 2, and both ranks write
stock's JIT checkpoint of step 2 (``train()`` returns); the next segment resumes it to step 4.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch
import transformers
from datasets import Dataset
from transformers import AutoModelForCausalLM

import hf_ext
import hf_ext.preemption
from benchmarks.worker import drop_trainer, restore_environment  # as the benchmarks' segments
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.preemption import AgreedCheckpointManager, preemption_callback
from hf_ext.runtime import start_deepspeed_comm
from tests.launched.signal_at import SignalAt
from tests.saving_support import gathered_state_dict  # the repository root is on PYTHONPATH under the launchers

GLOBAL_BATCH, STEPS, ROWS, LENGTH = 8, 4, 64, 16
LAUNCH_ENV = dict(os.environ)


def preset(name: str, stage: int | None = None) -> dict:
    """hf-ext's preset ``name`` as a user gets it: no scheduler section, so every engine runs the Trainer's schedule
    (DeepSpeed's ``WarmupDecayLR`` is another schedule than transformers' ``linear`` with the same warm-up: docs/testing.md)."""
    config = load_deepspeed_config(name)
    assert "scheduler" not in config, (
        f"the {name} preset has a scheduler section: the Trainer's schedule would not run"
    )
    if stage is not None:
        config["zero_optimization"] = {"stage": stage}
    return config


#: layout -> (the deepspeed config, the fsdp argument)
LAYOUTS = {
    "ddp": (lambda: None, ""),
    "zero0": (lambda: preset("zero2", stage=0), ""),
    "zero1": (lambda: preset("zero1"), ""),
    "zero2": (lambda: preset("zero2"), ""),
    "zero3": (lambda: preset("zero3"), ""),
    "zero3_offload": (lambda: preset("zero3_offload"), ""),
    "fsdp2": (lambda: None, "full_shard"),
}
#: the segments, in order: (path, layout, accumulation)
SEGMENTS = [("hf-ext", layout, accum) for layout in LAYOUTS for accum in (1, 4)]
SEGMENTS += [("stock", layout, 1) for layout in ("ddp", "zero2", "zero3")]
#: the layouts preempted here, by the signal rank 1 sends itself at the end of step SIGNAL_AT: SIGUSR1 (SLURM's
#: ``--signal=USR1@120``), and SIGTERM to one worker under ZeRO-3 with CPU offload (ZeRO-2, ZeRO-3 and FSDP2 get it
#: in their launched recipe runs, tests/distributed/test_recipe_distributed.py)
PREEMPTED = {"ddp": "SIGUSR1", "zero1": "SIGUSR1", "zero3_offload": "SIGTERM"}
SIGNAL_AT = 1
#: the layout of the JIT segment (module docstring)
JIT_LAYOUT = "zero2"
#: ``hf-ext convert`` both ways: 8 steps of the first layout saving checkpoint-4, that checkpoint converted for the
#: second (rank 0 runs the command), and the second layout resumed from the conversion for steps 5-8. ROUND_TRIPS are
#: resumed on 1 rank too (``--only resume``); ZeRO-3's checkpoint (its partitioned parameters) becomes the same FSDP2
#: state as ZeRO-2's, resumed on 2 ranks only
ROUND_TRIPS = [("zero2", "fsdp2"), ("fsdp2", "zero2")]
#: and the FSDP2 checkpoint (one 8-step run) converted and resumed under ZeRO-1 and ZeRO-3 as well, and the
#: zero3_offload preset's checkpoint (its optimizer state kept on the CPU) to FSDP2
CONVERSIONS = [*ROUND_TRIPS, ("zero3", "fsdp2"), ("fsdp2", "zero1"), ("fsdp2", "zero3"), ("zero3_offload", "fsdp2")]
#: and a ZeRO-1 checkpoint: the preempted ZeRO-1 segment's checkpoint-2 converted, and resumed under FSDP2 to step 4
CONVERTED_PREEMPTIONS = {"zero1": "fsdp2"}


def rows(vocab: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, vocab, (LENGTH,), generator=g).tolist() for _ in range(ROWS)]
    return Dataset.from_list([{"input_ids": x, "labels": x} for x in ids])


def collate(batch: list[dict]) -> dict:
    return {k: torch.tensor([r[k] for r in batch]) for k in ("input_ids", "labels")}


def probe(trainer) -> dict:
    engine = getattr(trainer, "deepspeed", None)
    config = getattr(getattr(trainer.args, "hf_deepspeed_config", None), "config", None) or {}
    zero = config.get("zero_optimization", {})
    return {
        "engine": type(engine).__name__ if engine is not None else type(trainer.model_wrapped).__name__,
        "fsdp2": any(isinstance(p, torch.distributed.tensor.DTensor) for p in trainer.model.parameters()),
        "zero_stage": zero.get("stage"),
        "offload": [zero.get(k, {}).get("device", "none") for k in ("offload_optimizer", "offload_param")],
        "optimizer": type(getattr(engine, "optimizer", None) or trainer.optimizer).__name__,
        "auto_left": "auto" in json.dumps(config),
    }


class SignalPastKillWait(SignalAt):
    """:class:`SignalAt`, then the signalled rank stays in that step end until stock's kill wait (3 s) is over, so
    that its JIT checkpoint request is made before its next step begins."""

    def on_step_end(self, args, state, control, **kwargs):
        sent = time.monotonic()
        super().on_step_end(args, state, control, **kwargs)
        if state.global_step == self.step and args.process_index == self.rank:
            time.sleep(max(0.0, sent + 3.5 - time.monotonic()))


def segment(
    path: str,
    layout: str,
    accumulation: int,
    model_dir: str,
    out_dir: str,
    name: str | None = None,
    steps: int = STEPS,
    save_steps: int | None = None,
    resume: str | None = None,
    signal_at: tuple[int, str] | None = None,
    jit: bool = False,
) -> tuple[dict, dict]:
    config, fsdp = LAYOUTS[layout]
    deepspeed = config()
    name = name or f"{path}-{layout}-{accumulation}"
    print(f"segment {name}", flush=True)
    saving = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    common = dict(output_dir=os.path.join(out_dir, name), max_steps=steps, seed=0, **saving,
                  per_device_train_batch_size=GLOBAL_BATCH // (2 * accumulation),
                  gradient_accumulation_steps=accumulation, learning_rate=1e-3, lr_scheduler_type="linear",
                  warmup_steps=1, max_grad_norm=1.0, logging_steps=1, report_to=[],
                  disable_tqdm=True, fsdp=fsdp)  # fmt: skip
    if path == "stock":  # the same JSON, its "auto"s left to transformers
        args = transformers.TrainingArguments(use_cpu=not torch.cuda.is_available(), deepspeed=deepspeed, **common)
        trainer_class = transformers.Trainer
    else:
        args = hf_ext.TrainingArguments(deepspeed=deepspeed, enable_jit_checkpoint=jit, **common)
        trainer_class = hf_ext.Trainer
    if deepspeed is not None:
        start_deepspeed_comm()  # on CPU stock's arguments start torch.distributed but not DeepSpeed's comm
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # after the arguments: zero.Init partitions it
    callbacks = [(SignalPastKillWait if jit else SignalAt)(*signal_at, "self", rank=1)] if signal_at else []
    trainer = trainer_class(model=model, args=args, train_dataset=rows(model.config.vocab_size), data_collator=collate,
                            callbacks=callbacks)  # fmt: skip
    # hf_ext.Trainer.train() ends a preempted run with exit_if_preempted: the process group torn down, then exit 75
    # (the launched recipe tests check both); the segments after a preempted one need the process group
    staying = (
        patch.object(hf_ext.preemption, "exit_if_preempted", lambda trainer: None) if signal_at else nullcontext()
    )
    with staying:
        trainer.train(resume_from_checkpoint=resume)
    preempted = {}
    callback = preemption_callback(trainer)
    if signal_at and jit:
        steps = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(steps, trainer.state.global_step)
        found = sorted(str(p.relative_to(args.output_dir)) for p in Path(args.output_dir).rglob("*checkpoint*"))
        preempted = {"steps": steps, "checkpoints": found, "agreed": isinstance(callback.jit, AgreedCheckpointManager)}
    elif signal_at:
        saved_at = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(saved_at, callback.saved_at)
        callback.release()  # the signal handlers back: exit_if_preempted would exit here
        found = sorted(p.name for p in Path(args.output_dir).iterdir() if "checkpoint" in p.name)
        preempted = {"saved_at": saved_at, "checkpoints": found, "signal": callback.signal_name}
    weights = gathered_state_dict(trainer.model)  # every rank takes part
    history = [e for e in trainer.state.log_history if "loss" in e]
    result = {
        "name": name, "path": path, "layout": layout, "accumulation": accumulation, **probe(trainer),
        "global_step": trainer.state.global_step, "accumulation_ran": trainer.args.gradient_accumulation_steps,
        "losses": [e["loss"] for e in history], "grad_norms": [e.get("grad_norm") for e in history],
        "learning_rates": [e["learning_rate"] for e in history], **preempted,
    }  # fmt: skip
    drop_trainer([trainer])
    return result | {"env_set": restore_environment(LAUNCH_ENV)}, weights


def largest_difference(weights: dict, reference: dict) -> float:
    """The largest absolute difference between ``weights`` and ``reference``, over ``reference``'s tensors."""
    return max((weights[k] - reference[k]).abs().max().item() for k in reference)


def convert(checkpoint: Path, out: Path, to: str) -> None:
    """``hf-ext convert``'s work on rank 0 (tests/unit/test_convert.py runs the command itself); every rank raises if
    it failed."""
    from hf_ext.saving.convert import convert_checkpoint

    status = [None]
    if torch.distributed.get_rank() == 0:
        try:
            convert_checkpoint(checkpoint, out, to)
            status = ["ok"]
        except Exception as err:  # every rank stops, with rank 0's reason
            status = [repr(err)]
    torch.distributed.broadcast_object_list(status, src=0)
    if status[0] != "ok":
        raise RuntimeError(f"hf-ext convert {checkpoint} --to {to} failed: {status[0]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=["engines", "convert", "resume"], help="one part (default: engines and "
                        "convert); resume: the conversions of an earlier launch's --out folder resumed here")  # fmt: skip
    opts = parser.parse_args()
    initial = dict(AutoModelForCausalLM.from_pretrained(opts.model).named_parameters(remove_duplicate=False))
    out_dir = os.path.dirname(opts.out)
    results, reference, uninterrupted = [], None, {}
    for path, layout, accumulation in SEGMENTS if opts.only in (None, "engines") else []:
        result, weights = segment(path, layout, accumulation, opts.model, out_dir)
        if weights:  # rank 0 (FSDP2 gathers there only)
            reference = reference or weights
            result["max_weight_difference"] = largest_difference(weights, reference)
            result["weights_moved"] = largest_difference(weights, initial)
            if path == "hf-ext" and accumulation == 1:
                uninterrupted[layout] = weights
        results.append(result)
    for layout, sig in PREEMPTED.items() if opts.only in (None, "engines") else []:
        name = f"preempted-{layout}"
        preempted, _ = segment("hf-ext", layout, 1, opts.model, out_dir, name, signal_at=(SIGNAL_AT, sig))
        checkpoint = Path(out_dir) / name / f"checkpoint-{preempted['global_step']}"
        resumed, weights = segment("hf-ext", layout, 1, opts.model, out_dir, f"{name}-resumed", resume=str(checkpoint))
        if weights:
            whole = uninterrupted[layout]
            resumed["max_weight_difference"] = largest_difference(weights, whole)
        results += [preempted, resumed]
        if layout in CONVERTED_PREEMPTIONS:  # the same checkpoint converted, and resumed on the other engine
            to = CONVERTED_PREEMPTIONS[layout]
            converted = Path(out_dir) / f"{name}-to-{to}"
            convert(checkpoint, converted, to)
            resumed, weights = segment("hf-ext", to, 1, opts.model, out_dir, f"{name}-to-{to}-resumed",
                                       resume=str(converted))  # fmt: skip
            if weights:  # rank 0 (FSDP2 gathers there only)
                whole = uninterrupted[layout]
                resumed["max_weight_difference"] = largest_difference(weights, whole)
                resumed["weights_moved"] = largest_difference(weights, initial)
            results.append(resumed)
    if opts.only in (None, "engines"):
        preempted, _ = segment("hf-ext", JIT_LAYOUT, 1, opts.model, out_dir, "jit", signal_at=(SIGNAL_AT, "SIGTERM"),
                               jit=True)  # fmt: skip
        checkpoint = Path(out_dir) / "jit" / f"checkpoint-{preempted['global_step']}"
        resumed, weights = segment("hf-ext", JIT_LAYOUT, 1, opts.model, out_dir, "jit-resumed", resume=str(checkpoint))
        if weights:
            resumed["max_weight_difference"] = largest_difference(weights, uninterrupted[JIT_LAYOUT])
        results += [preempted, resumed]
    wholes = {}  # each first layout's 8-step run, once
    for first, second in CONVERSIONS if opts.only in (None, "convert") else []:
        if first not in wholes:
            wholes[first] = segment("hf-ext", first, 1, opts.model, out_dir, f"{first}-8", 2 * STEPS, STEPS)
            results.append(wholes[first][0])
        whole_weights = wholes[first][1]
        converted = Path(out_dir) / f"{first}-to-{second}"
        convert(
            Path(out_dir) / f"{first}-8" / f"checkpoint-{STEPS}",
            converted,
            "fsdp2" if second == "fsdp2" else "deepspeed",
        )
        resumed, weights = segment("hf-ext", second, 1, opts.model, out_dir, f"{first}-to-{second}-resumed",
                                   2 * STEPS, resume=str(converted))  # fmt: skip
        if weights and whole_weights:  # rank 0 (FSDP2 gathers there only)
            resumed["max_weight_difference"] = largest_difference(weights, whole_weights)
            resumed["weights_moved"] = largest_difference(weights, initial)
        if whole_weights:  # the oracle of the resumes on another world size (--only resume)
            torch.save(whole_weights, Path(out_dir) / f"{first}-8.pt")
        results.append(resumed)
    for first, second in ROUND_TRIPS if opts.only == "resume" else []:
        # micro-batch 4 as written: on another world size hf-ext sets the accumulation that keeps the global batch 8
        resumed, weights = segment("hf-ext", second, 1, opts.model, out_dir, f"{first}-to-{second}-on-1",
                                   2 * STEPS, resume=str(Path(out_dir) / f"{first}-to-{second}"))  # fmt: skip
        whole_weights = torch.load(Path(out_dir) / f"{first}-8.pt")
        resumed["max_weight_difference"] = largest_difference(weights, whole_weights)
        resumed["world_size"] = torch.distributed.get_world_size()
        results.append(resumed)
    publish(results, opts.out)


def publish(results: list[dict], out: str) -> None:
    """The launch's end: rank 0 writes ``results`` to ``out`` (JSON), then every rank leaves the process group."""
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    hf_ext.end_distributed()


if __name__ == "__main__":
    main()
