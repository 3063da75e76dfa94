"""The record a config resolution (DeepSpeed, FSDP) keeps: what changed and why, what is wrong and how to fix it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Change:
    """One key that resolution filled, added, normalized, moved or removed, and where its value came from."""

    key: str
    value: Any
    source: str
    action: str = "filled"  # filled | added | normalized | moved | removed | deferred


@dataclass
class Problem:
    """One thing wrong with a config: the key, what is wrong, and what to do about it.

    ``args_fix`` holds the ``TrainingArguments`` values that would make the problem go away (mismatches only).
    """

    key: str
    message: str
    fix: str = ""
    args_fix: dict = field(default_factory=dict)

    def __post_init__(self):  # one line each, whatever the source (a YAML parser's message spans lines)
        self.message, self.fix = (" ".join(str(text).split()) for text in (self.message, self.fix))

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else ""
        return f"{where}{self.message}" + (f". Fix: {self.fix}" if self.fix else "")


class ConfigError(ValueError):
    """A config that cannot be used as is. ``problems`` lists every problem found, one line each."""

    what = "config"

    def __init__(self, problems: list[Problem], origin: str = ""):
        self.problems = list(problems)
        self.origin = origin
        where = f" in {origin}" if origin else ""
        lines = "\n".join(f"- {p}" for p in self.problems)
        count = len(self.problems)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} with the {self.what}{where}:\n{lines}")


class DeepSpeedConfigError(ConfigError):
    """A DeepSpeed config that cannot be used as is."""

    what = "DeepSpeed config"


class FsdpConfigError(ConfigError):
    """FSDP settings (``fsdp`` / ``fsdp_config``) that cannot be used as they are."""

    what = "FSDP settings"


@dataclass
class Report:
    """Accumulates changes, warnings and problems while a config is loaded, normalized, filled and validated."""

    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def change(self, key: str, value: Any, source: str, action: str = "filled"):
        self.changes.append(Change(key, value, source, action))

    def warn(self, message: str):
        self.warnings.append(message)

    def problem(self, key: str, message: str, fix: str = "", args_fix: dict | None = None):
        self.problems.append(Problem(key, message, fix, dict(args_fix or {})))

    def extend(self, other: Report):
        self.changes += other.changes
        self.warnings += other.warnings
        self.problems += other.problems


def short(value: Any) -> str:
    """A value as compact JSON, for messages and tables."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
