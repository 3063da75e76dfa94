"""A preloaded interpreter that forks the tests' ranks: torch, transformers, DeepSpeed, PEFT, TRL, datasets and
hf-ext are imported once per test session instead of once per rank.

A rank's own work in the tests is a few seconds; importing its libraries costs each process about 7.5 s of a core
(``python -X importtime``: transformers' import structure, torch's operator registrations, dataclasses), so a 2-rank
launch spent most of its time importing. ``tests/conftest.py`` starts one server per thread setting, on the first
launch that needs it: ``OMP_NUM_THREADS=1`` for ``tests/launched/ranks.py`` (the launcher of the launches whose fact
is not the launcher), which asks it for each rank, and the variable unset for ``tests/launched/forked.py`` (a test's
``python script.py``: ``python_cmd``). What stays as it was: torchrun, DeepSpeed's launcher, accelerate, Ray, every
CLI and server start fresh interpreters; so do the memory measurements (``ranks.py --fresh``) and the benchmarks.

    python tests/launched/zygote.py SOCKET

Protocol, over a Unix socket, one connection per rank: the client sends one JSON line ``{"argv": [script, ...],
"env": {...}, "cwd": ..., "pgid": ..., "client": PID, "ignored": [the signals it ignores], "rlimits": {...},
"interpreter_exit": false}`` with
its stdin, stdout and stderr attached (``SCM_RIGHTS``); the server answers ``{"pid": N}`` and, when that process has
exited, ``{"status": WAITSTATUS}``; or ``{"fresh": "why"}`` when the rank must start as a fresh interpreter: its
environment differs from the server's in a variable a library may read at import (only the variables below are set
per rank), a resource limit is above what this process may set, or its client runs in another session.

The forked rank is what a fresh ``python script.py`` is after its imports: ``__main__`` is the script (``runpy``),
``sys.argv`` and ``sys.path[0]`` are the script's, the environment and working directory are the request's, signal
handlers are Python's defaults but where the launcher ignores the signal, it joins the client's process group and
takes its resource limits, the
env-gated test hooks of ``sitecustomize.py`` are installed and hf-ext's launch variables read
(``hf_ext.runtime.read_launch_env``) from its own environment, and it exits as the interpreter does (non-daemon
threads joined, ``atexit`` run, the exit status of ``SystemExit`` or 1 after the traceback), then leaves without the
modules' finalization, or, where the request asks (``"interpreter_exit": true``), through the interpreter's whole
exit. What differs is the garbage collector's work: the imports' objects are in its permanent generation
(``gc.freeze`` before each fork), so the rank's collections, and ``gc.get_objects``, see only the objects the rank
made; what they find and free among those is the same.
"""

from __future__ import annotations

import array
import gc
import importlib
import json
import os
import pkgutil
import resource
import selectors
import signal
import socket
import sys

#: the variables that may differ between the server and a rank: read at run time, never at import (and the test
#: hooks', sitecustomize.ENV_HOOKS: :func:`test_hooks`)
PER_RANK = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PYTEST_CURRENT_TEST"}  # fmt: skip
#: what the ranks' scripts import (tests/distributed/workers, recipes/)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "numpy", "psutil",
           "yaml", "safetensors.torch", "datasets", "sacrebleu", "accelerate", "deepspeed", "deepspeed.comm",
           # what DeepSpeed's engine imports at its start (ZeRO's optimizer check: 0.7 s, inductor's modules)
           "deepspeed.runtime.zero.muon.muon_optimizer", "peft",
           "transformers", "transformers.trainer", "transformers.integrations.deepspeed", "trl",
           "matplotlib", "matplotlib.pyplot"]  # fmt: skip
#: transformers' lazily loaded names the ranks use
TRANSFORMERS_NAMES = ["Trainer", "Seq2SeqTrainer", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoTokenizer",
                      "BlenderbotForConditionalGeneration", "LlamaForCausalLM", "DebertaV2ForSequenceClassification",
                      "DataCollatorForSeq2Seq", "DataCollatorWithFlattening", "DataCollatorWithPadding"]  # fmt: skip
#: first-party packages imported whole (but the app's, which the ranks never import)
PACKAGES = ["hf_ext", "chat_e.data", "chat_e.training"]
#: left to the ranks that import them: Ray's import sets a variable of its own (RAY_CLIENT_MODE), and the ranks this
#: server forks never run under Ray
NOT_PRELOADED = {"hf_ext.ray"}
#: the servers' sockets, separated by os.pathsep: set by tests/conftest.py, read by ranks.py and forked.py
SOCKET_ENV = "HF_EXT_TEST_ZYGOTE"
#: the signals whose disposition a rank takes from its launcher (ignored, or Python's default)
INHERITED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD")
#: the server's environment before its imports: a rank's is compared with it
START_ENV = dict(os.environ)


def preload() -> list[str]:
    """Import what the ranks use; the names that failed (a rank then imports them itself)."""
    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a library that cannot be preloaded is imported by the rank as before
            failed.append(name)
    try:  # DeepSpeed's probe of which ops this machine can build (a compiler run, 0.35 s): made once per process
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__  # noqa: B018 - computed and kept by the module on first access
    except Exception:  # noqa: BLE001
        failed.append("deepspeed.ops.__compatible_ops__")
    import transformers

    for name in TRANSFORMERS_NAMES:
        getattr(transformers, name)
    for package in PACKAGES:
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, f"{package}."):
            if info.name in NOT_PRELOADED:
                continue
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001
                failed.append(info.name)
    return failed


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        if not msg:
            raise ConnectionError("closed before a request")
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def send_request(conn: socket.socket, request: dict) -> None:
    """The client's side: the request with this process's stdin, stdout and stderr."""
    conn.sendmsg([json.dumps(request).encode() + b"\n"],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])  # fmt: skip


