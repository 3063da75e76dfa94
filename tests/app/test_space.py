"""Chat-E's Hugging Face Space: ``make space``'s folder, started the way a Space starts it (``python app.py`` in the
folder, the model named by ``CHAT_E_MODEL``), answers through gradio_client what stock ``generate`` answers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ..conftest import ROOT, free_port, launch_env, run
from .support import TEST_SETTINGS, ChatEServer, make_sensitive_model, serving

PERSONA = "I like cats."


class SpaceServer(ChatEServer):
    """``python app.py`` in a Space folder, configured through the environment only, as on a Space."""

    def __init__(self, space_dir, model, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        self.api_key = None
        flags = [f"--{k}={v}" for k, v in TEST_SETTINGS.items() if k != "do_sample"] + ["--no-do_sample"]
        env = launch_env(
            CHAT_E_MODEL=model,
            # PyTorch, as on a Space: its requirements leave out llama-cpp-python, which compiles at install
            CHAT_E_ARGS=" ".join([*flags, "--threads", "1", "--quantize", "none", "--engine", "torch"]),
            GRADIO_SERVER_NAME="127.0.0.1",
            GRADIO_SERVER_PORT=self.port,
            GRADIO_ANALYTICS_ENABLED="False",
        )
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # its bytecode shows which copy of the packages it ran
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "app.py"], cwd=space_dir, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """The Space folder ``make space`` writes, and a chat model built by the project's script."""
    tmp = tmp_path_factory.mktemp("space")
    run([sys.executable, "scripts/build_space.py", "--output_dir", str(tmp / "space")])
    run([sys.executable, "scripts/make_tiny_blenderbot.py", "--chat", "--output_dir", str(tmp / "chat")])
    model = make_sensitive_model(tmp / "chat", tmp / "model", std=0.5)  # a reply that depends on its input
    return tmp / "space", model


def stock_chat_reply(model_dir, messages) -> str:
    """The oracle: stock transformers on the tokenizer's chat template, greedy, only the new tokens decoded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    settings = {k: v for k, v in TEST_SETTINGS.items()}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_the_space_folder_is_self_contained(space):
    space_dir, _ = space
    names = {p.name for p in space_dir.iterdir()}
    assert {"app.py", "README.md", "requirements.txt", "hf_ext", "chat_e"} <= names
    assert not (space_dir / "hf_ext" / "__pycache__").exists()  # a clean copy: no bytecode carried along


def test_the_space_serves_the_model_named_by_its_variable(space, tmp_path):
    space_dir, model = space
    with serving(SpaceServer(space_dir, model, tmp_path / "space.log")) as (server,):
        client = server.client()
        reply = client.predict("Do you have any pets?", [], "persona", PERSONA, api_name="/chat")
        free = client.predict("Where should I go this summer?", [], "free", "", api_name="/chat")
    messages = [
        {"role": "system", "content": f"your persona: {PERSONA}"},
        {"role": "user", "content": "Do you have any pets?"},
    ]
    assert reply == stock_chat_reply(model, messages) and reply
    assert free == stock_chat_reply(model, [{"role": "user", "content": "Where should I go this summer?"}])
    # the Space ran its own copies of the packages, as it will on a Space with nothing installed
    assert (space_dir / "chat_e" / "__pycache__").is_dir() and (space_dir / "hf_ext" / "__pycache__").is_dir()


def test_the_space_says_which_variable_is_missing():
    proc = subprocess.run([sys.executable, "app/app.py"], cwd=ROOT, env=launch_env(CHAT_E_MODEL=""),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "app.py: set CHAT_E_MODEL to a model directory or a Hub id (a Space variable)."
    )
