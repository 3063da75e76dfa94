#!/usr/bin/env python
"""Write Chat-E's Hugging Face Space as one self-contained folder, ready to push.

    python scripts/build_space.py --output_dir runs/space        (or: make space)

The folder holds ``app/``'s files (``app.py``, the Space's ``README.md`` with its front matter, ``requirements.txt``)
and copies of the ``hf_ext`` and ``chat_e`` packages, which a Space imports from its own root. Push it with
``huggingface-cli upload <you>/chat-e runs/space . --repo-type space`` and set the ``CHAT_E_MODEL`` variable.
The folder is written all-or-nothing: an interrupted build leaves the previous one.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from hf_ext.atomic import atomic_directory

ROOT = Path(__file__).resolve().parents[1]
SPACE_FILES = ("app.py", "README.md", "requirements.txt")
PACKAGES = ("hf_ext", "chat_e")


def build_space(output_dir: str | Path) -> Path:
    output_dir = Path(output_dir)
    with atomic_directory(output_dir, replaced=lambda name: True) as staged:
        for name in SPACE_FILES:
            shutil.copy2(ROOT / "app" / name, staged / name)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, staged / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/space")
    out = build_space(parser.parse_args(argv).output_dir)
    print(
        f"Wrote the Chat-E Space to {out}: push it with huggingface-cli upload <you>/chat-e {out} . --repo-type space"
    )


if __name__ == "__main__":
    main()
