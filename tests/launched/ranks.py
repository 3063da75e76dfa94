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

Where the test session runs its preloaded interpreters (``tests/launched/zygote.py``, their sockets named by
``HF_EXT_TEST_ZYGOTE``), each rank is forked by the one with the rank's environment instead of starting a fresh
interpreter (about 7.5 s of imports each); ``--fresh``, or a rank environment that differs from every server's beyond
the rank's own variables, starts fresh ranks as before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading

#: seconds a rank has after SIGTERM before SIGKILL (torchrun's default)
GRACE_S = 30


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """torch's ``env://`` variables of rank ``rank`` of ``nproc`` on this host, the store on ``port``."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


class ForkedRank:
    """A rank forked by the session's preloaded interpreter (``zygote.py``): its pid, and its wait status once the
    server reports it on the rank's connection."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn, self.pid, self.buffer = conn, pid, b""

    def read_status(self) -> int | None:
        data = self.conn.recv(4096)
        if not data:  # the server went away: the rank's status is lost, reported as a failure
            return 1 << 8
        self.buffer += data
        if not self.buffer.endswith(b"\n"):
            return None
        return json.loads(self.buffer)["status"]


def fork_rank(path: str, argv: list[str], env: dict[str, str], interpreter_exit: bool = False) -> ForkedRank | None:
    """Ask the preloaded interpreter at ``path`` to fork one rank; None where it says the rank must start fresh.
    ``interpreter_exit``: the rank ends through the interpreter's whole exit, modules finalized (zygote.run_rank)."""
    # beside this file, imported where a server runs (the tests import this module for rank_env too)
    from zygote import INHERITED_SIGNALS, send_request  # noqa: PLC0415

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    # the signals this process ignores before it handles any: a fresh rank would inherit them ignored
    ignored = [name for name in INHERITED_SIGNALS if signal.getsignal(signal.Signals[name]) == signal.SIG_IGN]
    # and its resource limits (a test's preexec_fn limit on this process), which a fresh rank would inherit too
    limits = {
        name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")
    }
    send_request(conn, {"argv": argv, "env": env, "cwd": os.getcwd(), "pgid": os.getpgid(0), "client": os.getpid(),
                        "ignored": ignored, "rlimits": limits, "interpreter_exit": interpreter_exit})  # fmt: skip
    line = b""
    while not line.endswith(b"\n"):
        data = conn.recv(4096)
        if not data:
            raise ConnectionError(f"{path} closed the connection")
        line += data
    answer = json.loads(line)
    if "fresh" in answer:
        conn.close()
        return None
    return ForkedRank(conn, answer["pid"])


def fork(argv: list[str], env: dict[str, str], interpreter_exit: bool = False) -> ForkedRank | None:
    """One process of ``argv`` forked by the first of the session's preloaded interpreters (``HF_EXT_TEST_ZYGOTE``,
    one per thread setting) that has ``env``; None where none runs or none has it."""
    from zygote import SOCKET_ENV  # noqa: PLC0415 - as in fork_rank

    for path in os.environ.get(SOCKET_ENV, "").split(os.pathsep):
        rank = fork_rank(path, argv, env, interpreter_exit) if path else None
        if rank is not None:
            return rank
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="fresh interpreters even where a preloaded one is running (memory measurements)",
    )
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    envs = [{**os.environ, **threads, **rank_env(rank, args.nproc, args.master_port)} for rank in range(args.nproc)]
    forked = [] if args.fresh else [fork([args.script, *args.args], env) for env in envs]
    if forked and None in forked:  # the server said fresh for one: every rank starts fresh
        for rank in forked:
            if rank is not None:
                os.kill(rank.pid, signal.SIGKILL)
                while rank.read_status() is None:
                    pass
        forked = []
    # kept, not only their pids: a dropped Popen goes to subprocess's own reaper list, which could wait for it first
    procs = [] if forked else [subprocess.Popen([sys.executable, args.script, *args.args], env=env) for env in envs]
    running = {proc.pid for proc in procs or forked}

    def signal_running(signum: int) -> None:
        # by pid, never Popen.poll(): that could reap a rank before the loop below waits for it
        for pid in list(running):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, lambda *_: signal_running(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: signal_running(signal.SIGTERM))
    by_conn = {rank.conn: rank for rank in forked}
    status = 0
    while running:
        if forked:
            ready, _, _ = select.select(list(by_conn), [], [])
            rank = by_conn[ready[0]]
            wait_status = rank.read_status()
            if wait_status is None:
                continue
            del by_conn[rank.conn]
            pid = rank.pid
        else:
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
