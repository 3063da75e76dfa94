"""The memory planner's activation probe on a model too large to probe whole (a real probe: torch profiler passes,
too slow for the unit tier)."""

from __future__ import annotations

import pytest


def test_a_model_too_large_to_probe_whole_is_probed_as_shallow_copies(monkeypatch):
    # oracle: the whole-model probe of the same 6-layer config (layers 2.. each add the same bytes to the peak)
    from transformers import GPT2Config

    from hf_ext.memory import probe

    config = GPT2Config(
        n_embd=64, n_layer=6, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    whole = probe.measure(config, 32, False)
    monkeypatch.setattr(probe, "WHOLE_PROBE_SHARE", 0.0)  # as if the machine could not hold the whole copy
    shallow = probe.measure(config, 32, False)
    assert shallow["probed_layers"] == [2, 3] and "probed_layers" not in whole
    assert shallow["facts"] == whole["facts"]  # counted on the meta device: the same parameters
    for (batch, expected), (same_batch, extrapolated) in zip(whole["points"], shallow["points"]):
        assert batch == same_batch and extrapolated == pytest.approx(expected, rel=0.02)
