"""The peer tier: the behaviours a stock ``Trainer`` user relies on, checked on stock transformers' classes and on
hf-ext's with the same tests, data and seed (docs/drop-in.md).

Every test takes the ``peer`` fixture, the classes under test, and runs once per side. ``HF_EXT_PEER=stock`` or
``HF_EXT_PEER=hf_ext`` runs one side only (``make test-peer PEER=stock``): the stock run shows each expectation is
stock's own behaviour, the hf-ext run that hf-ext keeps it. Where hf-ext differs on purpose the test is marked
``peer_difference`` and asserts each side's documented behaviour.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import transformers

import hf_ext

SIDES = ("stock", "hf_ext")


def _sides() -> tuple[str, ...]:
    chosen = os.environ.get("HF_EXT_PEER", "both")
    if chosen == "both":
        return SIDES
    if chosen not in SIDES:
        raise pytest.UsageError(f"HF_EXT_PEER={chosen!r}: use stock, hf_ext or both.")
    return (chosen,)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "peer_difference(anchor): hf-ext differs from stock on purpose, as docs/drop-in.md#anchor says"
    )
    config.addinivalue_line("markers", "peer_sides(*sides): runs only when every one of these sides is chosen")


def pytest_collection_modifyitems(config, items):
    """A test that needs a side left out by ``HF_EXT_PEER`` is deselected, and the reason said once."""
    chosen = set(_sides())
    keep, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("peer_sides")
        (dropped if marker and not set(marker.args) <= chosen else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        names = ", ".join(item.name for item in dropped)
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(
                f"deselected {names}: they need a side HF_EXT_PEER={os.environ['HF_EXT_PEER']} leaves out"
            ),
            stacklevel=2,
        )


def classes(side: str) -> SimpleNamespace:
    """The four classes a Trainer user imports, from stock transformers or from hf-ext."""
    module = transformers if side == "stock" else hf_ext
    names = ("Trainer", "Seq2SeqTrainer", "TrainingArguments", "Seq2SeqTrainingArguments")
    return SimpleNamespace(side=side, stock=side == "stock", **{name: getattr(module, name) for name in names})


@pytest.fixture(params=_sides())
def peer(request) -> SimpleNamespace:
    return classes(request.param)
