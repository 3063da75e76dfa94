"""``python SCRIPT ARGS``, forked from the test session's preloaded interpreter (``tests/launched/zygote.py``) where one
runs with this process's environment: the single-process launches of the tests (``tests/conftest.py``,
``python_cmd``) skip the 7.5 s of a fresh interpreter's imports as the ranks of ``ranks.py`` do.

    python tests/launched/forked.py [--interpreter-exit] SCRIPT [ARGS ...]

``--interpreter-exit``: the script's process ends through the interpreter's whole exit, its modules finalized and the
C runtime's exit run, as a fresh one's does (for a test whose fact is how the process ends; without it the forked
process leaves with ``os._exit`` once ``atexit`` ran: ``zygote.run_rank``).

To its caller it is the script's process: the script has this process's stdin, stdout, stderr, working directory,
environment, process group, ignored signals and resource limits (a test's ``preexec_fn`` limit included); SIGTERM,
SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to this process are sent on to the script; and this process ends as
the script did, with its exit status or killed by the same signal (a script that SIGKILLs itself: this process is
then killed by SIGKILL too). What differs: the script's pid is not this process's, so a caller that SIGKILLs this
process from outside or reads the script's ``/proc`` entries must start the script itself. Where no preloaded
interpreter runs, or none has this process's environment, this process execs ``python SCRIPT ARGS`` in its own place.
"""

from __future__ import annotations

import os
import signal
import sys

from ranks import fork  # beside this file

#: the signals passed on to the script (the ones a test or a launcher sends a process to stop it)
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    argv = sys.argv[1:]
    interpreter_exit = argv[:1] == ["--interpreter-exit"]
    argv = argv[interpreter_exit:]
    child = fork(argv, dict(os.environ), interpreter_exit)
    if child is None:
        os.execv(sys.executable, [sys.executable, *argv])

    def relay(signum: int, _frame) -> None:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        if signal.getsignal(sig) != signal.SIG_IGN:  # an ignored signal stays ignored, as it is in the script
            signal.signal(sig, relay)
    status = None
    while status is None:  # blocks until the server's line (Python retries the read a relayed signal interrupts)
        status = child.read_status()
    if os.WIFSIGNALED(status):  # end as the script ended: killed by the same signal
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # the two without a handler
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
