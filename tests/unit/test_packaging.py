"""What ``pip install .`` installs: the packages ``hf_ext`` and ``chat_e`` only (no top-level ``app`` to collide with
anyone's), the extension's own dependencies, and the product's behind extras."""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import find_packages

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_installs_two_top_level_packages():
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(where=str(ROOT), include=find["include"])
    assert {p.split(".")[0] for p in packages} == {"hf_ext", "chat_e"}
    assert {"hf_ext.deepspeed", "hf_ext.memory", "hf_ext.saving", "hf_ext.evaluation", "hf_ext.cli"} <= set(packages)


def test_the_extension_does_not_depend_on_the_product():
    core = requirement_names(PYPROJECT["project"]["dependencies"])
    assert not core & {"chatterbot-corpus", "matplotlib", "gradio", "gradio_client"}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"chatterbot-corpus", "matplotlib"} <= requirement_names(extras["chat"])
    assert {"gradio", "gradio_client"} <= requirement_names(extras["app"])


def test_console_scripts_keep_their_names():
    assert PYPROJECT["project"]["scripts"] == {"hf-ext": "hf_ext.cli:main", "chat-e": "chat_e.__main__:main"}


def test_presets_ship_with_the_package():
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["hf_ext"]
    shipped = {p.name for pattern in data for p in (ROOT / "hf_ext").glob(pattern)}
    assert {"zero1.json", "zero2.json", "zero3.json", "zero3_offload.json"} <= shipped


def test_the_space_requires_what_the_package_and_its_app_extras_pin():
    lines = (ROOT / "app" / "requirements.txt").read_text().splitlines()
    space = [line for line in lines if line and not line.startswith("#")]
    extras = PYPROJECT["project"]["optional-dependencies"]
    wanted = PYPROJECT["project"]["dependencies"] + [
        r for extra in ("chat", "app") for r in extras[extra] if not r.startswith("hf-ext")
    ]
    assert sorted(space) == sorted(wanted)


def test_the_space_front_matter_runs_app_py_on_the_pinned_gradio():
    import yaml
    from packaging.specifiers import SpecifierSet

    text = (ROOT / "app" / "README.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert (front["sdk"], front["app_file"]) == ("gradio", "app.py")
    assert (ROOT / "app" / front["app_file"]).is_file()
    gradio = next(r for r in PYPROJECT["project"]["optional-dependencies"]["app"] if r.startswith("gradio>"))
    assert front["sdk_version"] in SpecifierSet(gradio.removeprefix("gradio"))
    assert not (ROOT / "app" / "__init__.py").exists()  # a folder, never a package named app
