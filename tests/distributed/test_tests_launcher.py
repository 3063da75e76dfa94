"""The tests' own launchers fork their processes from the session's preloaded interpreters (tests/launched/zygote.py):
the ranks of tests/launched/ranks.py, and the scripts of tests/launched/forked.py (``python_cmd``). A forked process
sees what a fresh interpreter sees after the same imports."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from ..conftest import LAUNCHED_SITE, ROOT, TRAIN_LAUNCHER, launch_env, launcher_cmd, python_cmd

pytestmark = pytest.mark.distributed

PROBE = ROOT / "tests" / "distributed" / "workers" / "rank_probe.py"


def probe(out, fresh: bool) -> list[dict]:
    cmd = launcher_cmd(TRAIN_LAUNCHER, PROBE, fresh=fresh) + [str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_a_forked_rank_sees_what_a_fresh_one_sees(tmp_path):
    forked, fresh = probe(tmp_path / "forked", fresh=False), probe(tmp_path / "fresh", fresh=True)
    # the premise: the first launch's ranks were forked by the preloaded interpreter, the second's were not
    assert {r["parent"] for r in forked} == {str(LAUNCHED_SITE / "zygote.py")}
    assert {r["parent"] for r in fresh} == {str(LAUNCHED_SITE / "ranks.py")}
    for rank, (a, b) in enumerate(zip(forked, fresh)):
        # the variables the imports set included; each launch has its own port
        assert {**a["env"], "MASTER_PORT": ""} == {**b["env"], "MASTER_PORT": ""}, rank
        assert a["argv"][1:] == [str(tmp_path / "forked")] and b["argv"][1:] == [str(tmp_path / "fresh")]
        assert a["argv"][0] == b["argv"][0] == str(PROBE)
        assert a["launch_env"] == {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
        for key in ("path0", "main", "cwd", "handlers", "torch_threads", "launch_env"):
            assert a[key] == b[key], key
        # the launcher's process group (this process's: the launcher was started in it), as a child of it would be
        assert a["process_group"] == b["process_group"] == os.getpgid(0)
    assert forked[0]["random"] != forked[1]["random"]  # each rank its own entropy, as fresh interpreters have


#: what a test's preexec_fn may set on the process it starts (the full-disk export's file-size limit)
FILE_SIZE_LIMIT = 1 << 20


def limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def test_a_forked_script_sees_what_python_script_sees(tmp_path):
    seen, ends = {}, {}
    for name, cmd in (("forked", python_cmd(PROBE)), ("fresh", [sys.executable, str(PROBE)]),
                      ("interpreter-exit", python_cmd(PROBE, interpreter_exit=True))):  # fmt: skip
        proc = subprocess.run([*cmd, str(tmp_path / name)], cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                              timeout=300, preexec_fn=limit_file_size)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        seen[name] = json.loads((tmp_path / name / "rank.json").read_text())
        ends[name] = f"C runtime's exit: {tmp_path / name}" in proc.stdout  # the probe's last line
    # a fresh process ends through the C runtime's exit; a forked one too where asked, otherwise with _exit
    assert ends == {"forked": False, "fresh": True, "interpreter-exit": True}
    assert seen["interpreter-exit"]["parent"] == str(LAUNCHED_SITE / "zygote.py")
    forked, fresh = seen["forked"], seen["fresh"]
    assert forked["parent"] == str(LAUNCHED_SITE / "zygote.py") != fresh["parent"]  # the premise
    assert forked["env"] == fresh["env"]
    assert forked["argv"] == [str(PROBE), str(tmp_path / "forked")] and fresh["argv"][1:] == [str(tmp_path / "fresh")]
    # no OMP_NUM_THREADS: torch's default threads (this machine's cores), as in a fresh interpreter
    assert "OMP_NUM_THREADS" not in forked["env"]
    for key in ("path0", "main", "cwd", "handlers", "torch_threads", "launch_env", "rlimits", "process_group"):
        assert forked[key] == fresh[key], key
    assert forked["rlimits"]["RLIMIT_FSIZE"] == [FILE_SIZE_LIMIT, FILE_SIZE_LIMIT]  # the caller's limit reached it
