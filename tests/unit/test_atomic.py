"""The all-or-nothing directory swap (hf_ext.atomic) in each state an interrupted write can leave."""

from __future__ import annotations

import json
import os

import pytest

from hf_ext import atomic
from hf_ext.saving.writer import is_weight_file


def make(root, files: dict[str, str]):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def content(root) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


OLD = {"config.json": "old", "model.safetensors": "old weights", "checkpoint-4/state": "ckpt", "all_results.json": "r"}
NEW = {"config.json": "new", "model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b",
       "model.safetensors.index.json": "i"}  # fmt: skip


def test_a_save_replaces_the_weights_and_carries_the_rest(tmp_path):
    target = make(tmp_path / "out", OLD)
    with atomic.atomic_directory(target, replaced=is_weight_file) as staged:
        make(staged, NEW)
    expected = {**NEW, "checkpoint-4/state": "ckpt", "all_results.json": "r"}  # old single file gone: no mix
    assert content(target) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staged, old or manifest left


def test_a_failed_write_leaves_the_target_untouched(tmp_path):
    target = make(tmp_path / "out", OLD)
    with pytest.raises(OSError), atomic.atomic_directory(target) as staged:
        make(staged, {"config.json": "half"})
        raise OSError(28, "No space left on device")
    assert content(target) == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_new_target_is_created(tmp_path):
    with atomic.atomic_directory(tmp_path / "a" / "out") as staged:
        make(staged, NEW)
    assert content(tmp_path / "a" / "out") == NEW


def test_carrying_links_the_old_entries_and_leaves_the_target_whole(tmp_path):
    target = make(tmp_path / "out", OLD)
    staged = make(atomic.staged_path(target), NEW)
    atomic.carry(target / "checkpoint-4", staged / "checkpoint-4")
    atomic.carry(target / "all_results.json", staged / "all_results.json")
    assert content(target) == OLD  # nothing moved out of it
    assert content(staged) == {**NEW, "checkpoint-4/state": "ckpt", "all_results.json": "r"}
    assert os.path.samefile(target / "checkpoint-4" / "state", staged / "checkpoint-4" / "state")


def test_carrying_copies_where_the_filesystem_refuses_hard_links(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")  # as a filesystem without hard links answers

    target = make(tmp_path / "out", OLD)
    monkeypatch.setattr(os, "link", no_links)
    atomic.carry(target / "checkpoint-4", tmp_path / "copy")
    assert content(tmp_path / "copy") == {"state": "ckpt"} and content(target) == OLD
    assert not os.path.samefile(target / "checkpoint-4" / "state", tmp_path / "copy" / "state")


@pytest.fixture(params=["linked", "moved"])
def staged_and_carried(request, tmp_path):
    """A kill after the manifest and a carried entry, before the swap: linked as hf-ext carries, or moved out of the
    target as an earlier version did (its leftovers are recovered too)."""
    target = make(tmp_path / "out", OLD)
    staged = make(atomic.staged_path(target), NEW)
    (staged / atomic.MANIFEST).write_text(json.dumps(sorted(NEW)))
    if request.param == "linked":
        atomic.carry(target / "checkpoint-4", staged / "checkpoint-4")
    else:
        os.replace(target / "checkpoint-4", staged / "checkpoint-4")
    return target


def test_recover_gives_carried_entries_back_before_the_swap(staged_and_carried, tmp_path):
    target = staged_and_carried
    atomic.recover(target)
    assert content(target) == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_recover_finishes_a_swap_cut_between_its_two_renames(staged_and_carried, tmp_path):
    target = staged_and_carried
    os.replace(target, atomic.old_path(target))  # the old content set aside, the new one not yet renamed in
    atomic.recover(target)
    assert content(target) == {**NEW, "checkpoint-4/state": "ckpt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_recover_restores_the_old_content_when_no_complete_new_one_exists(tmp_path):
    target = make(tmp_path / "out", OLD)
    make(atomic.staged_path(target), {"config.json": "half"})  # no manifest: not complete
    os.replace(target, atomic.old_path(target))
    atomic.recover(target)
    assert content(target) == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_recover_removes_the_old_content_left_after_the_exchange(tmp_path):
    target = make(tmp_path / "out", {**NEW, atomic.MANIFEST: "[]"})  # swapped in, manifest not yet removed
    make(atomic.staged_path(target), OLD)  # the exchange put the old content here (no manifest)
    make(atomic.work_path(target), {"scratch": "x"})
    atomic.recover(target)
    assert content(target) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_dir_swaps_a_whole_directory(tmp_path):
    final = make(tmp_path / "checkpoint-8", {"a": "old", "b": "old"})
    tmp = make(tmp_path / "tmp-checkpoint-8", {"a": "new"})
    atomic.replace_dir(tmp, final)
    assert content(final) == {"a": "new"} and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-8"]


def test_safetensors_io_errors_are_write_failures():
    from safetensors import SafetensorError

    err = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert atomic.write_failure(err) == "No space left on device"
    assert atomic.write_failure(OSError(27, "File too large")) == "File too large"
    assert atomic.write_failure(ValueError("bad")) is None
