"""Imported at start-up by every process the tests launch (``tests/conftest.py`` ``launch_env`` puts this folder on
``PYTHONPATH``): the ``filterwarnings`` of pyproject.toml's ``[tool.pytest.ini_options]``, which pytest applies to its
own process only, so that a deprecation a launched rank hits is an error there too.

``PYTHONWARNINGS`` cannot carry them: there the module field is matched literally against the whole module name
(``error::FutureWarning:transformers`` matches the module ``transformers`` only, never ``transformers.trainer``), so
it cannot be scoped to a library's package. Here the entries are applied as pytest applies its ini entries: the
message and module fields are regular expressions, and a later entry takes precedence over an earlier one.
"""

from __future__ import annotations

import builtins
import warnings
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def parse(entry: str) -> tuple[str, str, type[Warning], str, int]:
    """``action:message:category:module:lineno`` (pytest's format, fields optional) as ``warnings.filterwarnings``
    arguments."""
    action, message, category, module, lineno = (entry.split(":", 4) + [""] * 5)[:5]
    category_class = getattr(builtins, category.strip()) if category.strip() else Warning
    return action.strip(), message, category_class, module.strip(), int(lineno or 0)


def pytest_filters() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the launched ranks keep Python's defaults
        return []
    return tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"].get("filterwarnings", [])


for _entry in pytest_filters():
    warnings.filterwarnings(*parse(_entry))


#: the hooks a launched process's environment can ask for: variable -> the module beside this file that installs it
ENV_HOOKS = {
    "HF_EXT_TEST_SIGNAL_AT": "signal_at",  # the preemption tests' signal at an exact step
    "HF_EXT_TEST_CLOCK": "step_clock",  # benchmarks/bench_elastic.py's milestones
    "CHAT_E_TEST_STOP_AT_PHASE": "stop_at_phase",  # the Train page's walk: a run held in a phase
}


def install_env_hooks() -> None:
    """The hooks of :data:`ENV_HOOKS` this process's environment asks for; called at start-up, and by ``zygote.py``
    in each rank it forks (its environment is the rank's only then)."""
    import importlib
    import os

    for variable, module in ENV_HOOKS.items():
        if os.environ.get(variable):
            importlib.import_module(module).install_from_env()


install_env_hooks()
