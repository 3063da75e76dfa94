"""Faults during saves and resumes, with real 2-rank ZeRO-3 runs:

* rank 0 is SIGKILLed at four write events of the final save (between shards, between the last shard and the
  index, and after an old checkpoint was carried into the new content: the old weights; right after the swap: the
  new ones): ``output_dir`` then loads with ``from_pretrained``, equals the weights expected there bit for bit and
  lists the old or the new entries, and the next run removes what the killed one left;
* a reader listing ``output_dir`` during an uninterrupted final save sees the old entries or the new ones, never a
  mix;
* rank 1 alone raises inside a checkpoint save, the final save and a resume, with the two ranks started as plain
  processes (no launcher to kill the survivor): both exit non-zero within 60 s of the error, each with its process
  groups destroyed before the interpreter finalizes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hf_ext import atomic

from ..conftest import ROOT, TRAIN_LAUNCHER, free_port, launch_env, launcher_cmd, python_cmd, run_side_by_side
from ..launched.ranks import rank_env
from .test_saving_distributed import SCRIPT, assert_equal_weights, train
from .workers.train_save import listing

pytestmark = pytest.mark.distributed

SMALL = ("--stage", "3", "--epochs", "1", "--max_shard_size", "20KB")


@pytest.fixture(scope="module")
def old_run(tiny_model_dir, tmp_path_factory):
    """A complete run (8 steps): its output_dir is the old content every killed save starts from."""
    root = tmp_path_factory.mktemp("faults")
    train(tiny_model_dir, root / "old", *SMALL, "--dump", str(root / "old.pt"))
    return root


#: where rank 0 is SIGKILLed in the final save (a write event's name, as the worker's ``SaveEvents`` lists them), and
#: the content the kill leaves: before the second shard (a part of the new weights written) and before the index
#: (every shard written, nothing says so yet) the old weights; right after the swap into place the new ones. The other
#: events, with the same staged writer: tests/integration/test_atomic_writes.py
KILL_POINTS = {
    r"open model-00002-of-\d+\.safetensors": "old",
    r"write model\.safetensors\.index\.json": "old",
    r"carried checkpoint-8": "old",
    "swapped": "new",
}
#: the kill whose folder the uninterrupted save then runs into
FIRST_KILL = next(iter(KILL_POINTS))


@pytest.fixture(scope="module")
def killed(old_run, tiny_model_dir) -> dict:
    """The run of :func:`new_save` killed at each of :data:`KILL_POINTS`, each over a copy of the old output, side by
    side: by point, its folder, its process, whether it left staged leftovers and a copy of the folder as the kill
    left it."""
    outs = {point: old_run / f"kill{i}" for i, point in enumerate(KILL_POINTS)}
    for out in outs.values():
        shutil.copytree(old_run / "old", out)
    procs = run_side_by_side([[*launcher_cmd(TRAIN_LAUNCHER, SCRIPT), "--model", str(tiny_model_dir), "--out",
                               str(out), *SMALL, "--batch", "4", "--dump", f"{out}.pt", "--kill_final_save_at", point]
                              for point, out in outs.items()], timeout=600)  # fmt: skip
    found = {}
    for (point, out), proc in zip(outs.items(), procs):
        as_killed = out.parent / f"{out.name}-as-killed"  # new_save runs into the first one: its content now, kept
        shutil.copytree(out, as_killed)
        found[point] = {"out": out, "proc": proc, "staged": atomic.staged_path(out).exists(), "as_killed": as_killed}
    return found


@pytest.fixture(scope="module")
def new_save(old_run, killed, tiny_model_dir):
    """An uninterrupted run of 4 steps (micro-batch 4) into the output the first kill left (the old run's content and
    that kill's leftovers): the new weights and the final save's events."""
    out = killed[FIRST_KILL]["out"]
    events = old_run / "events.json"
    train(tiny_model_dir, out, *SMALL, "--batch", "4", "--dump", str(old_run / "new.pt"), "--list_save_events",
          str(events))  # fmt: skip
    return out, json.loads(events.read_text())


def names(folder: Path) -> list[str]:
    """What the worker's reader lists of ``folder`` (as its JSON file holds it)."""
    return list(listing(str(folder)))


def test_a_reader_during_the_final_save_lists_the_old_or_the_new_names_only(old_run, new_save):
    """The worker's reader listed the output folder at every write event of the uninterrupted final save, and from a
    thread as fast as it could: every listing is the old run's or the finished save's, never a mix (the carried
    checkpoint-8 missing while it is carried into the new content)."""
    out, events = new_save
    seen = json.loads((old_run / "events.json.listings.json").read_text())
    old, new = names(old_run / "old"), names(out)
    assert [listing for listing in seen if listing not in (old, new)] == []
    assert new in seen and "checkpoint-8" in old  # the premise: the save ran while the reader listed
    assert "carried checkpoint-8" in events  # ... and carried the old checkpoint into the new content


def test_a_save_over_an_old_run_keeps_its_checkpoints_and_removes_a_killed_save(old_run, killed, new_save):
    out, events = new_save
    old, new = torch.load(old_run / "old.pt"), torch.load(old_run / "new.pt")
    assert any(not torch.equal(old[k], new[k]) for k in old)
    assert_equal_weights(new, out)
    # the old run's checkpoints are carried over; the new run's checkpoint-4 replaced the old one
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["max_steps"] == 4
    # the killed save's leftovers, there before this run, are gone
    assert killed[FIRST_KILL]["staged"]
    assert not atomic.staged_path(out).exists() and not list(out.glob("tmp-*"))
    assert sum(name.startswith("open model-") for name in events) > 2
    # every kill point is an event of the uninterrupted save, in this order, the swap last but for what follows it
    at = [next(i for i, e in enumerate(events) if re.fullmatch(point, e)) for point in KILL_POINTS]
    assert at == sorted(at) and 0 < at[0], events


def test_a_kill_during_the_final_save_leaves_the_old_or_the_new_weights(old_run, killed, new_save):
    weights = {"old": torch.load(old_run / "old.pt"), "new": torch.load(old_run / "new.pt")}
    for point, expected in KILL_POINTS.items():
        proc = killed[point]["proc"]
        said = re.search(r"rank 0: SIGKILL at save event (\d+) \((.*)\)", proc.stdout)
        assert proc.returncode != 0 and said and re.fullmatch(point, said.group(2)), proc.stdout[-2000:]
        print(f"killed at save event {said.group(1)} ({said.group(2)}): expecting the {expected} weights")
        assert_equal_weights(weights[expected], killed[point]["as_killed"])
        assert names(killed[point]["as_killed"]) == names(old_run / "old" if expected == "old" else new_save[0])


def start_ranks(cmd: list[str], logs: list[Path]) -> list[subprocess.Popen]:
    """The two ranks as plain processes, as a cluster scheduler starts them: nobody kills the survivor. Their output
    goes to files (a pipe nobody reads while they run would block them). ``cmd`` is :func:`python_cmd`'s: each rank is
    forked from the session's preloaded interpreter and ends through the interpreter's whole exit, as a fresh one's
    does (``interpreter_exit``)."""
    port = free_port()
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=launch_env(**rank_env(rank, len(logs), port)), stdout=f,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    return procs


FAILURE_POINTS = ["checkpoint", "final_save", "resume", "evaluation"]


@pytest.fixture(scope="module")
def failed_runs(old_run, tiny_model_dir, tmp_path_factory) -> dict:
    """Each failure point's 2-rank run, all started at once (each pair of ranks independent of the others): by point,
    its folder, its ranks and the time each rank exited (None: killed after 5 minutes)."""
    root = tmp_path_factory.mktemp("failures")
    runs = {}
    for where in FAILURE_POINTS:
        folder = root / where
        folder.mkdir()
        extra = {"resume": ["--resume", str(old_run / "old" / "checkpoint-4")], "evaluation": ["--eval_first"]}
        cmd = [*python_cmd(SCRIPT, interpreter_exit=True), "--model", str(tiny_model_dir), "--out",
               str(folder / "out"), *SMALL, *extra.get(where, []), "--raise_on_rank1", where]  # fmt: skip
        log_files = [folder / f"rank{rank}.log" for rank in (0, 1)]
        runs[where] = {"logs": log_files, "procs": start_ranks(cmd, log_files), "exited": {}}
    deadline = time.time() + 300
    while time.time() < deadline and any(len(r["exited"]) < 2 for r in runs.values()):
        for r in runs.values():
            for rank, proc in enumerate(r["procs"]):
                if rank not in r["exited"] and proc.poll() is not None:
                    r["exited"][rank] = time.time()
        time.sleep(0.05)
    for r in runs.values():
        for proc in r["procs"]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return runs


@pytest.mark.parametrize("where", FAILURE_POINTS)
def test_one_rank_fails_every_rank_stops(where, failed_runs):
    procs, exited, log_files = (failed_runs[where][k] for k in ("procs", "exited", "logs"))
    logs = [log.read_text() for log in log_files]
    raised = re.search(r"rank 1 raises at ([\d.]+)", logs[1])
    assert raised, logs[1][-3000:]
    took = {rank: round(at - float(raised.group(1)), 1) for rank, at in exited.items()}
    print(f"{where}: seconds from the error to each rank's exit: {took}")
    assert sorted(exited) == [0, 1], f"a rank still ran 5 minutes after it started: {took}\n{logs[0][-3000:]}"
    assert all(proc.returncode != 0 for proc in procs), [proc.returncode for proc in procs]
    assert max(took.values()) < 60, took
    # the error is said by the failing rank; the other one stops on the agreed outcome, naming it without repeating it
    # (not on a lost connection once rank 1 is gone: on gloo that would stop it too, on NCCL not before a timeout)
    assert "No space left on device (rank 1" in logs[1] and "No space left on device" not in logs[0]
    assert "RankFailure: rank 1 failed while" in logs[0], logs[0][-3000:]
    assert "terminate called" not in logs[0] + logs[1]
    # each rank destroyed its process groups before the interpreter's finalization (left to it, gloo's threads can
    # outlive the interpreter and abort the process: "terminate called without an active exception")
    assert all("at exit: process group alive: False" in log for log in logs), [log[-1500:] for log in logs]
