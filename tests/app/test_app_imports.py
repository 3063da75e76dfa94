"""What the training recipe imports of Chat-E stays free of Gradio: the UI's extra is for serving only."""

from __future__ import annotations

import subprocess
import sys

from ..conftest import RECIPE, ROOT, launch_env

#: the chat_e modules recipes/blenderbot.py imports (chat_e.engines.local when it loads its outputs)
RECIPE_MODULES = (
    "chat_e.data.samples",
    "chat_e.data.corpora",
    "chat_e.data.dialogue",
    "chat_e.data.lora",
    "chat_e.data.models",
    "chat_e.data.plotting",
)


def imports_gradio(*modules: str) -> bool:
    code = f"import sys; import {', '.join(modules)}; print('gradio' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip() == "True"


def test_the_recipes_chat_e_modules_do_not_import_gradio():
    assert not imports_gradio(*RECIPE_MODULES, "chat_e.engines.local")
    assert imports_gradio("gradio")  # positive control: the probe sees an import
    recipe = RECIPE.read_text()
    assert "from chat_e.data.samples import SAMPLE_CHATS" in recipe and "chat_e.web.ui" not in recipe
    assert {line.split()[1] for line in recipe.splitlines() if line.startswith("from chat_e")} <= set(RECIPE_MODULES)
