"""HfArgumentParser + ``--config FILE.yaml``: CLI flags override the YAML, the YAML overrides dataclass defaults."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

import yaml
from transformers import HfArgumentParser


def parse_args_with_config(dataclass_types, argv: list[str] | None = None):
    """Parse ``argv`` into ``dataclass_types``, taking defaults from ``--config`` (YAML) when given.

    Unknown YAML keys are an error that names the key (and the closest known one); nothing is silently ignored.
    """
    parser = HfArgumentParser(dataclass_types)
    parser.add_argument("--config", default=None, help="YAML file of defaults; CLI flags override it.")
    for action in parser._actions:  # the memory planner picks the micro-batch: hf_ext.memory.auto
        if action.dest in AUTO_INT_FIELDS:
            action.type = int_or_auto
            action.help = (action.help or "") + ' "auto": the largest that fits the memory (needs --plan_model).'
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**load_yaml_defaults(known.config, parser))
    namespace_parts = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=False)
    return namespace_parts[: len(dataclass_types)]


#: int options that also take "auto"
AUTO_INT_FIELDS = ("per_device_train_batch_size",)


def int_or_auto(value: str) -> int | str:
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {value!r}") from None


def load_yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict:
    """The YAML mapping at ``path``, checked against the parser's options (exits with a usage error otherwise)."""
    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        _fail(parser, f"--config {path}: no such file")
    except yaml.YAMLError as err:
        _fail(parser, f"--config {path}: invalid YAML: {err}")
    if not isinstance(values, dict):
        _fail(parser, f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    known = {action.dest for action in parser._actions} - {"help", "config"}
    problems = []
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            problems.append(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if problems:
        _fail(parser, f"--config {path}: " + "; ".join(problems))
    return values


def _fail(parser: argparse.ArgumentParser, message: str):
    """Exit with one clear line (no usage dump of 200 options, no traceback)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def split_launcher_args(argv: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """A script's own launcher flags taken out of ``argv``: ``--launcher ray`` (run ``main`` on Ray Train workers,
    :func:`hf_ext.ray.run_script`) with ``--num_workers N`` or ``MIN:MAX`` (elastic), ``--max_failures K`` and
    ``--ray_storage DIR`` (Ray's checkpoints and results; default: Ray's, ``~/ray_results``). Returns those settings
    (``None`` without ``--launcher``) and the rest of ``argv``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--launcher", choices=["ray"], default=None)
    parser.add_argument("--num_workers", default="2")
    parser.add_argument("--max_failures", type=int, default=0)
    parser.add_argument("--ray_storage", default=None)
    known, rest = parser.parse_known_args(argv)
    if known.launcher is None:
        return None, list(argv)
    workers = known.num_workers.split(":")
    if len(workers) > 2 or not all(w.isdigit() and int(w) > 0 for w in workers):
        raise SystemExit(f"--num_workers {known.num_workers!r}: a number of workers (2) or a range (1:2).")
    known.num_workers = int(workers[0]) if len(workers) == 1 else (int(workers[0]), int(workers[1]))
    if known.ray_storage and "://" not in known.ray_storage:  # a local directory (s3://, gs://... as given)
        known.ray_storage = str(Path(known.ray_storage).resolve())
    return known, rest
