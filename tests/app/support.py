"""Helpers for the Chat-E tests: model directories and a real ``chat-e`` server in a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..conftest import ROOT, free_port, launch_env

#: short, deterministic replies: what every test server and reference engine uses
TEST_SETTINGS = dict(num_beams=1, do_sample=False, max_new_tokens=8, min_new_tokens=1)


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


def chat_e_cmd(model: Path | str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "chat_e", "--model", str(model), "--port", str(port), *extra]


class ChatEServer:
    """``python -m chat_e --model DIR`` on a free port, its output in ``log_path``; generation settings are
    :data:`TEST_SETTINGS` unless ``model_defaults`` (then the model's own, as ``chat-e`` serves by default)."""

    def __init__(self, model: Path, log_path: Path, *extra: str, model_defaults: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        settings = [f"--{k}={v}" for k, v in TEST_SETTINGS.items() if k != "do_sample"] + ["--no-do_sample"]
        cmd = chat_e_cmd(model, self.port, *([] if model_defaults else settings), "--threads", "1", *extra)
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=launch_env(GRADIO_ANALYTICS_ENABLED="False"), stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 300) -> ChatEServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chat-e exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"chat-e did not answer on {self.url} within {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generations(self) -> int:
        """How many replies the server's engine has generated (one ``generate:`` log line each)."""
        return self.log().count("chat_e.engine: generate:")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
