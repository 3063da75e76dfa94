"""Every third-party module the project imports comes from a distribution pyproject.toml declares, in the part of it
that installs the importing code: the core dependencies for ``hf_ext`` (and its ``trl`` and ``ray`` extras for the
modules that run under them), the ``chat`` and ``app`` extras for Chat-E, the recipes and the scripts, ``dev`` for the
suite and the benchmarks. A module that is only there because another package happens to depend on it breaks the day
that package drops it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
#: the project's own top-level names (its packages, the test helpers ``tests/launched`` puts on the path)
OWN = {"hf_ext", "chat_e", "recipes", "scripts", "benchmarks", "tests", "app", "signal_at", "step_clock",
       "stop_at_phase", "sitecustomize", "zygote", "ranks"}  # fmt: skip
#: folder -> the extras that install what it imports ("" is the core dependencies)
INSTALLED_WITH = {
    "hf_ext": ("", "trl", "ray", "gguf"),
    "chat_e": ("", "chat", "app", "gguf"),
    "app": ("", "chat", "app"),
    "recipes": ("", "chat", "app"),
    "scripts": ("", "chat", "app"),
    "benchmarks": ("", "dev", "gguf"),
    "tests": ("", "dev", "gguf"),
}
#: imported only when a user asks for that integration, inside the function that needs it; not a dependency
OPTIONAL = {"trackio": "hf_ext/evaluation/bleu.py, when report_to names trackio"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...]) -> set[str]:
    """The distributions those extras of pyproject.toml install, following ``hf-ext[...]`` inside them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    found, todo, seen = set(), list(extras), set()
    while todo:
        group = todo.pop()
        if group in seen:
            continue
        seen.add(group)
        for line in groups[group]:
            requirement = Requirement(line)
            if normalized(requirement.name) == "hf-ext":
                todo.extend(requirement.extras)
            else:
                found.add(normalized(requirement.name))
    return found


def imported(folder: str) -> dict[str, str]:
    """Top-level module -> the first file of ``folder`` that imports it (absolute imports only)."""
    modules = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                modules.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return modules


def test_every_third_party_import_is_declared_where_its_code_is_installed():
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    for folder, extras in INSTALLED_WITH.items():
        allowed = declared(extras)
        for module, where in imported(folder).items():
            if module in sys.stdlib_module_names or module in OWN or module in OPTIONAL:
                continue
            distributions = {normalized(d) for d in providers.get(module, [])}
            if not distributions & allowed:
                undeclared.append(f"{where}: {module} ({', '.join(sorted(distributions)) or 'not installed'})")
    assert undeclared == [], "declare these in pyproject.toml:\n" + "\n".join(undeclared)
