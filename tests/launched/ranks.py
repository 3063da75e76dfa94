"""Start the ranks of a script as plain processes with torch's ``env://`` variables, as a cluster's step launcher
starts them (SLURM's ``srun`` with ``RANK``/``WORLD_SIZE`` exported, a Kubernetes Job per rank): no elastic agent,
so nothing imports torch before the ranks do and nothing polls them.

    python tests/launched/ranks.py --nproc 2 --master_port PORT script.py [args ...]

The launches whose fact is not the launcher use it (``tests/conftest.py``, ``TRAIN_LAUNCHER``): torchrun's agent
costs each launch about 2 s of its own (its torch import before the ranks start, its exit after theirs). What a launch
must behave like is torchrun's: the ranks share this process's stdout and stderr; SIGTERM or SIGINT to it goes to every
rank; ``OMP_NUM_THREADS`` is 1 unless set; when a rank fails the others get SIGTERM at once, and SIGKILL if they are
still there 30 s later (torchrun's grace period); it exits with the first failed rank's status (a rank killed by
signal N: 128 + N), 0 when all succeed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

#: seconds a rank has after SIGTERM before SIGKILL (torchrun's default)
GRACE_S = 30


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """torch's ``env://`` variables of rank ``rank`` of ``nproc`` on this host, the store on ``port``."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # kept, not only their pids: a dropped Popen goes to subprocess's own reaper list, which could wait for it first
    procs = [subprocess.Popen([sys.executable, args.script, *args.args],
                              env={**os.environ, **threads, **rank_env(rank, args.nproc, args.master_port)})
             for rank in range(args.nproc)]  # fmt: skip
    running = {proc.pid for proc in procs}

    def signal_running(signum: int) -> None:
        # by pid, never Popen.poll(): that could reap a rank before the loop below waits for it
        for pid in list(running):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, lambda *_: signal_running(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: signal_running(signal.SIGTERM))
    status = 0
    while running:
        pid, wait_status = os.wait()
        if pid not in running:
            continue
        running.discard(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        code = code if code >= 0 else 128 - code
        if code and not status:
            status = code
            signal_running(signal.SIGTERM)
            timer = threading.Timer(GRACE_S, signal_running, args=(signal.SIGKILL,))
            timer.daemon = True
            timer.start()
    return status


if __name__ == "__main__":
    sys.exit(main())
