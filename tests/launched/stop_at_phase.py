"""Hold a Chat-E training run in one of its phases, for the Train page's browser walk: a real SIGSTOP to itself.

``CHAT_E_TEST_STOP_AT_PHASE="PHASE:FLAG"`` in a launched process's environment (``sitecustomize`` installs it): once
rank 0 has announced PHASE (a name of :data:`chat_e.training.progress.PHASES`) in its progress file, it stops itself
with SIGSTOP, if the file FLAG exists, which it removes first (one run of the server's holds, the others go on). The
test then acts on the paused run and sends SIGCONT.
"""

from __future__ import annotations

import os
import signal

ENV = "CHAT_E_TEST_STOP_AT_PHASE"


def install_from_env() -> None:
    wanted, _, flag = os.environ[ENV].rpartition(":")
    from chat_e.training import progress  # noqa: PLC0415 (only in the processes that asked for it)

    announce = progress.phase

    def phase(name: str, is_main: bool, **detail) -> None:
        announce(name, is_main, **detail)
        if name != wanted or not is_main:
            return
        try:
            os.unlink(flag)  # claimed by this run only
        except FileNotFoundError:
            return
        print(f"held at {name!r}: SIGSTOP to pid {os.getpid()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    progress.phase = phase