def test_hooks() -> set[str]:
    """The test hooks' variables (imported here, not at the top: tests/conftest.py reads this file's names without
    this folder's sitecustomize, which only the processes the tests launch run)."""
    from sitecustomize import ENV_HOOKS  # this folder's: on the path of every process the tests launch

    return set(ENV_HOOKS)


def differing(env: dict) -> list[str]:
    keys = (set(env) | set(START_ENV)) - PER_RANK - test_hooks() - {SOCKET_ENV}
    return sorted(k for k in keys if env.get(k) != START_ENV.get(k))


def unsettable_limits(rlimits: dict) -> list[str]:
    """The client's resource limits a forked rank could not take: a hard limit above this process's (only root may
    raise one)."""
    if os.geteuid() == 0:
        return []
    unlimited = resource.RLIM_INFINITY

    def above(limit: int, own: int) -> bool:
        return own != unlimited and (limit == unlimited or limit > own)

    return [name for name, (_, hard) in rlimits.items() if above(hard, resource.getrlimit(getattr(resource, name))[1])]


def rank_environment(env: dict) -> dict:
    """The request's environment with what the imports changed in it, as the rank's own imports would have (torch
    and Ray set variables of their own)."""
    changed = {k: v for k, v in os.environ.items() if START_ENV.get(k) != v}
    removed = set(START_ENV) - set(os.environ)
    return {k: v for k, v in {**env, **changed}.items() if k not in removed}


def run_rank(request: dict, fds: list[int]) -> None:
    """In the forked child: become the rank, run its script and exit. Never returns.

    By default the rank's exit is the interpreter's first steps (non-daemon threads joined, ``atexit`` run), then
    ``os._exit``: the modules' finalization and the C runtime's exit are skipped (0.3 s per rank over the preloaded
    modules). A request with ``"interpreter_exit": true`` (a test whose fact is how a rank's process ends: gloo's
    threads against finalization, tests/distributed/test_save_faults.py) raises ``SystemExit`` instead, which unwinds
    :func:`serve` (nothing there cleans up) to the interpreter's whole exit, as a fresh rank's is."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # what a fresh interpreter's are: a signal its launcher ignored stays ignored through exec (a job that
        # nohup or a non-interactive shell started in the background: SIGHUP, SIGINT); otherwise Python's own
        for name in INHERITED_SIGNALS:
            sig = signal.Signals[name]
            if name in request["ignored"]:
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets them at start-up
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        os.setpgid(0, request["pgid"])
        for name, limit in request["rlimits"].items():  # the client's, as a fresh rank inherits them
            if resource.getrlimit(getattr(resource, name)) != tuple(limit):
                resource.setrlimit(getattr(resource, name), tuple(limit))
        env = rank_environment(request["env"])
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        script = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(script)
        import random

        random.seed()  # a fresh interpreter's own entropy, not the server's state
        import sitecustomize

        sitecustomize.install_env_hooks()
        import hf_ext.runtime

        hf_ext.runtime.read_launch_env()  # the one value hf-ext reads from the environment at import
        import atexit
        import runpy
        import threading
    except BaseException:  # noqa: BLE001 - the server's own state broke: never run the server's loop in the child
        sys.excepthook(*sys.exc_info())
        os._exit(1)
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:  # read as the interpreter reads it: below, or by the interpreter itself
        code = exit_.code
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it (without this file's frames)
        sys.excepthook(*sys.exc_info())
    if request.get("interpreter_exit"):
        raise SystemExit(code)
    status = 1  # an int for os._exit whatever fails below: nothing may unwind into the server's loop
    try:
        status = exit_status(code)
        threading._shutdown()  # the interpreter's own exit: non-daemon threads first, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def exit_status(code) -> int:
    """The status the interpreter exits with for ``SystemExit(code)``: an int as it is, None 0, anything else printed
    to stderr and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def serve(path: str) -> None:
    asked = sorted(test_hooks() & set(START_ENV))
    if asked:  # sitecustomize installed them here at start-up: every rank would have them
        sys.exit(f"zygote.py: started with test hooks set ({', '.join(asked)}); they belong to one launch's ranks")
    failed = preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # pid -> its client's connection
    print(json.dumps({"ready": os.getpid(), "not_preloaded": failed}), flush=True)
    while True:
        for key, _ in selector.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = recv_request(conn)
                except (ConnectionError, ValueError):
                    conn.close()
                    continue
                why = differing(request["env"]) + unsettable_limits(request["rlimits"])
                if os.getsid(request["client"]) != os.getsid(0):  # a process group it could not join
                    why = ["another session"]
                if why:
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(json.dumps({"fresh": ", ".join(why)}).encode() + b"\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                # what the server holds goes to the collector's permanent generation (Python's advice for a process
                # that forks without exec): the rank's collections walk its own objects only, not the millions its
                # imports made (accelerate's free_memory, which the Trainer calls, collects: 0.3 s each over them)
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    run_rank(request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
