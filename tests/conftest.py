"""Shared fixtures: a tiny BlenderBot and a tiny ChatML decoder built once per session, the vendored config corpus,
and a runner for real 2-rank launches.

Tiers: ``unit/`` (no training, no subprocess, under a minute), ``peer/`` (stock and hf-ext classes through the same
tests, docs/drop-in.md), ``integration/`` (in-process training, marked ``slow``), ``distributed/`` (real 2-rank
launches, marked ``distributed``), ``app/`` (server and browser)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


#: the GPU tier runs where a GPU is (``make test-gpu``); a CPU run does not collect it (``make test`` leaves it out too)
#: unless HF_EXT_GPU_DRYRUN=1 asks for its logic to be checked on CPU (``make test-gpu-dryrun``: same launches, no GPU)
GPU_DRYRUN = os.environ.get("HF_EXT_GPU_DRYRUN") == "1"
collect_ignore = [] if _has_cuda() or GPU_DRYRUN else ["gpu"]


def pytest_collection_finish(session) -> None:
    """What the collected test modules imported (torch, transformers, DeepSpeed, TRL, ...: millions of objects) goes to
    the collector's permanent generation: the full collections Python starts on its own during the tests, and the
    ones accelerate's ``free_memory`` asks for at each ``Trainer.train``, then walk what the tests made, not the
    libraries (docs/testing.md, "The collector's work"). What a test makes is collected as before."""
    gc.freeze()


BIN = Path(sys.executable).parent
# The environment's executables first for the whole session, this process and all it launches: DeepSpeed's launcher
# and console scripts, and ninja. DeepSpeed's CPU ops are compiled once and reused while the compile command is the
# same, and ninja's versions hash commands differently: a process that found the system's ninja would rebuild them
# (25-45 s each) and the next one with the environment's would rebuild them again (scripts/build_deepspeed_ops.py).
if os.environ.get("PATH", "").split(os.pathsep)[0] != str(BIN):
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
RECIPE = ROOT / "recipes" / "blenderbot.py"
TINY_YAML = ROOT / "recipes" / "configs" / "tiny.yaml"
DATA = ROOT / "tests" / "data"
#: DeepSpeed configs copied from public repositories (tests/data/deepspeed_configs/SOURCES.tsv, LICENSES.md)
CORPUS = DATA / "deepspeed_configs"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny BlenderBot + tokenizer trained on the offline corpus (built by the project's builder)."""
    from chat_e.data.models import build

    return build(str(tmp_path_factory.mktemp("models") / "tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_no_dropout_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny BlenderBot with its dropout off: runs on different world sizes then compute the same function."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("models") / "tiny_no_dropout"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny LlamaForCausalLM with SmolLM2's ChatML tokens and chat template (the project's builder)."""
    from chat_e.data.models import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny_chat", "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_model_dir(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct, converted from the installed GGUF file once per session (slow tiers only)."""
    from chat_e.data.models import build_smollm2

    return build_smollm2(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def medium_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A ~17M-parameter BlenderBot (random init): large enough that model states stand out of the runtime noise."""
    import torch
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration

    config = BlenderbotConfig.from_pretrained(tiny_model_dir)
    config.update(dict(vocab_size=8008, d_model=512, encoder_ffn_dim=2048, decoder_ffn_dim=2048))
    config.update(dict(encoder_attention_heads=8, decoder_attention_heads=8))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "medium"
    BlenderbotForConditionalGeneration(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def eval_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny BlenderBot trained a few dozen steps so that greedy replies end at many lengths (BLEU eval tests)."""
    from .bleu_support import build_eval_model

    return build_eval_model(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer(eval_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(eval_model_dir)


@pytest.fixture(scope="session")
def single_rank(eval_model_dir, tokenizer, tmp_path_factory) -> dict:
    """hf-ext's Seq2SeqTrainer evaluating in one process, no DeepSpeed: the reference of the 2-rank BLEU runs."""
    from .bleu_support import evaluate_single_rank

    return evaluate_single_rank(eval_model_dir, tokenizer, tmp_path_factory)


@pytest.fixture
def no_global_deepspeed_config():
    """TrainingArguments with a DeepSpeed config register it globally (zero.Init in from_pretrained reads it)."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def walk(node, prefix=""):
    """(dotted key, value) of every leaf of a nested dict. The tests' own, on purpose: it is the oracle that checks
    no "auto" survives resolution, so it does not share hf_ext's walk."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: its sitecustomize applies pyproject.toml's warning filters in the processes the tests launch (deprecations from the
#: libraries are errors there too)
LAUNCHED_SITE = ROOT / "tests" / "launched"


#: threads per process for every test process and launched rank, when set (scripts/kernel_matrix.py)
TEST_THREADS = "HF_EXT_TEST_THREADS"


def launch_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{LAUNCHED_SITE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # the ranks place their own threads (hf-ext: cores // local ranks), unless a run pins them for every process:
    # HF_EXT_TEST_THREADS (scripts/kernel_matrix.py's threads-per-rank setting, docs/testing.md)
    env.pop("OMP_NUM_THREADS", None)
    if os.environ.get(TEST_THREADS):
        env["OMP_NUM_THREADS"] = os.environ[TEST_THREADS]
    env.update({k: str(v) for k, v in extra.items()})
    return env


#: the launcher of the launches whose fact is not the launcher: the ranks started as plain processes with torch's
#: env:// variables (tests/launched/ranks.py), as a cluster's step launcher starts them. They start the same engine
#: about 2 s sooner than under torchrun (whose agent imports torch before starting them, and exits after them) and
#: 6.5 s sooner than under DeepSpeed's launcher (its runner and its launch process each import deepspeed; the launch
#: process polls its ranks once a second). The launchers themselves run under test_recipe_distributed (DeepSpeed's,
#: torchrun, accelerate's, Ray), test_multinode, test_comm_layer and test_fsdp.
TRAIN_LAUNCHER = "ranks"

#: the session's preloaded interpreters that fork the ranks of ``ranks`` launches and the scripts of ``python_cmd``
#: (tests/launched/zygote.py), one per thread setting: its process, or None where it could not start (those processes
#: then start fresh, as before)
_ZYGOTES: dict[str | None, subprocess.Popen | None] = {}


def _zygote_names():
    """tests/launched/zygote.py as a module, for its names (its imports are the standard library's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_ext_tests_zygote", LAUNCHED_SITE / "zygote.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: where a launched process finds them: their sockets, separated by os.pathsep (tests/launched/ranks.py)
ZYGOTES_ENV = _zygote_names().SOCKET_ENV


def start_zygote(threads: str | None) -> None:
    """Start tests/launched/zygote.py with ``OMP_NUM_THREADS=threads`` (None: unset, as :func:`launch_env` leaves it)
    once per session, on the first launch that asks for it, and add its socket to this process's environment: every
    launch's environment (:func:`launch_env`) then carries it to ``ranks.py`` and ``forked.py``."""
    if threads in _ZYGOTES:
        return
    # every process a fresh interpreter, as before: asked (to compare), or on a GPU machine, where a rank's CUDA must
    # start in the rank itself (the server never touches CUDA, but the GPU tier is not where to find out)
    if os.environ.get("HF_EXT_TEST_FRESH_RANKS") == "1" or _has_cuda():
        _ZYGOTES[threads] = None
        return
    import atexit
    import shutil
    import tempfile
    import time

    folder = Path(tempfile.mkdtemp(prefix="hf-ext-zygote-"))
    path, log = folder / "socket", folder / "zygote.log"
    env = launch_env(**({"OMP_NUM_THREADS": threads} if threads else {}))
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, str(LAUNCHED_SITE / "zygote.py"), str(path)], env=env, cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    while '"ready"' not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if '"ready"' not in log.read_text():
        server.kill()
        sys.stderr.write(f"tests/launched/zygote.py did not start (its log: {log}); its processes start fresh\n")
        _ZYGOTES[threads] = None
        return
    _ZYGOTES[threads] = server
    os.environ[ZYGOTES_ENV] = os.pathsep.join(p for p in [os.environ.get(ZYGOTES_ENV, ""), str(path)] if p)

    def stop() -> None:  # at the session's end: the server, then its socket and log
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)


def python_cmd(script: str | Path, interpreter_exit: bool = False) -> list[str]:
    """``python script``, forked from the session's preloaded interpreter where the launch's environment is
    :func:`launch_env`'s (tests/launched/forked.py: the same process to its caller, but for its pid). For the scripts
    that a test runs to their end or that kill themselves; one a test kills from outside, or whose ``/proc`` it reads,
    starts as ``[sys.executable, script]``. ``interpreter_exit``: the script's process ends through the interpreter's
    whole exit, modules finalized (0.3 s more), for a test whose fact is how the process ends."""
    start_zygote(os.environ.get(TEST_THREADS))
    flag = ["--interpreter-exit"] if interpreter_exit else []
    return [sys.executable, str(LAUNCHED_SITE / "forked.py"), *flag, str(script)]


def launcher_cmd(launcher: str, script: str | Path, nproc: int = 2, max_restarts: int = 0,
                 store_per_attempt: bool = True, fresh: bool = False) -> list[str]:  # fmt: skip
    """The command prefix of ``launcher`` (deepspeed, torchrun, accelerate:<yaml>, ranks, python) for ``script``.

    ``max_restarts``: how many times torch's elastic agent (torchrun's, accelerate's) starts the workers again after
    one fails. They then meet through c10d's rendezvous with a store per attempt, the launch docs/cluster.md gives;
    ``store_per_attempt=False`` keeps the launcher's default rendezvous, whose store a restarted group cannot use
    (``hf_ext.runtime.restart_hazard``). ``fresh``: the ``ranks`` launcher starts fresh interpreters, not ranks forked
    from the session's preloaded one (the memory measurements)."""
    port = free_port()
    if launcher == "ranks" and not max_restarts:
        if not fresh:
            start_zygote(os.environ.get(TEST_THREADS) or "1")  # what ranks.py gives its ranks
        return [sys.executable, str(LAUNCHED_SITE / "ranks.py"), "--nproc", str(nproc), "--master_port", str(port),
                *(["--fresh"] if fresh else []), str(script)]  # fmt: skip
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port), str(script)]
    if launcher == "python":
        return python_cmd(script)
    if launcher != "torchrun" and not launcher.startswith("accelerate:"):
        raise ValueError(launcher)
    restarts = ["--max-restarts" if launcher == "torchrun" else "--max_restarts", str(max_restarts)]
    fresh = max_restarts > 0 and store_per_attempt
    # torch's own variables: the store switch, and the endpoint torchrun's parser reads where accelerate has no flag
    env = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", f"PET_RDZV_ENDPOINT=127.0.0.1:{port}"] if fresh else []
    if launcher == "torchrun":
        where = ["--rdzv-backend", "c10d"] if fresh else ["--master_port", str(port)]
        return [*env, str(BIN / "torchrun"), "--nproc_per_node", str(nproc), *where, *restarts, str(script)]
    cfg = launcher.split(":", 1)[1]
    where = ["--rdzv_backend", "c10d"] if fresh else []
    return [*env, str(BIN / "accelerate"), "launch", "--config_file", cfg, "--main_process_port", str(port), *where,
            *restarts, str(script)]  # fmt: skip


def run_side_by_side(
    cmds: list[list[str]], timeout: int = 300, cwd: Path | list[Path] = ROOT
) -> list[subprocess.CompletedProcess]:
    """Independent commands (a CLI, an export, a launch that kills itself), as many at once as there are cores: each
    spends most of its seconds importing, on one core per process. Their results in order, output captured; nothing is checked here. ``cwd``: one
    folder for all, or one per command."""
    env = launch_env()
    cwds = cwd if isinstance(cwd, list) else [cwd] * len(cmds)

    def one(cmd_and_cwd: tuple[list[str], Path]) -> subprocess.CompletedProcess:
        cmd, folder = cmd_and_cwd
        return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, zip(cmds, cwds)))


def run_together(cmds: list[list[str]], timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """Independent launches side by side (:func:`run_side_by_side`); fail with the tail of the first that exited
    non-zero, as :func:`run` does."""
    procs = run_side_by_side(cmds, timeout=timeout)
    for cmd, proc in zip(cmds, procs):
        if proc.returncode != 0:
            tail = (proc.stdout[-4000:] + "\n---stderr---\n" + proc.stderr[-8000:]).strip()
            pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{tail}")
    return procs


def run(cmd: list[str], timeout: int = 900, **env) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root; fail with the tail of its output when it exits non-zero."""
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(**env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout[-4000:] + "\n---stderr---\n" + proc.stderr[-8000:]).strip()
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{tail}")
    return proc
