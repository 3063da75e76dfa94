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

import json
import re
from pathlib import Path

from .errors import DeepSpeedConfigError, Problem, Report

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
        return json.loads(json.dumps(config))
    if not isinstance(config, (str, Path)):
        raise DeepSpeedConfigError(
            [Problem("", f"expected a path, a dict or a preset name, got {type(config).__name__}")]
        )
    text = str(config)
    if text in PRESETS:
        return _load_json(preset_path(text), report)
    if text.lstrip().startswith("{"):  # an inline JSON string, as transformers accepts
        return _parse_json(text, "<inline JSON>", report)
    path = Path(text).expanduser()
    if not path.is_file():
        hint = f"; presets are {', '.join(PRESETS)}" if "/" not in text and not path.suffix else ""
        raise DeepSpeedConfigError([Problem("", f"no such file: {text}{hint}")])
    if path.suffix.lower() in (".yaml", ".yml"):
        return _load_yaml(path, report)
    return _load_json(path, report)


def _load_json(path: Path, report: Report) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise DeepSpeedConfigError([Problem("", f"cannot read {path}: {err.strerror}")]) from None
    return _parse_json(text, str(path), report)


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
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as err:
        raise DeepSpeedConfigError(
            [Problem(str(err), "key given twice in one object (DeepSpeed rejects that)")], where
        ) from None
    except json.JSONDecodeError as err:
        fixed, commas = strip_trailing_commas(text)
        try:
            data = json.loads(fixed, object_pairs_hook=_no_duplicates) if commas else None
        except (json.JSONDecodeError, _DuplicateKey):
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
        raise DeepSpeedConfigError([Problem("", f"expected a JSON object, got {type(data).__name__}")], where)
    return data


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


def _load_yaml(path: Path, report: Report) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise DeepSpeedConfigError(
            [Problem("", f"{path}{at}: invalid YAML: {getattr(err, 'problem', err)}")]
        ) from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError([Problem("", f"{path}: expected a YAML mapping")])
    if isinstance(data.get("deepspeed_config"), dict):
        return _from_accelerate(data, path, report)
    if isinstance(data.get("deepspeed"), str):  # a training YAML (TrainingArguments keys) pointing at a JSON
        target = _find_relative(data["deepspeed"], path.parent)
        if target is None:
            raise DeepSpeedConfigError([_missing("deepspeed", data["deepspeed"], path)])
        report.warn(f"{path} is a training YAML; only its `deepspeed: {data['deepspeed']}` is read here")
        return load(str(target), report)
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data:  # a DeepSpeed config in YAML
        return json.loads(json.dumps(data))
    raise DeepSpeedConfigError([Problem("", f"{path} is neither an accelerate DeepSpeed YAML nor a DeepSpeed config")])


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
        zero: dict = {"stage": int(ds.get("zero_stage", 2))}
        for section in ("offload_optimizer", "offload_param"):
            device = str(ds.get(f"{section}_device", "none"))
            if device != "none":
                zero[section] = {"device": device}
                if ds.get(f"{section}_nvme_path") not in (None, "none"):
                    zero[section]["nvme_path"] = ds[f"{section}_nvme_path"]
        if zero["stage"] == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = bool(ds.get("zero3_save_16bit_model", False))
        config["zero_optimization"] = zero
        if ds.get("gradient_clipping") not in (None, "auto"):
            config["gradient_clipping"] = ds["gradient_clipping"]
        for key, value in config.items():
            report.change(key, value, source, "added")
    precision = str(data.get("mixed_precision", "")).lower()
    if precision in ("no", "fp16", "bf16", "fp8"):
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
    import yaml

    inline = {key: yaml.safe_load(env[name]) for key, name in _ACCELERATE_ENV.items() if env.get(name) is not None}
    data = {"mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no"), "deepspeed_config": inline}
    return _from_accelerate(data, Path("accelerate launch"), Report())
