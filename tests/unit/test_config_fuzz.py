"""Fuzzing config handling: seeded mutations of the vendored real-world corpus (tests/data/deepspeed_configs) run
through ``doctor`` (deferred, problems returned) and ``resolve`` (everything filled, problems raised) in-process.

Mutations: type swaps, key typos at every depth, deletions, duplicated keys, wrong encodings and bytes, absurd
numbers, deprecated keys next to their replacements, deep nesting, and combinations. Whatever the input:

* no exception escapes (``resolve`` may raise :class:`DeepSpeedConfigError` only);
* every refusal names a key (or the file) and carries a fix; a fix never repeats an injected invalid value, and a
  fix given as TrainingArguments values works: with them the same key is no longer reported;
* every accepted config is parsed by DeepSpeed's own ``DeepSpeedConfig`` and section models, holds no ``"auto"``, and
  each value in a section DeepSpeed models is exactly what DeepSpeed reads (so no string boolean and no float in an
  integer field survives).

The default run has ``FUZZ_CASES`` cases (seed ``FUZZ_SEED``); ``HF_EXT_FUZZ_CASES=20000 pytest
tests/unit/test_config_fuzz.py`` runs a longer one, ``HF_EXT_FUZZ_SEED`` another sequence.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from hf_ext import DeepSpeedConfigError, explain_deepspeed_config
from hf_ext.deepspeed.resolve import Hardware

from ..conftest import CORPUS, walk
from ..ds_support import deepspeed_accepts, make_args

FUZZ_CASES = int(os.environ.get("HF_EXT_FUZZ_CASES", "520"))
FUZZ_SEED = int(os.environ.get("HF_EXT_FUZZ_SEED", "20261124"))
HARDWARE = Hardware("cuda", fp16=True, bf16=True)  # the same outcome on any machine...
BUDGET = {"memory_per_device": "80GB"}  # ...and a fixed budget for the planner ("auto" stages are injected too)
SOURCES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".json", ".yaml", ".yml") and p.name != "EXPECTED.json")

#: Absurd values the mutations inject. The ones in NEVER_IN_FIX are invalid for every key a fix could name (a
#: learning rate of 1e30 is absurd but legal), so a fix must never propose them back.
INVALID = [1e30, -1, -0.5, 0.5, 2**64, float("nan"), float("inf"), "maybe", "three", "fp17"]
NEVER_IN_FIX = ["NaN", "Infinity", "inf", "-1", "-0.5", "maybe", "three", "fp17"]
SWAPS = [True, False, "true", "yes", "off", "abc", 0, 1, 7, 1.5, None, [], {}, [1, 2], "auto", " auto ", "1e9"]
LEGACY_PAIRS = [
    ("zero_optimization", "cpu_offload", True, "offload_optimizer", {"device": "cpu"}),
    ("zero_optimization", "cpu_offload_param", True, "offload_param", {"device": "cpu"}),
    ("zero_optimization", "stage3_gather_fp16_weights_on_model_save", False,
     "stage3_gather_16bit_weights_on_model_save", True),
    ("", "bfloat16", {"enabled": True}, "bf16", {"enabled": False}),
    ("", "reduce_bucket_size", 1000, "zero_optimization", {"stage": 2, "reduce_bucket_size": 2000}),
]  # fmt: skip


@dataclass
class Case:
    """One generated input: a dict, or the bytes of a file named ``name``, and what was injected."""

    label: str
    name: str = "config.json"
    config: dict | None = None
    data: bytes | None = None
    injected: list = field(default_factory=list)
    world: int = 1


def _paths(node, prefix=()):
    """Every (path, value) of a nested dict, at every depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key), value
            yield from _paths(value, (*prefix, key))


def _parent(config: dict, path: tuple) -> dict:
    node = config
    for part in path[:-1]:
        node = node[part]
    return node


def _typo(rng: random.Random, key: str) -> str:
    key = str(key)
    words = key.split("_")
    kinds = ["swap", "drop", "double", "case"] + (["words"] if len(words) > 1 else [])
    kind = rng.choice(kinds)
    i = rng.randrange(max(1, len(key) - 1))
    if kind == "swap" and len(key) > 1:
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    if kind == "drop" and len(key) > 1:
        return key[:i] + key[i + 1 :]
    if kind == "words":
        return "_".join(reversed(words))
    if kind == "case":
        return key.upper()
    return key[:i] + key[i] + key[i:]


