"""Chat-E as a Hugging Face Space: ``python app.py`` serves the model named by ``CHAT_E_MODEL``.

``CHAT_E_MODEL`` is a model directory (a recipe's output, an export, an adapter directory) or a Hub id, downloaded
with ``huggingface_hub.snapshot_download`` (``HF_TOKEN`` for a private one). The Space's own variables choose the
rest: ``GRADIO_SERVER_NAME``/``GRADIO_SERVER_PORT`` (Spaces set them), ``CHAT_E_AUTH`` (``user:password``) and
``CHAT_E_API_KEY``, and ``CHAT_E_ARGS`` for any other ``chat-e`` flag (``--max_new_tokens 40 --concurrency 1``).

This folder is not a package and is never installed: it runs beside an installed ``hf-ext[app]`` (a clone with
``make setup``), or as the self-contained folder ``make space`` writes (these files, the ``hf_ext`` and ``chat_e``
packages and the pinned requirements), ready to push to a Space.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from huggingface_hub import snapshot_download

MODEL_ENV = "CHAT_E_MODEL"
ARGS_ENV = "CHAT_E_ARGS"


def local_model(name: str) -> str:
    """``name`` when it is a directory, else the local snapshot of the Hub repository ``name``."""
    if Path(name).is_dir():
        return name
    return snapshot_download(name)


def command_line(environ=os.environ) -> list[str]:
    """The ``chat-e`` arguments this Space runs with."""
    model = environ.get(MODEL_ENV)
    if not model:
        raise SystemExit(f"app.py: set {MODEL_ENV} to a model directory or a Hub id (a Space variable).")
    return [
        "--model",
        local_model(model),
        "--host",
        environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
        "--port",
        environ.get("GRADIO_SERVER_PORT", "7860"),
        *shlex.split(environ.get(ARGS_ENV, "")),
    ]


if __name__ == "__main__":
    from chat_e.__main__ import main

    sys.exit(main(command_line()))
