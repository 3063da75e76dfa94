"""Helpers for the Chat-E tests: model directories and a real ``chat-e`` server in a subprocess."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ..conftest import ROOT, free_port, launch_env

#: short, deterministic replies: what every test server and reference engine uses
TEST_SETTINGS = dict(num_beams=1, do_sample=False, max_new_tokens=8, min_new_tokens=1)
#: the UI's ``respond`` settings (the declared generation settings in their order) that TEST_SETTINGS give: greedy
UI_SETTINGS = (1, False, 1.0, 1.0, TEST_SETTINGS["max_new_tokens"], TEST_SETTINGS["min_new_tokens"])


def make_sensitive_model(src: Path, dst: Path, std: float = 1.0, seed: int = 0) -> Path:
    """A tiny model (either family) with its weight matrices redrawn at a large ``std``.

    A random-init tiny model gives the same reply whatever it is told; with larger weights the reply depends on the
    whole input, so a test can tell which history a reply was generated from.
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from hf_ext.model_info import model_class

    model = model_class(AutoConfig.from_pretrained(src)).from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)  # every tokenizer file (a chat template is its own)
    return dst


def make_broken_model(src: Path, dst: Path) -> Path:
    """A model directory that loads but whose every generation fails (a forced BOS id outside the vocabulary)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    config["forced_bos_token_id"] = 10**6
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


def chat_e_cmd(model: Path | str, port: int, *extra: str, arena: Sequence[Path | str] = ()) -> list[str]:
    """``chat-e --model MODEL``; with ``arena``, ``chat-e arena --model MODEL --model ARENA[0] ...``. PyTorch runs a
    model directory unless ``extra`` names an ``--engine``: the app's tests are of the app around the reference engine,
    whose settings (beams, int8) and replies at once they use; the llama.cpp engine, the default where it is installed,
    has its own (tests/app/test_llamacpp_server.py)."""
    command = ["arena"] if arena else []
    others = [arg for other in arena for arg in ("--model", str(other))]
    engine = [] if "--engine" in extra else ["--engine", "torch"]
    return [
        sys.executable,
        "-m",
        "chat_e",
        *command,
        "--model",
        str(model),
        *others,
        "--port",
        str(port),
        *engine,
        *extra,
    ]


def wait_until_up(proc, request, what: str, log, timeout: float = 300) -> None:
    """Wait until ``request`` gets a 200: a ``RuntimeError`` with the log's end when ``proc`` exits first, a
    ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()[-4000:]}")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer within {timeout}s:\n{log()[-4000:]}")


