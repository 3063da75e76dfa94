"""Nothing in hf_ext or chat_e unpickles a file: read from the source (AST), every import and call counts.

Refused: ``torch.load`` without ``weights_only=True`` written out (a missing keyword, a variable or ``**kwargs`` count
as unsafe), ``pickle``'s ``load``/``loads``/``Unpickler`` (and ``_pickle``'s), any use of ``dill``, ``joblib.load``,
``pandas.read_pickle`` and ``numpy.load`` with ``allow_pickle`` other than ``False``. Aliases (``import torch as t``,
``from pickle import loads as l``) and function-level imports are resolved.

Also here: hf-ext's PEFT trainable-state files (safetensors + JSON) round-trip without pickling.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

from hf_ext import peft

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hf_ext", "chat_e")

#: dotted names that unpickle whatever their arguments
ALWAYS_UNSAFE = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "joblib.load", "pandas.read_pickle",
}  # fmt: skip
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
NUMPY_LOADS = {"numpy.load"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import of the module (function-level ones too)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for every unpickling call or reference in ``source``."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "dill" for m in modules):
                found.append(f"{filename}:{node.lineno}: imports dill")
            continue
        if isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Load):
            name = _dotted(node, aliases)
            if name in ALWAYS_UNSAFE:
                found.append(f"{filename}:{node.lineno}: {name}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        spread = any(k.arg is None for k in node.keywords)
        if name in TORCH_LOADS and (spread or not _is_constant(_keyword(node, "weights_only"), True)):
            found.append(f"{filename}:{node.lineno}: {name} without weights_only=True")
        allow_pickle = _keyword(node, "allow_pickle")  # numpy's default is False
        if name in NUMPY_LOADS and (spread or (allow_pickle is not None and not _is_constant(allow_pickle, False))):
            found.append(f"{filename}:{node.lineno}: {name} with allow_pickle")
    return sorted(set(found))


def test_no_unpickling_in_hf_ext_and_chat_e():
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 20, files  # the walk found the packages
    found = [line for path in files for line in unsafe_loads(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "Unpickling in the shipped code (use safetensors/JSON, or weights_only=True):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load('f')",
        "import torch\ntorch.load('f', weights_only=False)",
        "import torch\ntorch.load('f', map_location='cpu', weights_only=flag)",
        "import torch\ntorch.load('f', **kwargs)",
        "import torch as th\nth.load('f')",
        "from torch import load\nload('f')",
        "from torch import load as tl\ntl('f', weights_only=None)",
        "import torch.serialization\ntorch.serialization.load('f')",
        "def f():\n    import torch\n    return torch.load('f', mmap=True)",
        "import pickle\npickle.load(open('f', 'rb'))",
        "import pickle\npickle.loads(b'')",
        "import pickle\nclass U(pickle.Unpickler):\n    pass",
        "from pickle import loads as l\nl(b'')",
        "import _pickle\n_pickle.loads(b'')",
        "import dill",
        "from dill import loads",
        "import joblib\njoblib.load('f')",
        "from joblib import load\nload('f')",
        "import pandas as pd\npd.read_pickle('f')",
        "import numpy as np\nnp.load('f', allow_pickle=True)",
        "import numpy\nnumpy.load('f', allow_pickle=flag)",
    ],
)
def test_detector_refuses(source):
    assert unsafe_loads(source), source


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load('f', weights_only=True)",
        "import torch\ntorch.load('f', map_location='cpu', mmap=True, weights_only=True)",
        "import torch\ntorch.save({}, 'f')",
        "import pickle\npickle.dumps({})",
        "import numpy as np\nnp.load('f')",
        "import numpy as np\nnp.load('f', allow_pickle=False)",
        "from safetensors.torch import load_file\nload_file('f')",
        "import json\njson.load(open('f'))",
        "def load(path):\n    return path\nload('f')",
    ],
)
def test_detector_accepts(source):
    assert not unsafe_loads(source), source


# ---- the PEFT trainable state: tensors in safetensors, the rest in JSON ----------------------------------------------


class Payload:
    """Stands for any object a pickled file can carry."""


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    params = {
        "base_model.model.q_proj.lora_A.default.weight": (4, 8),
        "base_model.model.q_proj.lora_B.default.weight": (8, 4),
        "base_model.model.layer_norm.modules_to_save.default.weight": (8,),
    }
    return {
        "params": {
            name: {key: torch.randn(shape, generator=g) for key in ("param", "exp_avg", "exp_avg_sq")}
            for name, shape in params.items()
        },
        "optimizer_step": 4,
        "scheduler_class": "ReduceLROnPlateau",
        "scheduler": {
            "best": math.inf,
            "mode": "min",
            "cooldown_counter": None,
            "_last_lr": [1e-3, 3e-4],
            "lr_lambdas": [{}],
            "counts": torch.tensor([1, 2]),
        },
        "global_step": 4,
        "world_size": 2,
    }


def _assert_same(expected, actual, where="state"):
    if torch.is_tensor(expected):
        assert torch.is_tensor(actual) and expected.dtype == actual.dtype and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), where
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, list) and len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            _assert_same(e, a, f"{where}.{i}")
    else:
        assert type(expected) is type(actual) and expected == actual, (where, expected, actual)


def test_trainable_state_round_trips_through_safetensors_and_json(tmp_path):
    state = _state()
    peft.write_trainable_state(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [peft.TRAINABLE_STATE_META, peft.TRAINABLE_STATE_NAME]
    assert peft.is_trainable_state_checkpoint(tmp_path)
    json.loads((tmp_path / peft.TRAINABLE_STATE_META).read_text())  # plain JSON
    loaded = peft.read_trainable_state(tmp_path)
    assert loaded.pop("format") == peft.TRAINABLE_STATE_FORMAT
    _assert_same(state, loaded)


def test_trainable_state_refuses_what_json_cannot_hold(tmp_path):
    state = _state()
    state["scheduler"]["fn"] = object()
    with pytest.raises(TypeError, match=r"scheduler\.fn is a object"):
        peft.write_trainable_state(state, tmp_path)


def test_trainable_state_of_an_older_hf_ext_is_read_without_unpickling_objects(tmp_path):
    legacy = _state() | {"format": 1}
    torch.save(legacy, tmp_path / peft.LEGACY_TRAINABLE_STATE_NAME)
    assert peft.is_trainable_state_checkpoint(tmp_path)
    _assert_same(legacy, peft.read_trainable_state(tmp_path))

    torch.save({"params": {}, "payload": Payload()}, tmp_path / peft.LEGACY_TRAINABLE_STATE_NAME)
    with pytest.raises(Exception, match="Weights only load failed"):
        peft.read_trainable_state(tmp_path)


def test_trainable_state_of_another_format_is_refused(tmp_path):
    peft.write_trainable_state(_state(), tmp_path)
    meta = json.loads((tmp_path / peft.TRAINABLE_STATE_META).read_text())
    (tmp_path / peft.TRAINABLE_STATE_META).write_text(json.dumps(meta | {"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        peft.read_trainable_state(tmp_path)
