"""``hf-ext launch``: the status a scheduler sees is the ranks', under each launcher the docs show. SIGTERM to one
rank (no restart allowed): every rank saves one agreed checkpoint and exits 75, the launchers themselves exit 1
(torchrun's agent reports its failed workers with a ``ChildFailedError`` traceback), and the command exits 75 with one
line and no traceback (accelerate's DeepSpeed YAML too). A rank that fails is neither 0 nor 75, its traceback kept; an
uninterrupted run exits 0. (SIGTERM to the command, under
torchrun, DeepSpeed's launcher and accelerate, and an elastic run that ends 0 after a preemption: the recipe's
preempted runs, tests/distributed/test_recipe_distributed.py.)"""

from __future__ import annotations

import subprocess

import pytest

from hf_ext.exit_status import PREEMPTED_EXIT_CODE

from ..conftest import BIN, ROOT, launch_env, launcher_cmd

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"


def hf_ext_launch(launcher: str, model_dir, out, *extra: str, **env) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "hf-ext"), "launch", *launcher_cmd(launcher, SCRIPT), "--model", str(model_dir), "--out",
           str(out), "--stage", "2", "--epochs", "1", "--save_steps", "100", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(**env), capture_output=True, text=True, timeout=600)


ACCELERATE_ZERO2 = f"accelerate:{ROOT / 'recipes' / 'accelerate' / 'zero2.yaml'}"
#: launcher -> the worker's flags under it (accelerate's YAML gives the DeepSpeed config: the script passes none)
LAUNCHERS = {"torchrun": [], "deepspeed": [], ACCELERATE_ZERO2: ["--no_ds"]}


@pytest.mark.parametrize("launcher", list(LAUNCHERS), ids=["torchrun", "deepspeed", "accelerate"])
def test_sigterm_to_one_rank_makes_the_command_exit_75_without_a_traceback(launcher, tiny_model_dir, tmp_path):
    proc = hf_ext_launch(launcher, tiny_model_dir, tmp_path / "out", *LAUNCHERS[launcher],
                         HF_EXT_TEST_SIGNAL_AT="2:SIGTERM:self")  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == PREEMPTED_EXIT_CODE, log[-4000:]
    saved = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert saved == ["checkpoint-3"], log[-4000:]  # the signal at the end of step 2, agreed during step 3
    assert f"hf-ext launch: preempted (SIGTERM): {tmp_path / 'out' / 'checkpoint-3'} is saved; exit status 75" in log
    assert "Traceback" not in log, log[-4000:]


def test_a_failed_rank_is_neither_done_nor_preempted_and_keeps_its_traceback(tiny_model_dir, tmp_path):
    proc = hf_ext_launch("torchrun", tiny_model_dir, tmp_path / "out", "--save_steps", "2", "--raise_on_rank1",
                         "checkpoint")  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode not in (0, PREEMPTED_EXIT_CODE), log[-4000:]
    assert "Traceback" in log and "ChildFailedError" in log and "hf-ext launch: preempted" not in log


def test_an_uninterrupted_run_exits_0(tiny_model_dir, tmp_path):
    proc = hf_ext_launch("torchrun", tiny_model_dir, tmp_path / "out")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "hf-ext launch:" not in proc.stdout + proc.stderr and list((tmp_path / "out").glob("*.safetensors"))
