"""The docs hold together: every relative link in README.md and docs/*.md reaches a file (and a heading, for an
anchor into a Markdown file), every test or benchmark file the docs and the code name exists, README.md stays short,
docs/README.md lists every page, and each feature page opens with a usage example. Plain text parsing: no network,
no Markdown renderer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
INDEX = DOCS / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
FEATURE_PAGES = [
    "deepspeed",
    "fsdp",
    "memory",
    "saving",
    "evaluation",
    "padding-free",
    "trl",
    "chat-e",
    "feedback",
    "multinode",
    "cluster",
]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def headings(text: str) -> list[tuple[int, str]]:
    """(line number, heading text) of every ATX heading outside fenced code blocks."""
    found = []
    for number, line in prose_lines(text):
        match = HEADING.match(line)
        if match:
            found.append((number, match.group(2)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link syntax reduced to its text, lowercase, punctuation except '-' and '_'
    dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = "".join(ch for ch in text if ch in "-_ " or ch.isalnum())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of ``path`` (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for _, heading in headings(path.read_text(encoding="utf-8")):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative Markdown link or image in ``path``, code excluded."""
    links = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not SCHEME.match(target):
                links.append((number, target))
    return links


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading with the anchor #{anchor} in {resolved.relative_to(ROOT)}")
    return problems


def test_slug_follows_github():
    assert slug("Which engine?") == "which-engine"
    assert slug("Generation eval under ZeRO-3") == "generation-eval-under-zero-3"
    assert slug("Saving, checkpoints and PEFT") == "saving-checkpoints-and-peft"
    assert slug("The `make_smollm2.py` script") == "the-make_smollm2py-script"
    assert slug("Engines × precision: DDP") == "engines--precision-ddp"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Real heading\n\n[ok](#real-heading) [gone](missing.md) [bad anchor](page.md#nowhere)\n"
        "```\n[in code](ignored.md)\n```\n`[inline](ignored.md)` [web](https://example.com/x.md)\n",
        encoding="utf-8",
    )
    links = relative_links(page)
    assert [target for _, target in links] == ["#real-heading", "missing.md", "page.md#nowhere"]
    assert anchors(page) == {"title", "real-heading"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to a page under docs/"


def test_docs_index_lists_every_page():
    listed = set()
    for _, target in relative_links(INDEX):
        file_part = target.partition("#")[0]
        resolved = (DOCS / file_part).resolve()
        if resolved.suffix == ".md" and resolved.parent == DOCS.resolve():
            listed.add(resolved.name)
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert not listed - pages - {"README.md"}, f"listed in docs/README.md but missing: {sorted(listed - pages)}"
    assert not pages - listed, f"docs pages not listed in docs/README.md: {sorted(pages - listed)}"


@pytest.mark.parametrize("name", FEATURE_PAGES)
def test_feature_page_opens_with_an_example(name):
    text = (DOCS / f"{name}.md").read_text(encoding="utf-8")
    heading_lines = [number for number, _ in headings(text)]
    fences = [number for number, line in enumerate(text.splitlines(), 1) if FENCE.match(line)]
    assert len(heading_lines) >= 2, f"docs/{name}.md has fewer than two headings"
    assert fences and fences[0] < heading_lines[1], (
        f"docs/{name}.md: the first code block must come before the second heading (line {heading_lines[1]})"
    )


#: a file of the suite or the benchmarks named in prose, such as ``benchmarks/bench_api.py``
NAMED_FILE = re.compile(r"(?<![\w/.])((?:tests|benchmarks)/[\w/]+\.py)")
NAMING = ["README.md", "Makefile", "docs/*.md", "hf_ext/**/*.py", "chat_e/**/*.py", "recipes/*.py", "scripts/*.py",
          "tests/**/*.py", "benchmarks/**/*.py"]  # fmt: skip


def test_every_named_test_or_benchmark_file_exists():
    """A docstring or a page that points at a test file renamed or removed since sends its reader nowhere."""
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {name}"
        for pattern in NAMING
        for path in sorted(ROOT.glob(pattern))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for name in NAMED_FILE.findall(line)
        if not (ROOT / name).exists()
    ]
    assert missing == []
