"""The deprecation filters of pyproject.toml: the processes the tests launch apply the same ones, and the one
library-to-library deprecation ignored there (peft reading ``is_gradient_checkpointing``) hides no read of hf-ext's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from ..conftest import LAUNCHED_SITE, ROOT, launch_env

#: a read of the deprecated checkpointing names, wherever it comes from, is an error inside this context
DEPRECATED_CHECKPOINTING = r"`(is_gradient_checkpointing|gradient_checkpointing_(enable|disable))`"


def test_launched_processes_apply_the_pytest_filters(pytestconfig):
    """A launched process loads tests/launched/sitecustomize.py, which installs pyproject's entries as pytest does."""
    code = (
        "import warnings, json; print(json.dumps([[f[0], getattr(f[1], 'pattern', ''), f[2].__name__, "
        "getattr(f[3], 'pattern', '')] for f in warnings.filters]))"
    )
    env = launch_env()
    env.pop("PYTHONWARNINGS", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    installed = json.loads(out.stdout)
    entries = pytestconfig.getini("filterwarnings")
    assert entries, "pyproject.toml has no filterwarnings"
    sys.path.insert(0, str(LAUNCHED_SITE))
    try:
        from sitecustomize import parse
    finally:
        sys.path.remove(str(LAUNCHED_SITE))
    for entry in entries:
        action, message, category, module, _ = parse(entry)
        assert [action, message, category.__name__, module] in installed, f"{entry!r} is not applied in launched ranks"
    # later entries take precedence, as in pytest: the last one is first in the launched process's list
    last = parse(entries[-1])
    assert installed[0] == [last[0], last[1], last[2].__name__, last[3]]


def test_library_deprecations_raise_in_a_launched_process():
    code = "import warnings; warnings.warn_explicit('old', FutureWarning, 'x.py', 1, module='transformers.trainer')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode != 0 and "FutureWarning: old" in proc.stderr
    other = code.replace("transformers.trainer", "transformers_like")  # another package of a similar name: a warning
    assert subprocess.run([sys.executable, "-c", other], cwd=ROOT, env=launch_env()).returncode == 0


@pytest.mark.skipif(os.environ.get("PYTHONWARNINGS"), reason="PYTHONWARNINGS overrides the filters under test")
def test_hf_ext_reads_the_checkpointing_switch_by_its_new_name():
    """The pyproject entry ignoring ``is_gradient_checkpointing`` is for peft's read; hf-ext's own reads (the memory
    probe switches checkpointing on and off and reads whether it was on) use the new names."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ext.memory.probe import probe_activations

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=DEPRECATED_CHECKPOINTING, category=FutureWarning)
        probe_activations(model, seq_len=8, batches=(1,), checkpointing=True)
        model.activation_checkpointing_enable()
        probe_activations(model, seq_len=8, batches=(1,), checkpointing=False)
    assert model.is_activation_checkpointing  # restored
