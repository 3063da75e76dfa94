"""``ruff format`` lays out all of hf_ext and chat_e except tables: a ``# fmt: skip`` ends only a module- or
class-level literal (a dict, list, tuple or set over several lines), and docs/architecture.md says how many there
are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "  # fmt: skip"


def skips() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for package in ("hf_ext", "chat_e"):
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line.endswith(MARK)]
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    return found


def table_ends(path: Path) -> set[int]:
    """The last lines of the module- and class-level assignments of a literal over several lines."""
    tree = ast.parse(path.read_text())
    tops = [*tree.body, *(n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body)]
    literals = (ast.Dict, ast.List, ast.Tuple, ast.Set)
    return {
        node.end_lineno
        for node in tops
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, literals)
        and node.end_lineno > node.lineno
    }


def test_fmt_skip_marks_tables_only():
    stray = {
        path: sorted(set(lines) - table_ends(ROOT / path))
        for path, lines in skips().items()
        if set(lines) - table_ends(ROOT / path)
    }
    assert stray == {}, "a `# fmt: skip` outside a table: drop it and run ruff format"


def test_architecture_doc_counts_them():
    counted = re.search(r"`# fmt: skip` on (\d+) tables", (ROOT / "docs" / "architecture.md").read_text())
    assert counted, "docs/architecture.md no longer counts the tables kept from ruff format"
    assert int(counted[1]) == sum(len(lines) for lines in skips().values())
