"""Streaming safetensors writer, post-save check and complete-checkpoint helpers (no training)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BlenderbotForConditionalGeneration

from hf_ext.saving import checkpoints
from hf_ext.saving import writer as saving
from hf_ext.sizes import parse_bytes

from ..saving_support import assert_tied, named_params, stored_keys


def test_parse_size():
    assert parse_bytes("5GB") == 5 * 10**9
    assert parse_bytes("20KB") == 20_000
    assert parse_bytes("64KiB") == 65536
    assert parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="5GB"):
        parse_bytes("lots")


def test_streaming_save_matches_stock_save_pretrained(tiny_model_dir, tmp_path):
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # values that differ from the files on disk
    model.save_pretrained(tmp_path / "stock")
    written = saving.save_streaming(model, tmp_path / "ours", max_shard_size="20KB")
    model.config.save_pretrained(tmp_path / "ours")

    index = json.loads((tmp_path / "ours" / saving.SAFE_WEIGHTS_INDEX_NAME).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and {p.name for p in written} == {*shard_files, saving.SAFE_WEIGHTS_INDEX_NAME}
    stored = {}
    for name in shard_files:
        tensors = load_file(tmp_path / "ours" / name)
        assert all(index["weight_map"][k] == name for k in tensors)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000 or len(tensors) == 1
        stored.update(tensors)
    assert set(stored) == set(index["weight_map"]) == stored_keys(tmp_path / "stock")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())

    reloaded = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "ours")
    assert_tied(reloaded)
    trained, back = named_params(model), named_params(reloaded)
    assert trained.keys() == back.keys()
    for key, value in trained.items():
        assert torch.equal(value, back[key]), key


def test_streaming_save_casts_to_dtype_exactly(tiny_model_dir, tmp_path):
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    saving.save_streaming(model, tmp_path, dtype=torch.bfloat16)
    stored = load_file(tmp_path / saving.SAFE_WEIGHTS_NAME)
    for key, value in stored.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, model.state_dict()[key].to(torch.bfloat16)), key


def test_post_save_check_refuses_empty_tensors(tiny_model_dir, tmp_path):
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["model.shared.weight"] = torch.empty(0)  # what an un-gathered ZeRO-3 parameter looks like
    save_file({k: v.contiguous() for k, v in state.items() if "embed_tokens" not in k}, tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match=r"model.shared.weight has shape \[0\]"):
        saving.verify_saved_weights(tmp_path, model)
    assert not (tmp_path / "model.safetensors").exists()


def test_post_save_check_refuses_missing_tensors(tiny_model_dir, tmp_path):
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    state = {k: v.clone() for k, v in model.state_dict().items() if k == "final_logits_bias"}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="is missing"):
        saving.verify_saved_weights(tmp_path, model)


def _fake_checkpoint(run_dir, step, complete=True, tmp=False):
    path = run_dir / f"{'tmp-' if tmp else ''}checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        checkpoints.write_marker(path, global_step=step)
    return path


def test_resume_and_rotation_see_complete_checkpoints_only(tmp_path, caplog):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 8, complete=False)  # interrupted save by a stock writer
    _fake_checkpoint(tmp_path, 10, complete=False, tmp=True)  # interrupted hf-ext save
    with caplog.at_level(logging.WARNING, logger="hf_ext.saving.checkpoints"):
        assert checkpoints.last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-6")
    assert "tmp-checkpoint-10" in caplog.text and "checkpoint-8" in caplog.text

    checkpoints.rotate_complete_checkpoints(tmp_path, save_total_limit=1)
    # the newest *complete* checkpoint survives; incomplete ones are neither counted nor deleted by rotation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8", "tmp-checkpoint-10"]

    for step in (12, 14):
        _fake_checkpoint(tmp_path, step)
    checkpoints.rotate_complete_checkpoints(tmp_path, save_total_limit=1, best=str(tmp_path / "checkpoint-6"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-14",
        "checkpoint-6",
        "checkpoint-8",
        "tmp-checkpoint-10",
    ]
