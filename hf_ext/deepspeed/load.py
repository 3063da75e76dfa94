"""Reading a DeepSpeed config from wherever users keep it: a JSON file, an accelerate YAML, a dict or a preset name.

JSON syntax errors are reported with line and column. A trailing comma (``{"enabled": "auto",}``) is *accepted*
with a warning: DeepSpeed's own loader (hjson) accepts it, and the corpus of real-world configs has it
(axolotl's 2023 ``ds_config.json``); only transformers' strict ``json.load`` chokes on it. Anything else that is
not strict JSON is an error.

An accelerate YAML is read the way ``accelerate launch`` reads it: ``deepspeed_config.deepspeed_config_file``
(relative to the YAML's folder, then to the working directory) or the inline ``deepspeed_config`` keys
(``zero_stage``, ``offload_*_device``, ``zero3_save_16bit_model``, ``gradient_accumulation_steps``,
``gradient_clipping``) plus ``mixed_precision``. A training YAML with a ``deepspeed:`` path is followed too.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import yaml

from ..errors import DeepSpeedConfigError, Problem, Report, short
from .normalize import as_bool

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))

# accelerate launcher settings that are not part of the DeepSpeed config itself
_ACCELERATE_ONLY = (
    "zero3_init_flag",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_moe_layer_cls_names",
)


def preset_path(name: str) -> Path:
    """The JSON template of a preset (``zero1``, ``zero2``, ``zero3``, ``zero3_offload``)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown DeepSpeed preset {name!r}; choose one of {', '.join(PRESETS)} or give a path.")
    return PRESET_DIR / f"{name}.json"


def preset_name(config) -> str | None:
    """The preset ``config`` is: its name, or a path to one of the preset files hf-ext ships (as accelerate YAMLs
    name them); ``None`` for anything else."""
    if isinstance(config, dict):
        return None
    if str(config) in PRESETS:
        return str(config)
    path = Path(str(config))
    if path.suffix == ".json" and path.stem in PRESETS and path.is_file():
        try:
            return path.stem if path.resolve().parent == PRESET_DIR.resolve() else None
        except OSError:
            return None
    return None


def describe(config) -> str:
    if isinstance(config, dict):
        return "the config dict"
    if str(config) in PRESETS:
        return f"preset {config!r}"
    return str(config)


def load(config, report: Report) -> dict:
    """The config as a fresh dict; problems that stop loading raise :class:`DeepSpeedConfigError`."""
    if isinstance(config, dict):
        return _checked(config, "the config dict")
    if not isinstance(config, (str, Path)):
        raise DeepSpeedConfigError(
            [
                Problem(
                    "",
                    f"expected a path, a dict or a preset name, got {type(config).__name__}",
                    "pass the path of a DeepSpeed JSON file, an accelerate YAML, a dict or a preset name",
                )
            ]
        )
    text = str(config)
    if text in PRESETS:
        return _load_json(preset_path(text), report)
    if text.lstrip().startswith("{"):  # an inline JSON string, as transformers accepts
        return _parse_json(text, "<inline JSON>", report)
    path = Path(text).expanduser()
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".json", ".yaml", ".yml"))[:5]
        found = f" (it holds {', '.join(inside)})" if inside else ""
        raise DeepSpeedConfigError(
            [Problem("", f"{text} is a directory, not a config file{found}", "pass the JSON or YAML file itself")]
        )
    if not path.is_file():
        hint = f"; presets are {', '.join(PRESETS)}" if "/" not in text and not path.suffix else ""
        raise DeepSpeedConfigError([Problem("", f"no such file: {text}{hint}", "fix the path, or name a preset")])
    if path.suffix.lower() in (".yaml", ".yml"):
        return _load_yaml(path, report)
    return _load_json(path, report)


#: No DeepSpeed config nests deeper than a few levels (zero_optimization.offload_param.device is 3).
MAX_DEPTH = 16

#: Byte-order marks of the encodings Windows tools write (PowerShell's ``>`` writes UTF-16 LE).
_WIDE_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}


