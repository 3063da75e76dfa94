"""Full fine-tuning checkpoints resumed on another number of ranks (real DeepSpeed, ZeRO-3): a 1-rank checkpoint
resumed on 2 ranks, and the conversion reused. The other direction, 2 ranks resumed on 1, is the elastic survivor of
tests/distributed/test_multinode.py (ZeRO-3) and the preempted recipe run of tests/distributed/test_recipe_distributed.py
(ZeRO-2's conversion, the same tool on simpler files).

The uninterrupted 8-step run of a global batch of 4 on 1 rank (micro-batch 2 x accumulation 2) is the oracle; its
checkpoint-4 is resumed on 2 ranks with the command line of the run that wrote it (so hf-ext has to change the
accumulation itself).

Tolerance: dropout is off, so the resumed and uninterrupted runs compute the same per-sample gradients and differ
only in the order fp32 sums them (all-reduce over 2 ranks against accumulation on 1): a few ulps (1.2e-7 at 1.0)
after 8 Adam steps; uninterrupted runs on 1 and 2 ranks were measured up to 4.5e-7 apart, so the tolerance is 2e-6.
The 4 resumed steps move the weights by about 2e-3, so a resume that lost the optimizer moments, the schedule or the
data position lands far outside it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run
from ..saving_support import samples_by_step

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"
TOLERANCE = 2e-6


def train(model_dir, out: Path, ranks: int, stage: int, *extra: str):
    cmd = [*launcher_cmd(TRAIN_LAUNCHER, SCRIPT, nproc=ranks), "--model", str(model_dir), "--out", str(out / "out"),
           "--stage", str(stage), "--no_dropout", "--epochs", "1", "--save_total_limit", "3",
           "--dump", str(out / "trained.pt"), "--samples", str(out / "samples"), *extra]  # fmt: skip
    return run(cmd)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trained.pt.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


# name: (the run whose checkpoint-4 is resumed, ranks, gradient accumulation on the command line)
RESUMES = {"one_on_two": ("one", 2, 2)}
# a 1-rank checkpoint resumed on 2 ranks (2 ranks resumed on 1: the elastic survivor of
# tests/distributed/test_multinode.py, ZeRO-3, and the preempted recipe run, ZeRO-2)
RESUMED = {3: ["one_on_two"]}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The uninterrupted 1-rank run, then its checkpoint-4 resumed on 2 ranks."""
    stage = 3
    root = tmp_path_factory.mktemp(f"resume_zero{stage}")
    found = {"stage": stage, "resumed": RESUMED[stage]}
    train(tiny_model_dir, root / "one", 1, stage, "--accum", "2")
    for name in RESUMED[stage]:
        source, ranks, accum = RESUMES[name]
        checkpoint = root / source / "out" / "checkpoint-4"
        before = digests(checkpoint)
        proc = train(tiny_model_dir, root / name, ranks, stage, "--accum", str(accum), "--resume", str(checkpoint))
        found[name] = {"before": before, "after": digests(checkpoint), "log": proc.stdout + proc.stderr}
    found["root"] = root
    return found


def test_resume_on_another_world_size_matches_the_uninterrupted_run(runs):
    for name in runs["resumed"]:
        check_resumed(runs["root"], name, *RESUMES[name][:2])


