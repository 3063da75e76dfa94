"""``pip wheel .`` builds what ``pip install`` puts on a machine: the ``hf_ext`` and ``chat_e`` packages and their
metadata, and no top-level ``app``, ``scripts``, ``recipes``, ``benchmarks`` or ``tests``."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from ..conftest import ROOT


def test_the_wheel_installs_two_top_level_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         "--quiet"],
        check=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("hf_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"hf_ext", "chat_e"}
    assert "hf_ext/deepspeed/presets/zero3.json" in names
    # the feedback database's schema migrations (Alembic reads them from the installed package)
    assert {
        "chat_e/feedback/migrations/env.py",
        "chat_e/feedback/migrations/script.py.mako",
        "chat_e/feedback/migrations/versions/0001_initial.py",
    } <= set(names)
    # the recipes' training, installed: what chat-e train runs without a clone
    assert {"chat_e/training/dialogue.py", "chat_e/training/preference.py", "chat_e/training/launch.py"} <= set(names)