def read_text(path: Path, report: Report) -> str:
    """A config file's text: UTF-8 (a UTF-8 byte-order mark is dropped with a warning); anything else is one
    problem naming the file and how to re-save it."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DeepSpeedConfigError(
            [Problem("", f"cannot read {path}: {err.strerror}", "check the path and its permissions")]
        ) from None
    wide = next((name for bom, name in _WIDE_BOMS.items() if data.startswith(bom)), None)
    if (
        wide is None
        and len(data) >= 2
        and 0 in data[:2]
        and data[1::2].count(0) + data[::2].count(0) >= len(data) // 3
    ):
        wide = "UTF-16"  # UTF-16 without a byte-order mark: every other byte of ASCII text is zero
    if wide is not None:
        raise DeepSpeedConfigError(
            [
                Problem(
                    "",
                    f"{path} is {wide} text (what Windows PowerShell's `>` writes); DeepSpeed and transformers read UTF-8",
                    f"re-save it as UTF-8: iconv -f {wide} -t UTF-8 {path.name} > fixed{path.suffix} (PowerShell: "
                    "Set-Content -Encoding utf8)",
                )
            ]
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DeepSpeedConfigError(
            [
                Problem(
                    "",
                    f"{path} is not a text config file (byte {data[err.start]:#04x} at offset {err.start} is not UTF-8)",
                    "pass a DeepSpeed JSON or accelerate YAML file saved as UTF-8",
                )
            ]
        ) from None
    if "\x00" in text:
        raise DeepSpeedConfigError(
            [Problem("", f"{path} is a binary file, not a config", "pass a DeepSpeed JSON or accelerate YAML file")]
        )
    if text.startswith("\ufeff"):
        report.warn(f"{path}: UTF-8 byte-order mark ignored (transformers' json.load fails on it); re-save without it")
        text = text[1:]
    return text


def _too_deep(where: str) -> DeepSpeedConfigError:
    problem = Problem(
        "",
        f"{where} is nested more than {MAX_DEPTH} levels deep; no DeepSpeed config is",
        "pass the DeepSpeed config itself (sections such as zero_optimization hold plain values)",
    )
    return DeepSpeedConfigError([problem], where)


def _checked(data: dict, where: str) -> dict:
    """A fresh plain-JSON copy of ``data``; a config nested deeper than any real one, or holding values JSON cannot
    hold (YAML dates, sets), is one problem naming ``where``."""
    depth, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        depth = max(depth, level)
        if depth > MAX_DEPTH:
            raise _too_deep(where)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack += [(child, level + 1) for child in children if isinstance(child, (dict, list))]
    try:
        return json.loads(json.dumps(data))
    except (TypeError, ValueError) as err:
        raise DeepSpeedConfigError(
            [Problem("", f"{where} holds a value JSON cannot represent ({err})", "write plain numbers and strings")]
        ) from None


def _load_json(path: Path, report: Report) -> dict:
    return _parse_json(read_text(path, report), str(path), report)


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


class _DuplicateKey(ValueError):
    pass


def _parse_json(text: str, where: str, report: Report) -> dict:
    try:
        data = _json_object(text, where)
    except json.JSONDecodeError as err:
        fixed, commas = strip_trailing_commas(text)
        try:
            data = _json_object(fixed, where) if commas else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            problem = Problem("", f"{where}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}", "fix the syntax")
            raise DeepSpeedConfigError([problem], where) from None
        for line, col in commas:
            report.warn(
                f"{where}:{line}:{col}: trailing comma accepted (DeepSpeed reads it; strict JSON readers, "
                "transformers' included, do not). Remove it to keep the file portable."
            )
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(
            [
                Problem(
                    "",
                    f"{where} holds a JSON {type(data).__name__}, not an object",
                    'write the config as one object: {"zero_optimization": ...}',
                )
            ],
            where,
        )
    return _checked(data, where)


def _json_object(text: str, where: str):
    """``json.loads`` that refuses duplicate keys and nesting deeper than Python's parser can follow."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as err:
        raise DeepSpeedConfigError(
            [Problem(str(err), f"given twice in one object of {where} (DeepSpeed rejects that)", "keep one of them")],
            where,
        ) from None
    except RecursionError:  # deeper than Python's parser follows
        raise _too_deep(where) from None


