"""Every write all-or-nothing, shown with real processes: ``hf-ext export`` into an existing directory is SIGKILLed at
every write event of a seeded schedule (between shards, before and after the swap...) and afterwards the directory
loads with ``from_pretrained`` and equals the old or the new weights bit for bit; the next export removes the
leftovers. A file-size limit (RLIMIT_FSIZE, the disk-full path) gives one clear error line and keeps the old content.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import BlenderbotForConditionalGeneration

from hf_ext import atomic

from ..conftest import ROOT, launch_env, python_cmd, run_side_by_side

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "integration" / "workers" / "export_kill.py"
SHARD = "40KB"


def export_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [*python_cmd(WORKER), str(src), str(out), "--max_shard_size", SHARD, *extra]


def export(src: Path, out: Path, *extra: str, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run(export_cmd(src, out, *extra), cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=preexec)  # fmt: skip


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir, dtype="auto")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def old_and_new(tiny_model_dir, tmp_path_factory):
    """An fp32 export (the old content) and, from an uninterrupted bf16 export, the new weights and the events."""
    root = tmp_path_factory.mktemp("atomic_export")
    old = root / "old"
    proc = export(tiny_model_dir, old)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = root / "new"  # written over a copy of the old content, as the killed exports are
    shutil.copytree(old, new)
    proc = export(tiny_model_dir, new, "--dtype", "bf16", "--list", str(root / "events.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((root / "events.json").read_text())
    return root, weights(old), weights(new), events


def test_the_two_contents_differ_and_the_new_one_is_sharded(old_and_new):
    root, old, new, events = old_and_new
    assert not same(old, new)
    assert events.count("shard written") > 2 and (root / "new" / "model.safetensors.index.json").is_file()


def test_export_killed_at_any_write_event_leaves_old_or_new(old_and_new, tiny_model_dir, tmp_path):
    root, old, new, events = old_and_new
    shards = [i + 1 for i, name in enumerate(events) if name == "shard written"]
    # between the first two shards, after the last shard (before the swap), at the swap and right after it, and
    # one more drawn by a seeded schedule
    points = {shards[0], shards[-1], events.index("swap") + 1, events.index("swapped") + 1}
    points |= set(random.Random(0).sample([i for i in range(1, len(events) + 1) if i not in points], 1))
    seen, outcomes = {"old": 0, "new": 0}, {}
    out = {k: tmp_path / f"kill{k}" for k in sorted(points)}
    for path in out.values():
        shutil.copytree(root / "old", path)
    # each export kills itself at its own event: they run side by side
    killed = run_side_by_side(
        [export_cmd(tiny_model_dir, out[k], "--dtype", "bf16", "--kill_at", str(k)) for k in out]
    )
    for k, proc in zip(out, killed):
        assert proc.returncode == -signal.SIGKILL, (k, proc.stdout[-500:], proc.stderr[-2000:])
        loaded = weights(out[k])
        which = "old" if same(loaded, old) else "new" if same(loaded, new) else None
        assert which is not None, f"killed at event {k} ({events[k - 1]}): neither the old nor the new weights"
        seen[which] += 1
        outcomes[f"{k} ({events[k - 1]})"] = which
    # the next export into the same directory removes what the killed one left, and completes: checked on each side
    # of the swap (before it the staged new content is left over, after it the old one set aside)
    cleaned = sorted({shards[0], events.index("swapped") + 1})
    for k, proc in zip(
        cleaned, run_side_by_side([export_cmd(tiny_model_dir, out[k], "--dtype", "bf16") for k in cleaned])
    ):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert same(weights(out[k]), new)
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".kill{k}.")]
    print(json.dumps(outcomes, indent=1))
    assert seen["old"] and seen["new"]  # the schedule reached both sides of the swap


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))


def test_export_on_a_full_disk_says_so_in_one_line_and_keeps_the_old_content(old_and_new, tiny_model_dir, tmp_path):
    root, old, _, _ = old_and_new
    out = tmp_path / "out"
    shutil.copytree(root / "old", out)
    before = sorted(p.name for p in out.iterdir())
    proc = export(tiny_model_dir, out, "--dtype", "bf16", preexec=_limit_file_size)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hf-ext export:")]
    assert errors == [f"hf-ext export: could not write {out} (File too large); its previous content is intact."]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before and same(weights(out), old)
    assert not atomic.staged_path(out).exists() and not atomic.work_path(out).exists()