class ChatEServer:
    """``python -m chat_e --model DIR`` on a free port, its output in ``log_path``; generation settings are
    :data:`TEST_SETTINGS` unless ``model_defaults`` (then the model's own, as ``chat-e`` serves by default).
    ``api_key`` reaches the server as ``CHAT_E_API_KEY`` (the readiness probe sends it). Feedback goes to
    ``feedback_db`` (default: a SQLite file beside the log, never the checkout's run directory). ``arena``: the other
    models of ``chat-e arena``, which then serves the arena instead. ``env``: more environment for the server and
    what it starts."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *extra: str,
        model_defaults: bool = False,
        api_key: str | None = None,
        feedback_db: str | None = None,
        arena: Sequence[Path | str] = (),
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        self.api_key = api_key
        settings = [f"--{k}={v}" for k, v in TEST_SETTINGS.items() if k != "do_sample"] + ["--no-do_sample"]
        self.feedback_db = feedback_db or f"sqlite:///{log_path.with_suffix('.feedback.db')}"
        cmd = chat_e_cmd(
            model,
            self.port,
            *([] if model_defaults else settings),
            "--threads",
            "1",
            "--feedback_db",
            self.feedback_db,
            *extra,
            arena=arena,
        )
        env = launch_env(GRADIO_ANALYTICS_ENABLED="False", **({"CHAT_E_API_KEY": api_key} if api_key else {}),
                         **(env or {}))  # fmt: skip
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict[str, str]:
        """What a client sends to be let in by the API key (nothing when the server has none)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 300) -> ChatEServer:
        try:
            wait_until_up(
                self.proc, urllib.request.Request(self.url, headers=self.headers), "chat-e", self.log, timeout
            )
        except TimeoutError:
            self.stop()
            raise
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generations(self) -> int:
        """How many replies the server's engine has generated (one ``generate:`` log line each)."""
        return self.log().count("chat_e.engines.local: generate:")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_kib(self) -> int:
        """The server process's resident memory (VmRSS) in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS in /proc/{self.proc.pid}/status")

    def client(self, **kwargs):
        """A :func:`gradio_client` on this server, with the API key when it has one."""
        return gradio_client(self.url, headers=self.headers or None, **kwargs)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, and SIGKILL when the process has not left after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gradio_client(url: str, **kwargs):
    """A quiet ``gradio_client.Client`` on ``url`` (plain http on loopback). ``ssl_verify=False``: with it on,
    gradio_client loads the CA bundle for every request it makes (about 40 ms of CPU per call here), even over http."""
    from gradio_client import Client

    return Client(url, **{"verbose": False, "analytics_enabled": False, "ssl_verify": False, **kwargs})


def stop_all(servers: Sequence[ChatEServer]) -> None:
    """Stop ``servers`` together: SIGTERM to each first, so that their graceful shutdowns (open connections get
    ``GRACEFUL_SHUTDOWN_SECONDS``) overlap."""
    for srv in servers:
        if srv.alive():
            srv.proc.terminate()
    for srv in servers:
        srv.stop()


@contextlib.contextmanager
def serving(*servers: ChatEServer):
    """Every server ready (a list, in order), and stopped afterwards whatever happened."""
    try:
        yield [srv.wait_ready() for srv in servers]
    finally:
        stop_all(servers)


@contextlib.contextmanager
def served_engine(model_dir: Path, model_defaults: bool = False):
    """The model as ``chat-e`` serves it (its default quantization, one thread, :data:`TEST_SETTINGS` unless
    ``model_defaults``) in this process, to predict a test server's replies: yields ``chat(message, history, mode,
    context) -> reply``, the request checked (and made plain turns) as the ``chat`` endpoint does it, under the
    default limits."""
    import torch

    from chat_e.__main__ import resolve_quantize
    from chat_e.data.limits import ChatLimits, check_request
    from chat_e.engines.local import LocalEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LocalEngine.from_pretrained(model_dir, quantize=resolve_quantize("auto", "fp32"))
        settings = engine.default_settings().replace(**({} if model_defaults else TEST_SETTINGS))

        def chat(message, history, mode, context):
            checked = check_request(ChatLimits(), message=message, history=history, mode=mode, context=context)
            return engine.reply(checked.but(settings=settings)).text

        yield chat
    finally:
        torch.set_num_threads(threads)


# ---- the oracle: stock transformers, no chat_e code --------------------------------------------------------------

#: MuDoConv's header per context mode, written out here rather than taken from chat_e.data.dialogue
MUDOCONV_HEADERS = {
    "persona": "your persona: {} </s>",
    "emotion": "context: {}",
    "domain": "domain: {}",
    "topic": "topic: {}",
}


def mudoconv_prompt(message: str, history: list[str] = (), mode: str = "free", context: str | None = None) -> str:
    """A BlenderBot input as MuDoConv writes it: the header, two spaces and ``<s>``, then the turns joined by
    ``</s> <s>``, the user's newest last."""
    body = " </s> <s> ".join([*history, message])
    return f"{MUDOCONV_HEADERS[mode].format(context)}  <s> {body}" if mode in MUDOCONV_HEADERS and context else body


def stock_seq2seq_reply(
    model_dir, prompt: str | list[int], *, int8: bool = False, dtype=None, threads: int | None = None, **generate
) -> str:
    """Stock ``AutoModelForSeq2SeqLM.generate`` on ``prompt`` (text, tokenized with the tokenizer's special tokens,
    or ids), the reply decoded without special tokens; ``int8``: torch's dynamic quantization of every Linear layer
    first. ``generate`` takes the settings (the model's generation_config supplies the rest, as it does for
    Chat-E); ``threads``: torch threads for it (a test server runs one)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, **({"dtype": dtype} if dtype else {})).eval()
    if int8:
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    ids = torch.tensor([tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)])
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate)
    finally:
        torch.set_num_threads(before)
    return tokenizer.decode(out[0], skip_special_tokens=True).strip()


def request(engine, message, history=(), mode="none", context=None, settings=None, sampling=None, **overrides):
    """An engine request of plain turns: ``settings`` (the engine's defaults when None) with ``overrides``."""
    from chat_e.data.limits import Request

    settings = (settings or engine.default_settings()).replace(**overrides)
    return Request(message, list(history), mode, context, settings, sampling)
