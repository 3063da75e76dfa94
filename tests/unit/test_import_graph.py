"""The import graph of hf_ext and chat_e, read from the source (AST): a DAG, and arrows that point one way.

Every import counts, including the ones inside functions: a function-level import that closes a cycle is still a
cycle, only deferred. Relative imports are resolved to module names; ``from pkg import name`` counts as an import of
``pkg.name`` when that is a module, else of ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hf_ext", "chat_e")
FORBIDDEN_FROM_HF_EXT = ("chat_e", "recipes", "benchmarks", "scripts", "tests")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules (of ``known`` or third-party top-level names) that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if candidate in known else base)
    return {name for name in found if name}


def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    edges = {}
    for module, path in files.items():
        targets = set()
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for name in imports_of(module, path, known):
            # importing a.b.c runs a/__init__ and a/b/__init__ first: those are edges too, except the packages
            # this module sits in (Python initializes them before the module itself)
            parts = name.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        targets -= own_packages
        edges[module] = {t for t in targets if t in known and t != module} | {
            t for t in targets if t.split(".")[0] not in PACKAGES
        }
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph restricted to its own modules, or None."""
    internal = {m: {t for t in ts if t in edges} for m, ts in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(internal[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(internal):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walker_sees_function_level_imports_and_cycles(tmp_path):
    # positive control: a cycle closed by an import inside a function is found
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    edges = {
        name: {t for t in imports_of(name, tmp_path / f"{name}.py", {"a", "b"}) if t in ("a", "b")}
        for name in ("a", "b")
    }
    assert edges == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(edges) in (["a", "b", "a"], ["b", "a", "b"])
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_imports_resolve_to_modules():
    known = set(module_files())
    deps = imports_of("hf_ext.trainer", ROOT / "hf_ext" / "trainer.py", known)
    assert {"hf_ext.training_args", "hf_ext.saving.checkpoints", "hf_ext.evaluation.bleu"} <= deps


def test_no_import_cycles():
    assert find_cycle(graph()) is None


def test_hf_ext_imports_nothing_of_the_product_the_recipes_or_the_benchmarks():
    offenders = {
        module: sorted(t for t in targets if t.split(".")[0] in FORBIDDEN_FROM_HF_EXT)
        for module, targets in graph().items()
        if module.split(".")[0] == "hf_ext"
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_hf_ext_needs_no_product_dependency():
    # chatterbot-corpus, matplotlib and gradio are Chat-E's extras, not the Trainer extension's
    product_only = {"chatterbot_corpus", "matplotlib", "gradio", "gradio_client", "chitchat_dataset"}
    used = {
        t.split(".")[0] for module, targets in graph().items() if module.split(".")[0] == "hf_ext" for t in targets
    }
    assert used & product_only == set()


# --- chat_e in layers -------------------------------------------------------------------------------------------------

#: chat_e's layers (its sub-packages), each with the layers it may import; ``server`` and ``__main__`` compose them
CHAT_E_MAY_IMPORT = {
    "data": set(),
    "engines": {"data"},
    "feedback": {"data"},
    "web": {"data", "engines", "feedback"},
    "http": {"data", "engines"},
    "training": {"data", "engines"},
    "studio": {"data", "engines", "feedback", "training", "web"},
}
CHAT_E_COMPOSITION = {"chat_e", "chat_e.__main__", "chat_e.server"}
#: the serving and storage stacks, which the model-side layers (data, engines, training) never import
SERVING_STACK = {"gradio", "gradio_client", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg"}


def chat_e_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "chat_e" and len(parts) > 1 and parts[1] in CHAT_E_MAY_IMPORT else None


def test_every_chat_e_module_is_in_a_layer_or_composes_them():
    modules = {m for m in module_files() if m.split(".")[0] == "chat_e"}
    assert {m for m in modules if chat_e_layer(m) is None} == CHAT_E_COMPOSITION


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import of ``edges`` that breaks chat_e's layers, in words."""
    wrong = []
    for module, targets in edges.items():
        layer = chat_e_layer(module)
        if layer is None:
            continue
        for target in sorted(targets):
            other = chat_e_layer(target)
            if target.split(".")[0] == "chat_e" and other is None and target != "chat_e":
                wrong.append(f"{module} imports {target}, which composes the layers")
            elif other not in (None, layer) and other not in CHAT_E_MAY_IMPORT[layer]:
                wrong.append(f"{module} ({layer}) imports {target} ({other})")
            elif layer in ("data", "engines", "training") and target.split(".")[0] in SERVING_STACK:
                wrong.append(f"{module} ({layer}) imports {target.split('.')[0]}")
    return wrong


def test_chat_e_layers_import_downward_only():
    """data and engines import no Gradio, FastAPI or SQLAlchemy; web and http do not import each other; feedback
    imports neither; nothing in a layer imports what composes the layers."""
    assert layer_violations(graph()) == []


def test_the_layer_rules_catch_a_sideways_import():
    real = graph()
    fake = {
        **real,
        "chat_e.web.ui": real["chat_e.web.ui"] | {"chat_e.http.guard", "sqlalchemy"},
        "chat_e.engines.local": real["chat_e.engines.local"] | {"gradio"},
        "chat_e.feedback.store": real["chat_e.feedback.store"] | {"chat_e.server"},
    }
    assert set(layer_violations(fake)) == {
        "chat_e.web.ui (web) imports chat_e.http.guard (http)",
        "chat_e.engines.local (engines) imports gradio",
        "chat_e.feedback.store imports chat_e.server, which composes the layers",
    }


# --- the package-level DAG, and docs/architecture.md written from it -------------------------------------------------

#: the building blocks every feature may use
FOUNDATIONS = {"sizes", "errors", "atomic", "batching", "ranks", "gather", "model_info", "schedule", "runtime", "lazy",
               "exit_status"}  # fmt: skip
#: one folder (or module) per feature
FEATURES = {"memory", "peft", "fsdp", "deepspeed", "saving", "evaluation", "packing", "loss", "preemption", "ray"}
#: the only imports from one feature into another, each with its reason
FEATURE_EDGES = {
    ("deepspeed", "memory"): 'the resolver asks the planner to fill an "auto" stage, offload or micro-batch',
    ("evaluation", "memory"): "a gathered ZeRO-3 eval needs the plan's headroom for its copy",
    ("saving", "peft"): "a final save of a PEFT model writes the adapter (and checkpoints its trainable state)",
    ("saving", "fsdp"): "an FSDP2 save writes in the dtype the FSDP mixed-precision policy computes in",
    ("packing", "loss"): "padding-free leaves the loss to a model whose loss adds router terms to the cross-entropy",
    ("ray", "saving"): "a Ray checkpoint is hf-ext's checkpoint directory, reported rank by rank and restored by name",
}
#: the settings (every hf-ext setting a field; YAML + flags), and what composes everything
SETTINGS = {"training_args", "config_args"}
COMPOSITION = {"trainer", "trl", "cli"}
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- import-graph: begin (written by tests/unit/test_import_graph.py) -->", "<!-- import-graph: end -->"


#: the product's units: Chat-E, and its training (chat_e.training's trainings and its eval; its ``launch`` and
#: ``eval_cli``, which name them as strings or import them when run, and ``progress``, the progress file a run writes
#: and the Train page reads, are ``chat-e``'s), which uses hf-ext's trainer and settings as any user's script does
PRODUCT = {"chat_e", "chat_e.training"}


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["chat_e", "training"] and len(parts) > 2 and parts[2] not in ("launch", "eval_cli", "progress"):
        return "chat_e.training"
    return parts[1] if parts[0] == "hf_ext" and len(parts) > 1 else parts[0]


def unit_graph() -> dict[str, set[str]]:
    """hf_ext's top-level modules and packages, chat_e's training, and the rest of chat_e as one unit: who imports
    whom."""
    units: dict[str, set[str]] = {}
    for module, targets in graph().items():
        if module == "hf_ext":
            continue  # its lazy exports name modules as strings
        unit = unit_of(module)
        deps = {unit_of(t) for t in targets if t.split(".")[0] in PACKAGES and t != "hf_ext"}
        units.setdefault(unit, set()).update(deps - {unit})
    return units


def test_every_unit_has_a_place_in_the_layers():
    assert set(unit_graph()) == FOUNDATIONS | FEATURES | SETTINGS | COMPOSITION | PRODUCT


def test_the_packages_form_a_dag_where_features_never_import_settings_or_each_other_sideways():
    units = unit_graph()
    assert find_cycle(units) is None
    wrong = []
    for unit, deps in units.items():
        for dep in deps:
            if unit in FOUNDATIONS and dep not in FOUNDATIONS:
                wrong.append(f"foundation {unit} imports {dep}")
            if unit in FEATURES | {"chat_e"} and dep in SETTINGS | COMPOSITION:
                wrong.append(f"{unit} imports the settings or the trainer ({dep})")
            if unit in FEATURES and dep in FEATURES and (unit, dep) not in FEATURE_EDGES:
                wrong.append(f"feature {unit} imports feature {dep} sideways")
    assert wrong == []
    unused = [edge for edge in FEATURE_EDGES if edge[1] not in units[edge[0]]]
    assert unused == []  # a listed reason with no import behind it has gone stale


def _depths(units: dict[str, set[str]]) -> dict[str, int]:
    depth: dict[str, int] = {}

    def of(unit: str) -> int:
        if unit not in depth:
            depth[unit] = 1 + max((of(d) for d in units[unit]), default=-1)
        return depth[unit]

    for unit in units:
        of(unit)
    return depth


def _summary(unit: str) -> str:
    path = ROOT.joinpath(*unit.split(".")) if unit in PRODUCT else ROOT / "hf_ext" / unit
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(": ")[0].split(". ")[0].rstrip(".").replace("``", "`")


def architecture_block() -> str:
    """The import graph as docs/architecture.md shows it: one row per unit, lowest layer first."""
    units = unit_graph()
    depth = _depths(units)
    kinds = [("foundation", FOUNDATIONS), ("feature", FEATURES), ("settings", SETTINGS), ("composition", COMPOSITION)]
    rows = ["| unit | kind | layer | imports (hf-ext) | what it owns |", "|---|---|---:|---|---|"]
    for unit in sorted(units, key=lambda u: (depth[u], u)):
        kind = next((name for name, members in kinds if unit in members), "product")
        name = (
            f"`{unit.replace('.', '/')}/`"
            if unit in PRODUCT
            else f"`hf_ext/{unit}{'/' if (ROOT / 'hf_ext' / unit).is_dir() else '.py'}`"
        )
        deps = ", ".join(sorted(units[unit])) or "—"
        rows.append(f"| {name} | {kind} | {depth[unit]} | {deps} | {_summary(unit)} |")
    edges = "\n".join(f"* `{a}` → `{b}`: {why}" for (a, b), why in sorted(FEATURE_EDGES.items()))
    return "\n".join([BEGIN, "", *rows, "", "The only imports between features:", "", edges, "", END])


def test_architecture_doc_shows_the_import_graph_of_the_code():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lost its import-graph markers"
    shown = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert shown == architecture_block(), "docs/architecture.md is stale: run python -m tests.unit.test_import_graph"


if __name__ == "__main__":  # rewrite docs/architecture.md's import graph from the code
    import sys

    sys.path.insert(0, str(ROOT))
    from hf_ext.atomic import write_text_atomically

    text = DOC.read_text()
    write_text_atomically(DOC, text[: text.index(BEGIN)] + architecture_block() + text[text.index(END) + len(END) :])
    print(f"wrote the import graph into {DOC}")
