"""What the training recipe imports of Chat-E stays free of Gradio: the UI's extra is for serving only."""

from __future__ import annotations

import subprocess
import sys

from ..conftest import RECIPE, ROOT, launch_env

#: Chat-E's training, which the recipes run (chat_e.engines.local when it loads its outputs)
TRAINING_MODULES = ("chat_e.training.dialogue", "chat_e.training.preference", "chat_e.training.launch")


def imports_gradio(*modules: str) -> bool:
    code = f"import sys; import {', '.join(modules)}; print('gradio' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip() == "True"


def test_the_recipes_chat_e_modules_do_not_import_gradio():
    assert not imports_gradio(*TRAINING_MODULES, "chat_e.engines.local")
    assert imports_gradio("gradio")  # positive control: the probe sees an import
    recipe = RECIPE.read_text()
    assert {line.split()[1] for line in recipe.splitlines() if line.startswith("from chat_e")} == {
        "chat_e.training.dialogue"
    }
