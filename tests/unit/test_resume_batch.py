"""Resuming on another world size keeps the checkpoint's global batch, or refuses with the arithmetic and a fix that
works (the resumes themselves run in tests/distributed/test_resume_world_size.py).

Real hf-ext TrainingArguments with a resolved DeepSpeed config, in this process (world size 1); the checkpoint is the
record :func:`read_zero_checkpoint` makes of one written on 2 ranks.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import hf_ext
from hf_ext.saving.resume import ResumePlan, ZeroCheckpoint, apply_resume_plan, global_batch


def written_on_two_ranks(micro: int, accum: int) -> ZeroCheckpoint:
    return ZeroCheckpoint(Path("run/checkpoint-4"), "global_step4", 2, 2 * micro * accum, micro, accum)


def keep_global_batch(trainer, checkpoint: ZeroCheckpoint) -> str:
    """What a resume of ``checkpoint`` on this trainer's ranks does to the global batch: the plan's accumulation
    (:func:`global_batch`), applied as ``train()`` applies it; the phrase of the log line."""
    accumulation, said = global_batch(trainer.args, checkpoint)
    path = checkpoint.path
    apply_resume_plan(trainer, ResumePlan("as_written", path, path, checkpoint, accumulation, said))
    return said


def trainer_with(tmp_path, micro: int, accum: int, policy: str = "keep", **config):
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}, **config}  # fmt: skip
    args = hf_ext.TrainingArguments(str(tmp_path), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                    deepspeed=ds, report_to=[], resume_global_batch=policy)  # fmt: skip
    return SimpleNamespace(args=args, accelerator=SimpleNamespace(state=None))


def test_accumulation_takes_up_the_ranks_that_are_gone(tmp_path):
    trainer = trainer_with(tmp_path, micro=2, accum=1)  # the command line of the 2-rank run, now on 1 rank
    said = keep_global_batch(trainer, written_on_two_ranks(micro=2, accum=1))
    assert said == "gradient accumulation 1 -> 2 keeps the global batch of 4"
    config = trainer.args.hf_deepspeed_config.config
    assert trainer.args.gradient_accumulation_steps == 2
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 4)
    assert config["train_micro_batch_size_per_gpu"] == 2


def test_a_run_that_already_keeps_the_global_batch_is_left_alone(tmp_path):
    trainer = trainer_with(tmp_path, micro=4, accum=2)
    assert keep_global_batch(trainer, written_on_two_ranks(micro=2, accum=2)) == "global batch 8 as before"
    assert trainer.args.gradient_accumulation_steps == 2


def test_a_global_batch_the_micro_batch_cannot_make_is_refused_with_a_fix_that_works(tmp_path):
    checkpoint = written_on_two_ranks(micro=3, accum=1)  # global batch 6
    with pytest.raises(ValueError) as refused:
        keep_global_batch(trainer_with(tmp_path, micro=4, accum=1), checkpoint)
    message = str(refused.value)
    assert "\n" not in message
    assert "global batch of 6 (2 ranks x micro-batch 3 x accumulation 1 = 6)" in message
    flags = re.search(r"--per_device_train_batch_size (\d+) --gradient_accumulation_steps (\d+)", message)
    micro, accum = int(flags[1]), int(flags[2])
    assert micro * accum == 6  # 1 rank
    fixed = trainer_with(tmp_path, micro=micro, accum=accum)
    keep_global_batch(fixed, checkpoint)
    assert fixed.args.gradient_accumulation_steps == accum


def test_nearest_goes_on_with_the_nearest_global_batch_and_says_what_changed(tmp_path):
    checkpoint = written_on_two_ranks(micro=3, accum=1)  # global batch 6; here 1 rank x micro-batch 4: 4 or 8
    with pytest.raises(ValueError, match=r"or pass --resume_global_batch nearest .* \(4\)\.$"):
        keep_global_batch(trainer_with(tmp_path, micro=4, accum=1), checkpoint)
    trainer = trainer_with(tmp_path, micro=4, accum=3, policy="nearest")  # 4 and 8 are both 2 away: the smaller
    said = keep_global_batch(trainer, checkpoint)
    assert "the global batch changes 6 -> 4 (1 rank x micro-batch 4 x accumulation 1" in said
    assert "not rescaled" in said
    config = trainer.args.hf_deepspeed_config.config
    assert trainer.args.gradient_accumulation_steps == 1
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (1, 4)
    trainer = trainer_with(tmp_path, micro=2, accum=1, policy="nearest")  # 6 is reachable: kept, as with "keep"
    assert keep_global_batch(trainer, checkpoint) == "gradient accumulation 1 -> 3 keeps the global batch of 6"
    with pytest.raises(ValueError, match="resume_global_batch.*keep, nearest"):
        trainer_with(tmp_path, micro=2, accum=1, policy="closest")


def test_an_accumulation_fixed_by_the_config_is_named_with_its_fix(tmp_path):
    checkpoint = written_on_two_ranks(micro=2, accum=1)
    with pytest.raises(
        ValueError, match='fixes gradient_accumulation_steps to 1.*set gradient_accumulation_steps to "auto"'
    ):
        keep_global_batch(trainer_with(tmp_path, micro=2, accum=1, gradient_accumulation_steps=1), checkpoint)
    fixed = trainer_with(tmp_path, micro=2, accum=1)  # the fix: "auto"
    keep_global_batch(fixed, checkpoint)
    assert fixed.args.hf_deepspeed_config.config["gradient_accumulation_steps"] == 2


# --- FSDP: the checkpoint marker records the batch (torch.distributed.checkpoint reshards the state itself) ----------


def test_fsdp_checkpoint_marker_keeps_the_global_batch_or_refuses(tmp_path):
    from hf_ext.saving import checkpoints
    from hf_ext.saving.resume import apply_resume_plan, plan_resume, read_marked_checkpoint

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    checkpoints.write_marker(checkpoint, global_step=4, world_size=2, micro_batch=2, accumulation=1)
    assert read_marked_checkpoint(checkpoint).batch_arithmetic() == "2 ranks x micro-batch 2 x accumulation 1 = 4"

    def fsdp_trainer(micro: int):
        args = hf_ext.TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=micro, report_to=[])
        return SimpleNamespace(args=args, accelerator=SimpleNamespace(state=None), is_fsdp_enabled=True)

    trainer = fsdp_trainer(micro=2)  # the 2-rank command line, now on this process's 1 rank
    plan = plan_resume(trainer, str(checkpoint))
    assert (plan.kind, plan.load_from, plan.accumulation) == ("fsdp_reshard", checkpoint, 2)
    assert trainer.args.gradient_accumulation_steps == 1  # deciding changes nothing
    apply_resume_plan(trainer, plan)
    assert trainer.args.gradient_accumulation_steps == 2  # 1 x 2 x 2 = 4
    with pytest.raises(ValueError, match=r"Fix: pass --per_device_train_batch_size 2 --gradient_accumulation_steps 2"):
        plan_resume(fsdp_trainer(micro=3), str(checkpoint))
    (checkpoint / checkpoints.CHECKPOINT_MARKER).write_text('{"complete": true, "global_step": 4}')  # older marker
    assert read_marked_checkpoint(checkpoint) is None
    assert plan_resume(fsdp_trainer(micro=3), str(checkpoint)).kind == "as_written"


# --- DeepSpeed AutoTP: its train_batch_size counts each tensor-parallel rank; a step trains on the data-parallel ranks'
# rows. The record is the one read_zero_checkpoint makes of the 2-rank AutoTP checkpoint that
# tests/distributed/test_parallel_layouts.py writes and resumes (dp_world_size 1, mp_world_size 2, train_batch_size 8).


def written_with_autotp_2_on_two_ranks() -> ZeroCheckpoint:
    return ZeroCheckpoint(Path("run/checkpoint-3"), "global_step3", 1, 8, 2, 2, tensor_parallel=2)


def test_a_tensor_parallel_checkpoint_keeps_its_rows_per_step_not_deepspeeds_count(tmp_path):
    from hf_ext.batching import Layout

    checkpoint = written_with_autotp_2_on_two_ranks()
    assert checkpoint.rows_per_step == 4
    assert (
        checkpoint.batch_arithmetic()
        == "1 data-parallel rank (tensor-parallel 2) x micro-batch 2 x accumulation 2 = 4"
    )
    assert checkpoint.same_layout(Layout(2, tp=2))  # resumed as written, no conversion
    assert not checkpoint.same_layout(Layout(2)) and not checkpoint.same_layout(Layout(4, tp=2))
    trainer = trainer_with(tmp_path, micro=2, accum=1)  # one plain rank: 4 rows a step is accumulation 2, not 4
    assert keep_global_batch(trainer, checkpoint) == "gradient accumulation 1 -> 2 keeps the global batch of 4"
    config = trainer.args.hf_deepspeed_config.config
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 4)