def mutate(rng: random.Random, config: dict, case: Case) -> dict:
    """One structural mutation of ``config`` (in place), recorded in ``case``."""
    paths = list(_paths(config))
    kind = rng.choice(["swap", "typo", "delete", "absurd", "legacy", "nest"] if paths else ["legacy"])
    case.label += f"+{kind}"
    if kind == "legacy":
        parent_key, old, old_value, new, new_value = rng.choice(LEGACY_PAIRS)
        node = config.setdefault(parent_key, {}) if parent_key else config
        if isinstance(node, dict):
            node[old], node[new] = old_value, new_value
        return config
    path, value = rng.choice(paths)
    parent = _parent(config, path)
    if kind == "swap":
        parent[path[-1]] = copy.deepcopy(rng.choice(SWAPS))
        case.injected.append(parent[path[-1]])
    elif kind == "typo":
        parent[_typo(rng, path[-1])] = parent.pop(path[-1])
    elif kind == "delete":
        parent.pop(path[-1])
    elif kind == "absurd":
        parent[path[-1]] = rng.choice(INVALID)
        case.injected.append(parent[path[-1]])
    elif kind == "nest":
        nested = value
        for _ in range(rng.choice([2, 20, 40])):
            nested = {"x": nested}
        parent[path[-1]] = nested
    return config


def _duplicate_key_json(rng: random.Random, config: dict) -> bytes:
    """JSON text in which one object names one of its keys twice."""
    objects = [config] + [v for _, v in _paths(config) if isinstance(v, dict) and v]
    target = rng.choice([o for o in objects if o] or [config])
    key = rng.choice(list(target)) if target else "train_batch_size"
    target["\u0000dup"] = 1
    text = json.dumps(config, indent=2).replace('"\\u0000dup"', json.dumps(key))
    return text.encode()


def _serialize(config: dict, name: str) -> bytes:
    if name.endswith((".yaml", ".yml")):
        return yaml.safe_dump(config, sort_keys=False).encode()
    return json.dumps(config, indent=2).encode()