_STRING_OR_COMMA = re.compile(r'"(?:[^"\\]|\\.)*"|,(?=\s*[}\]])')


def strip_trailing_commas(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` without commas that directly precede ``}`` or ``]`` (outside strings), and their (line, column)."""
    positions: list[tuple[int, int]] = []

    def drop(match: re.Match) -> str:
        if match.group(0) != ",":
            return match.group(0)
        line = text.count("\n", 0, match.start()) + 1
        col = match.start() - (text.rfind("\n", 0, match.start()) + 1) + 1
        positions.append((line, col))
        return ""

    return _STRING_OR_COMMA.sub(drop, text), positions


def _find_relative(ref: str, base: Path) -> Path | None:
    ref_path = Path(ref).expanduser()
    candidates = [ref_path] if ref_path.is_absolute() else [base / ref_path, Path.cwd() / ref_path]
    return next((c for c in candidates if c.is_file()), None)


@functools.cache
def _yaml_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when PyYAML has it: 10x faster

    class Loader(base):
        pass

    def mapping(loader, node, deep=False):
        keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
        repeated = next((k for i, k in enumerate(keys) if isinstance(k, (str, int, float)) and k in keys[:i]), None)
        if repeated is not None:
            raise _DuplicateKey(repeated)
        return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def _load_yaml(path: Path, report: Report) -> dict:
    text = read_text(path, report)
    try:
        data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as err:
        raise DeepSpeedConfigError(
            [
                Problem(
                    str(err), f"given twice in one mapping of {path} (only the last would count)", "keep one of them"
                )
            ]
        ) from None
    except RecursionError:  # deeper than PyYAML's constructor follows
        raise _too_deep(str(path)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise DeepSpeedConfigError(
            [Problem("", f"{path}{at}: invalid YAML: {getattr(err, 'problem', err)}", "fix the syntax")]
        ) from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(
            [
                Problem(
                    "",
                    f"{path} holds a YAML {type(data).__name__}, not a mapping",
                    "pass an accelerate config YAML or a DeepSpeed config",
                )
            ]
        )
    data = _checked(data, str(path))
    if isinstance(data.get("deepspeed_config"), dict):
        return _from_accelerate(data, path, report)
    if isinstance(data.get("deepspeed"), str):  # a training YAML (TrainingArguments keys) pointing at a JSON
        target = _find_relative(data["deepspeed"], path.parent)
        if target is None:
            raise DeepSpeedConfigError([_missing("deepspeed", data["deepspeed"], path)])
        report.warn(f"{path} is a training YAML; only its `deepspeed: {data['deepspeed']}` is read here")
        return load(str(target), report)
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data:  # a DeepSpeed config in YAML
        return data
    raise DeepSpeedConfigError(
        [
            Problem(
                "",
                f"{path} is neither an accelerate DeepSpeed YAML nor a DeepSpeed config",
                "pass the YAML `accelerate config` wrote (with a deepspeed_config section) or a DeepSpeed JSON",
            )
        ]
    )


#: What ``accelerate launch`` accepts for ``mixed_precision`` (accelerate.utils.PrecisionType).
ACCELERATE_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def _accelerate_stage(value, report: Report) -> int:
    """accelerate's ``zero_stage`` as an int; anything else is one problem naming the YAML key (stage 2 stands in,
    so that nothing else fails because of it)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return value
    if isinstance(value, str) and value.strip() in ("0", "1", "2", "3"):
        return int(value)
    report.problem("deepspeed_config.zero_stage", f"{short(value)} is not a ZeRO stage", "use 0, 1, 2 or 3")
    return 2


def _accelerate_precision(value, report: Report) -> str | None:
    """accelerate's ``mixed_precision`` (None when absent). An unquoted YAML ``no`` reads as false: that is "no"."""
    if value is None:
        return None
    if value is False:
        return "no"
    if isinstance(value, str) and value.strip().lower() in ACCELERATE_PRECISIONS:
        return value.strip().lower()
    report.problem(
        "mixed_precision",
        f"{short(value)} is not a precision accelerate knows",
        f"use {', '.join(ACCELERATE_PRECISIONS[:-1])} or {ACCELERATE_PRECISIONS[-1]}",
    )
    return None


def _missing(key: str, ref: str, yaml_path: Path) -> Problem:
    return Problem(
        key,
        f"{yaml_path} points to {ref!r}, which exists neither next to the YAML ({yaml_path.parent}) "
        f"nor in the working directory ({Path.cwd()})",
        "fix the path, or pass the JSON file itself",
    )


def _from_accelerate(data: dict, path: Path, report: Report) -> dict:
    ds = data["deepspeed_config"]
    source = f"accelerate YAML {path.name}"
    for key in _ACCELERATE_ONLY:
        if key in ds:
            report.change(
                f"(accelerate) {key}", ds[key], f"{source}: a launcher setting, left to accelerate", "removed"
            )
    if "deepspeed_config_file" in ds:
        target = _find_relative(str(ds["deepspeed_config_file"]), path.parent)
        if target is None:
            raise DeepSpeedConfigError([_missing("deepspeed_config_file", ds["deepspeed_config_file"], path)])
        ignored = sorted(set(ds) - {"deepspeed_config_file", *_ACCELERATE_ONLY})
        if ignored:
            report.warn(f"{source}: {', '.join(ignored)} ignored next to deepspeed_config_file (accelerate does too)")
        config = load(str(target), report)
    else:
        config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
        config["gradient_accumulation_steps"] = ds.get("gradient_accumulation_steps", "auto")
        zero: dict = {"stage": _accelerate_stage(ds.get("zero_stage", 2), report)}
        for section in ("offload_optimizer", "offload_param"):
            device = str(ds.get(f"{section}_device", "none"))
            if device != "none":
                zero[section] = {"device": device}
                if ds.get(f"{section}_nvme_path") not in (None, "none"):
                    zero[section]["nvme_path"] = ds[f"{section}_nvme_path"]
        if zero["stage"] == 3:
            save_16bit = as_bool(ds.get("zero3_save_16bit_model", False), declared_bool=True)
            zero["stage3_gather_16bit_weights_on_model_save"] = save_16bit
        config["zero_optimization"] = zero
        if ds.get("gradient_clipping") not in (None, "auto"):
            config["gradient_clipping"] = ds["gradient_clipping"]
        for key, value in config.items():
            report.change(key, value, source, "added")
    precision = _accelerate_precision(data.get("mixed_precision"), report)
    if precision is not None:
        for name in ("fp16", "bf16"):
            wanted = precision == name or (name == "bf16" and precision == "fp8")
            section = config.setdefault(name, {})
            if section.get("enabled", "auto") == "auto":
                section["enabled"] = wanted
                report.change(f"{name}.enabled", wanted, f"{source}: mixed_precision {precision}")
            elif section["enabled"] != wanted:
                report.problem(
                    f"{name}.enabled",
                    f"is {section['enabled']} but {source} says mixed_precision: {precision}",
                    f'set {name}.enabled to "auto" or change mixed_precision',
                )
    return config


# ``accelerate launch`` hands its DeepSpeed plugin settings to the script in these variables (accelerate/utils/launch.py)
_ACCELERATE_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
}


def accelerate_launch_config(env) -> str | dict | None:
    """The DeepSpeed config ``accelerate launch --config_file X.yaml`` gave this process, or None.

    Its ``deepspeed_config_file`` when the YAML names one, else a config built from the inline settings the way
    :func:`load` builds it from the YAML itself. hf-ext then resolves it like any other config (stock transformers
    leaves the accelerate path to accelerate's own, narrower "auto" filling).
    """
    if str(env.get("ACCELERATE_USE_DEEPSPEED", "")).lower() != "true":
        return None
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if config_file and config_file != "none":
        return config_file
    inline = {key: yaml.safe_load(env[name]) for key, name in _ACCELERATE_ENV.items() if env.get(name) is not None}
    data = {"mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no"), "deepspeed_config": inline}
    report = Report()
    config = _from_accelerate(data, Path("accelerate launch"), report)
    if report.problems:
        raise DeepSpeedConfigError(report.problems, "the settings accelerate launch passed")
    return config
