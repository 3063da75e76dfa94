"""The function-level import rule (docs/architecture.md, "Function-level imports"): ruff's PLC0415 refuses an import
inside a function in hf_ext and chat_e, and each allowed one says why on its own line."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hf_ext", "chat_e")
#: a noqa comment naming its codes (PLC0415 among them), and what follows the codes on the comment
NOQA = re.compile(r"#\s*noqa\s*:\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)(?P<rest>.*)$", re.IGNORECASE)


def reasonless_noqas(source: str) -> list[tuple[int, str]]:
    """``(line, comment)`` for each ``# noqa`` naming PLC0415 with no reason after its codes (text in parentheses, or
    any other words)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        match = NOQA.search(token.string)
        if not match or "PLC0415" not in match["codes"].upper().replace(" ", ""):
            continue
        reason = match["rest"].strip().strip("()-:;,# ").strip()
        if not reason:
            found.append((token.start[0], token.string))
    return found


def test_the_check_sees_a_bare_noqa_and_accepts_a_reason():
    assert reasonless_noqas("def f():\n    import x  # noqa: PLC0415\n") == [(2, "# noqa: PLC0415")]
    assert reasonless_noqas("def f():\n    import x  # noqa: PLC0415 ()\n") == [(2, "# noqa: PLC0415 ()")]
    assert reasonless_noqas("def f():\n    import x  # noqa: E501, PLC0415\n") == [(2, "# noqa: E501, PLC0415")]
    assert reasonless_noqas("def f():\n    import x  # noqa: PLC0415 (optional extra: app)\n") == []
    assert reasonless_noqas("def f():\n    import x  # noqa: PLC0415 slow to import\n") == []
    assert reasonless_noqas("def f():\n    import x  # noqa: E501\n") == []


def test_every_function_level_import_says_why():
    bare = [
        f"{path.relative_to(ROOT)}:{line}: {comment}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, comment in reasonless_noqas(path.read_text(encoding="utf-8"))
    ]
    assert not bare, "a function-level import needs its reason after `# noqa: PLC0415`:\n" + "\n".join(bare)


def test_ruff_checks_the_rule_on_the_packages():
    """PLC0415 is selected, and only tests, benchmarks and recipes are exempt (pyproject.toml)."""
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["lint"]
    assert "PLC0415" in lint["select"]
    exempt = {pattern for pattern, codes in lint.get("per-file-ignores", {}).items() if "PLC0415" in codes}
    assert not any(pattern.startswith(PACKAGES) for pattern in exempt), exempt
