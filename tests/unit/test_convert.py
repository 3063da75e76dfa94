"""``hf-ext convert``: what it refuses, in one line and before anything is written, and a resume that needs it.

The conversions themselves (ZeRO-2 -> FSDP2 and back, ZeRO-3 and ZeRO-1 -> FSDP2, each resumed against the
uninterrupted run) run on real ranks in tests/distributed/test_engines.py; a real ZeRO-3 checkpoint whose schedule is
DeepSpeed's own is refused in tests/distributed/test_resume_world_size.py. The checkpoints below are directories laid
out as the engines write them, with the one file each refusal reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_ext.cli import main
from hf_ext.peft import TRAINABLE_STATE_META, TRAINABLE_STATE_NAME
from hf_ext.saving.resume import refuse_other_engine


def _trainer_state(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    return path


def _zero_checkpoint(path: Path, lr_scheduler: dict | None, config: dict | None = None) -> Path:
    """A ZeRO-2 checkpoint's files as DeepSpeed writes them: the tag, the engine state, one optimizer partition."""
    tag = _trainer_state(path) / "global_step4"
    tag.mkdir()
    (path / "latest").write_text("global_step4")
    torch.save({"dp_world_size": 2, "ds_config": config or {}, "lr_scheduler": lr_scheduler},
               tag / "mp_rank_00_model_states.pt")  # fmt: skip
    torch.save({}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return path


def _fsdp2_checkpoint(path: Path, optimizer: bool = True) -> Path:
    _trainer_state(path)
    (path / "pytorch_model_fsdp_0").mkdir()
    if optimizer:
        (path / "optimizer_0").mkdir()
    return path


def refusal(capsys, checkpoint: Path, out: Path, to: str) -> str:
    before = sorted(out.rglob("*")) if out.exists() else None
    code = main(["convert", str(checkpoint), str(out), "--to", to])
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert (sorted(out.rglob("*")) if out.exists() else None) == before  # refused before anything was written
    assert len(err.splitlines()) == 1 and err.startswith("hf-ext convert: "), err
    return err


def test_what_cannot_be_converted_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "converted"
    assert "is not a directory" in refusal(capsys, tmp_path / "nothing", out, "fsdp2")
    assert "holds no DeepSpeed state" in refusal(capsys, _trainer_state(tmp_path / "plain"), out, "fsdp2")

    adapter = _trainer_state(tmp_path / "adapter")
    (adapter / TRAINABLE_STATE_NAME).write_bytes(b"")
    (adapter / TRAINABLE_STATE_META).write_text("{}")
    assert "resumes under any engine" in refusal(capsys, adapter, out, "deepspeed")

    fsdp2 = _fsdp2_checkpoint(tmp_path / "fsdp2")
    assert "is already a fsdp2 checkpoint" in refusal(capsys, fsdp2, out, "fsdp2")
    no_optimizer = _fsdp2_checkpoint(tmp_path / "fsdp2-model-only", optimizer=False)
    assert "has no optimizer_0/" in refusal(capsys, no_optimizer, out, "deepspeed")
    assert "has no hf-ext marker" in refusal(capsys, fsdp2, out, "deepspeed")  # stock's: its world size unknown

    zero = _zero_checkpoint(tmp_path / "zero", None)
    assert "is already a deepspeed checkpoint" in refusal(capsys, zero, out, "deepspeed")
    # ZeRO stage 0 (DeepSpeed's fp32 engine without ZeRO): the optimizer state sits in the model-state file, and no
    # partition is written for DeepSpeed's universal converter to read
    stage0 = _zero_checkpoint(tmp_path / "zero0", None)
    (stage0 / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert "only ZeRO stage 1, 2 or 3 checkpoints convert" in refusal(capsys, stage0, out, "fsdp2")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "kept").write_text("mine")
    assert "exists: pass a new directory" in refusal(capsys, zero, existing, "fsdp2")
    assert (existing / "kept").read_text() == "mine"  # never written into


@pytest.mark.parametrize(("written", "engine"), [("deepspeed", "fsdp2"), ("fsdp2", "deepspeed")])
def test_resuming_the_other_engine_s_checkpoint_names_the_conversion(tmp_path, written, engine):
    path = (
        _zero_checkpoint(tmp_path / "checkpoint-4", None)
        if written == "deepspeed"
        else _fsdp2_checkpoint(tmp_path / "checkpoint-4")
    )
    with pytest.raises(ValueError, match=rf"is a {written} checkpoint and this run trains with {engine}") as err:
        refuse_other_engine(path, engine)
    assert f"hf-ext convert {path} {path}-{engine} --to {engine}" in str(err.value)
    refuse_other_engine(path, written)  # its own engine: no word
