"""``hf-ext launch LAUNCHER ...``: run a launch line (torchrun, DeepSpeed's launcher, ``accelerate launch``) and exit
with the status a scheduler should see: 0 when the run is done, 75 when it was preempted with a checkpoint (requeue
it; ``--resume_from_checkpoint`` goes on), anything else when it failed.

A launcher's own status loses the preemption: torchrun's agent, signalled too, raises ``SignalException`` and exits 1
whatever its ranks did. The ranks' fact is the preemption's record, which rank 0 writes just before exiting 75
(:mod:`hf_ext.exit_status`); this command points :data:`~hf_ext.exit_status.RECORD_ENV` at a fresh file for the
launch, so the record it finds is this launch's. The status it exits with:

* the launcher's 0: 0 (an elastic launch whose restarted workers finished, after a preemption, is done);
* else, a record: 75, and the launcher's traceback about the signal (``SignalException``) or its workers' status
  (``ChildFailedError``) is left out, with one line instead: the run was preempted, where its checkpoint is;
* else the launcher's status (``128 + N`` for a launcher killed by signal N).

The launcher runs in a process group of its own. A signal to this command (SLURM's SIGTERM, Kubernetes',
``--signal=USR1@120``) goes to every process of that group, as SLURM signals every process of a job step: the
launcher and its ranks (DeepSpeed's single-node launcher does not pass a SIGTERM on; torchrun's agent does, and the
ranks take the second copy within :data:`REPEAT_WINDOW_S` as the same request). The same signal again within that
window (SLURM's copy and a forwarded one) is not sent twice. The command exits once every process of the group has
(a launcher can exit before its ranks have saved). ``HF_EXT_LAUNCH_PID`` tells the ranks this command's pid.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from ..exit_status import PREEMPTED_EXIT_CODE, RECORD_ENV, REPEAT_WINDOW_S, read_preemption_record

LAUNCH_HELP = "Run a launch line (torchrun, deepspeed, accelerate launch) and exit 0 done, 75 preempted, else failed."
#: the signals passed on to the launcher
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
#: the last line of a launcher's traceback that only reports the preemption
LAUNCHER_ENDINGS = ("SignalException", "ChildFailedError")
TRACEBACK = "Traceback (most recent call last):"
PID_ENV = "HF_EXT_LAUNCH_PID"
#: a held traceback longer than this is no launcher's last word: it is written out
MAX_HELD_LINES = 400


def launch_command_parser(subparsers):
    parser = subparsers.add_parser("launch", help=LAUNCH_HELP, description=LAUNCH_HELP)
    parser.add_argument("launch_line", nargs=argparse.REMAINDER, help="the launcher and its arguments")
    parser.set_defaults(func=launch_command)
    return parser


class HeldTraceback:
    """Copies the launcher's stderr to ours line by line, holding a traceback back until the next line comes more than
    a moment later (a traceback that is not the launcher's last word) or the launcher exits (:meth:`finish`)."""

    def __init__(self, stream, out):
        self.stream, self.out, self.held, self.last = stream, out, [], 0.0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        for line in iter(self.stream.readline, ""):
            with self.lock:
                now = time.monotonic()
                if self.held and (now - self.last > REPEAT_WINDOW_S or len(self.held) >= MAX_HELD_LINES):
                    self._release()
                if self.held or line.startswith(TRACEBACK):
                    self.held.append(line)
                    self.last = now
                else:
                    self.out.write(line)
                    self.out.flush()

    def _release(self) -> None:
        self.out.writelines(self.held)
        self.out.flush()
        self.held = []

    def finish(self, drop_launcher_traceback: bool) -> bool:
        """Once the launcher exited: write what is held, unless ``drop_launcher_traceback`` and it is the launcher's
        traceback about the preemption; whether something was left out."""
        self.thread.join()
        with self.lock:
            if drop_launcher_traceback and any(ending in "".join(self.held) for ending in LAUNCHER_ENDINGS):
                self.held = []
                return True
            self._release()
        return False


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies, which are only waiting to be reaped, not counted)."""
    members = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
    return members


def wait_for_group(pgid: int, poll_s: float = 0.2, say_after_s: float = 30.0) -> None:
    """Until no live process of the launcher's group ``pgid`` is left: ranks saving a checkpoint outlive a launcher
    that exited first. Says once, after ``say_after_s``, which ones it waits for."""
    started, said = time.monotonic(), False
    while members := group_members(pgid):
        if not said and time.monotonic() - started > say_after_s:
            print(f"hf-ext launch: the launcher exited; waiting for its processes {members} to end.", file=sys.stderr)
            said = True
        time.sleep(poll_s)


def launch_command(args: argparse.Namespace) -> int:
    line = list(args.launch_line)
    line = line[1:] if line[:1] == ["--"] else line
    if not line:
        print(
            "hf-ext launch: give the launch line, e.g. hf-ext launch torchrun --nproc_per_node 2 train.py",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="hf-ext-launch-") as folder:
        record = Path(folder) / "preempted.json"
        env = {**os.environ, RECORD_ENV: str(record), PID_ENV: str(os.getpid())}
        try:
            proc = subprocess.Popen(
                line, env=env, stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True
            )
        except OSError as err:
            print(f"hf-ext launch: cannot run {line[0]!r}: {err.strerror}", file=sys.stderr)
            return 127
        sent: dict[int, float] = {}

        def forward(signum, frame):
            now = time.monotonic()
            if now - sent.get(signum, -REPEAT_WINDOW_S - 1) > REPEAT_WINDOW_S:
                sent[signum] = now
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        copier = HeldTraceback(proc.stderr, sys.stderr)
        try:
            status = proc.wait()
            wait_for_group(proc.pid)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        preemption = read_preemption_record(record) if status != 0 else None
        dropped = copier.finish(drop_launcher_traceback=preemption is not None)
    if status == 0:
        return 0
    if preemption is not None:
        left_out = "; its traceback about it is left out" if dropped else ""
        print(
            f"hf-ext launch: preempted ({preemption.get('signal')}): {preemption.get('checkpoint')} is saved; exit "
            f"status {PREEMPTED_EXIT_CODE} (the launcher exited {status}{left_out}). Resume with "
            "--resume_from_checkpoint True.",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT_CODE
    return 128 - status if status < 0 else status