def generate(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    loaded = []
    for path in SOURCES:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix != ".json" else json.loads(re.sub(r",(\s*[}\]])", r"\1", text))
        loaded.append((path, data))
    cases = []
    for index in range(count):
        path, original = rng.choice(loaded)
        config = copy.deepcopy(original)
        case = Case(f"{index}:{path.name}", name=f"c{index}{path.suffix}", world=rng.choice([1, 1, 2]))
        for _ in range(rng.choice([1, 1, 2, 3])):
            mutate(rng, config, case)
        form = rng.random()
        if form < 0.06:
            case.label += "+utf16"
            case.data = _serialize(config, case.name).decode().encode("utf-16")
        elif form < 0.09:
            case.label += "+bytes"
            case.data = bytes(rng.randrange(256) for _ in range(rng.choice([8, 300])))
        elif form < 0.12:
            case.label += "+utf8-bom"
            case.data = b"\xef\xbb\xbf" + _serialize(config, case.name)
        elif form < 0.17 and path.suffix == ".json":
            case.label += "+duplicate-key"
            case.data = _duplicate_key_json(rng, config)
        elif form < 0.20:
            case.label += "+truncated"
            text = _serialize(config, case.name)
            case.data = text[: rng.randrange(1, max(2, len(text)))]
        elif form < 0.45 and path.suffix == ".json":
            case.config = config  # as a dict, the way Python callers pass it
        else:
            case.data = _serialize(config, case.name)
        cases.append(case)
    return cases


CASES = generate(FUZZ_CASES, FUZZ_SEED)


def _names_where(problem, case: Case, where: str) -> bool:
    return bool(problem.key) or where in problem.message or case.name in problem.message


def _injected_text(value) -> list[str]:
    """How an injected invalid value would read in a fix."""
    if isinstance(value, float) and math.isnan(value):
        return ["NaN", "nan"]
    if isinstance(value, float) and math.isinf(value):
        return ["Infinity", "inf"]
    return [json.dumps(value), str(value)] if not isinstance(value, str) else [value]


def check_refusals(problems, case: Case, where: str, args, tmp_path, model, world: int):
    injected = {text for value in case.injected for text in _injected_text(value)} & set(NEVER_IN_FIX)
    for problem in problems:
        assert _names_where(problem, case, where), f"{case.label}: names neither a key nor the file: {problem}"
        assert problem.fix.strip(), f"{case.label}: no fix: {problem}"
        assert "\n" not in str(problem) and "Traceback" not in str(problem), case.label
        for text in injected:
            assert not re.search(rf"(?<![\w.]){re.escape(text)}(?![\w.])", problem.fix), (
                f"{case.label}: the fix repeats the invalid {text}: {problem}"
            )
    for problem in problems:
        if problem.args_fix:  # a fix in TrainingArguments values must work
            fixed = make_args(tmp_path, **{**_args_kwargs(args), **BUDGET, **problem.args_fix})
            again = explain_deepspeed_config(_input(case, tmp_path), fixed, model, world, defer=True, raise_errors=False,
                                             hardware=HARDWARE)  # fmt: skip
            assert problem.key not in {p.key for p in again.problems}, f"{case.label}: fix did not work: {problem}"


def _args_kwargs(args) -> dict:
    return {"per_device_train_batch_size": args.per_device_train_batch_size, "max_steps": args.max_steps}


def _input(case: Case, tmp_path: Path):
    if case.config is not None:
        return copy.deepcopy(case.config)
    path = tmp_path / case.name
    if not path.exists():
        path.write_bytes(case.data)
    return path


def _section_values_are_what_deepspeed_reads(config: dict, label: str):
    """Each value in a section DeepSpeed models equals, with the same type, what DeepSpeed's model reads from it."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    models = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}
    for section, model in models.items():
        if not isinstance(config.get(section), dict):
            continue
        read = model(**copy.deepcopy(config[section])).model_dump(mode="json", by_alias=True)
        for key, value in walk(config[section]):
            node = read
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is None or value is None or isinstance(value, str) and key.endswith("nvme_path"):
                continue  # a field DeepSpeed keeps under another name, null (its default), or a path it normalizes
            widened = type(value) is int and type(node) is float  # an integer in a float field: the same number
            assert (type(value) is type(node) or widened) and value == node, (
                f"{label}: {section}.{key} is {value!r} but DeepSpeed reads {node!r}"
            )


@pytest.mark.parametrize("chunk", range(4))
def test_fuzzed_configs_end_in_a_resolution_or_one_line_per_problem(chunk, tmp_path, tiny_model_dir):
    cases = CASES[chunk::4]
    accepted = refused = 0
    for case in cases:
        source = _input(case, tmp_path)
        where = "the config dict" if case.config is not None else str(source)
        world = case.world
        args = make_args(tmp_path, per_device_train_batch_size=2, max_steps=10, **BUDGET)
        doctor = explain_deepspeed_config(source if case.config is None else copy.deepcopy(case.config), args,
                                          tiny_model_dir, world, defer=True, raise_errors=False, hardware=HARDWARE)  # fmt: skip
        check_refusals(doctor.problems, case, where, args, tmp_path, tiny_model_dir, world)
        try:
            resolution = explain_deepspeed_config(_input(case, tmp_path), make_args(tmp_path, **BUDGET), tiny_model_dir, world,
                                                  hardware=HARDWARE)  # fmt: skip
        except DeepSpeedConfigError as err:
            refused += 1
            assert err.problems, case.label
            check_refusals(err.problems, case, where, args, tmp_path, tiny_model_dir, world)
            continue
        accepted += 1
        config = resolution.config
        assert [k for k, v in walk(config) if isinstance(v, str) and v.strip().lower() == "auto"] == [], case.label
        assert [k for k, v in walk(config) if isinstance(v, str) and v.strip().lower() in ("true", "false")] == [], (
            case.label
        )
        deepspeed_accepts(config, world_size=world)
        _section_values_are_what_deepspeed_reads(config, case.label)
    assert accepted and refused, (accepted, refused)  # the mutations reach both outcomes


def test_the_generator_covers_every_mutation_and_encoding():
    labels = " ".join(case.label for case in CASES)
    for kind in ("swap", "typo", "delete", "absurd", "legacy", "nest", "utf16", "bytes", "utf8-bom",
                 "duplicate-key", "truncated"):  # fmt: skip
        assert f"+{kind}" in labels, kind
    assert len(CASES) >= 500 or os.environ.get("HF_EXT_FUZZ_CASES")