def check_resumed(root: Path, name: str, source: str, ranks: int):
    resumed = torch.load(root / name / "trained.pt")
    assert max_difference(resumed, torch.load(root / source / "trained.pt")) < TOLERANCE
    # the 4 resumed steps really trained (a resume that dropped state would be far beyond the tolerance)
    from transformers import BlenderbotForConditionalGeneration

    at_checkpoint = BlenderbotForConditionalGeneration.from_pretrained(root / source / "out" / "checkpoint-4")
    start = dict(at_checkpoint.named_parameters(remove_duplicate=False))
    assert max_difference(resumed, {k: v.detach() for k, v in start.items()}) > 1e-3

    info = json.loads((root / name / "trained.pt.json").read_text())
    assert info["world_size"] == ranks and info["global_step"] == 8
    state = json.loads((root / name / "out" / "checkpoint-8" / "trainer_state.json").read_text())
    reference = json.loads((root / source / "out" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == reference["global_step"] == 8
    resumed_losses, reference_losses = losses(root / name), losses(root / source)
    assert sorted(resumed_losses) == list(range(1, 9))  # steps 1-4 from the checkpoint's state, 5-8 trained
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(reference_losses[step], abs=1e-5), step

    # the data position: steps 5-8 see exactly the uninterrupted run's samples, none of steps 1-4 again
    seen = samples_by_step(root / name)
    expected = samples_by_step(root / source)
    assert seen == {step: ids for step, ids in expected.items() if step > 4}
    before = [i for step, ids in expected.items() if step <= 4 for i in ids]
    after = [i for ids in seen.values() for i in ids]
    assert sorted(before + after) == list(range(32))  # one epoch: every sample exactly once


def test_conversion_is_said_cached_and_leaves_the_checkpoint_untouched(runs):
    for name in runs["resumed"]:
        source, ranks, _ = RESUMES[name]
        check_conversion(runs, name, source, 1, ranks)


def check_conversion(runs, name: str, source: str, written: int, ranks: int):
    found = runs[name]
    assert found["after"] == found["before"]  # byte-identical, no file added or removed
    universal = runs["root"] / source / "out" / "checkpoint-4.universal"
    assert (universal / "latest_universal").read_text() == "global_step4"
    assert (universal / "global_step4" / "zero").is_dir()
    accum = {1: "1 -> 2", 2: "2 -> 1"}[ranks]
    lines = [line for line in found["log"].splitlines() if "universal checkpoint" in line]
    assert len(lines) == 1, found["log"][-3000:]
    assert f"(written on {written} rank{'s' if written > 1 else ''}) on {ranks}" in lines[0]
    assert f"gradient accumulation {accum} keeps the global batch of 4" in lines[0]


def test_a_second_resume_reuses_the_conversion_until_the_checkpoint_changes(runs, tmp_path):
    """The first resume's conversion is found again (a second resume loads it: "converted earlier"); once a file of
    the checkpoint is written again, it is not."""
    import shutil

    from hf_ext.saving.resume import cached_universal, read_zero_checkpoint

    checkpoint = runs["root"] / "one" / "out" / "checkpoint-4"
    assert cached_universal(read_zero_checkpoint(checkpoint)) == checkpoint.parent / "checkpoint-4.universal"
    copy = tmp_path / "checkpoint-4"  # copytree keeps each file's mtime: the copy's conversion is still its own
    shutil.copytree(checkpoint, copy)
    shutil.copytree(checkpoint.parent / "checkpoint-4.universal", tmp_path / "checkpoint-4.universal")
    assert cached_universal(read_zero_checkpoint(copy)) == tmp_path / "checkpoint-4.universal"
    optim = next((copy / "global_step4").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes())  # the same bytes, written again (as a new save of the same step)
    assert cached_universal(read_zero_checkpoint(copy)) is None


def test_a_checkpoint_the_tool_cannot_convert_stops_every_rank_with_one_line(runs, tiny_model_dir, tmp_path):
    import shutil
    import subprocess

    from ..conftest import launch_env

    broken = tmp_path / "checkpoint-4"
    shutil.copytree(runs["root"] / "one" / "out" / "checkpoint-4", broken)
    optim = next((broken / "global_step4").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:1000])  # truncated: DeepSpeed's converter cannot read it
    cmd = [*launcher_cmd(TRAIN_LAUNCHER, SCRIPT, nproc=2), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
           "--stage", str(runs["stage"]), "--no_dropout", "--epochs", "1", "--accum", "2", "--resume", str(broken)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0  # and not a hang: the other rank does not wait for a conversion that failed
    output = proc.stdout + proc.stderr
    assert (
        "ds_to_universal could not convert" in output and "Resume it with the world size that wrote it (1)." in output
    )
    assert not (broken.parent / "checkpoint-4.universal").exists()  # nothing half-written is left to be reused


def test_convert_refuses_a_checkpoint_whose_schedule_deepspeed_keeps(runs, tmp_path, capsys):
    """``hf-ext convert`` of this ZeRO-3 checkpoint (a config with DeepSpeed's own WarmupDecayLR block, as make demo's:
    the schedule kept in the engine state) to FSDP2: one line naming the schedule and the fix, and nothing written (the Trainer's own schedule, which
    transformers hands to DeepSpeed's engine, converts: tests/distributed/test_engines.py)."""
    from hf_ext.cli import main

    checkpoint = runs["root"] / "one" / "out" / "checkpoint-4"
    before = digests(checkpoint)
    assert main(["convert", str(checkpoint), str(tmp_path / "fsdp2"), "--to", "fsdp2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "DeepSpeed's WarmupDecayLR" in err and 'remove the "scheduler" block' in err
    assert not (tmp_path / "fsdp2").exists() and digests(checkpoint) == before
