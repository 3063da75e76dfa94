"""Streaming safetensors writer, post-save check and complete-checkpoint helpers (single process, seconds)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BlenderbotForConditionalGeneration, default_data_collator
from transformers import Trainer as StockTrainer

import hf_ext
from hf_ext.saving import checkpoints
from hf_ext.saving import writer as saving


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def _assert_tied(model) -> None:
    shared = model.model.shared.weight
    assert model.lm_head.weight is shared
    assert model.model.encoder.embed_tokens.weight is shared
    assert model.model.decoder.embed_tokens.weight is shared


def _stored_keys(output_dir) -> set[str]:
    return set(saving.saved_weight_shapes(output_dir))


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
    assert set(stored) == set(index["weight_map"]) == _stored_keys(tmp_path / "stock")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())

    reloaded = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "ours")
    _assert_tied(reloaded)
    trained, back = _params(model), _params(reloaded)
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
    with caplog.at_level(logging.WARNING, logger="hf_ext.checkpoints"):
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


def _dataset(n: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(4, vocab, (12,), generator=g).tolist(),
            "attention_mask": [1] * 12,
            "labels": torch.randint(4, vocab, (8,), generator=g).tolist() + [2],
        }
        for _ in range(n)
    ]


def _trainer(model_dir, out, **overrides):
    args = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    args.update(overrides)
    hf_args = hf_ext.TrainingArguments(**args)
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
    trainer = hf_ext.Trainer(
        model=model,
        args=hf_args,
        train_dataset=_dataset(16, model.config.vocab_size),
        data_collator=default_data_collator,
    )
    return trainer


def test_trainer_without_deepspeed_saves_resumes_and_rotates(tiny_model_dir, tmp_path, caplog):
    """No DeepSpeed: the same writer; checkpoints are complete, rotated, and resume bit for bit."""
    full = _trainer(tiny_model_dir, tmp_path / "full")
    full.train()
    full.save_model()
    StockTrainer.save_model(full, str(tmp_path / "stock"))
    assert sorted(p.name for p in (tmp_path / "full").glob("*checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    for path in (tmp_path / "full").glob("checkpoint-*"):
        assert checkpoints.is_complete_checkpoint(path) and (path / checkpoints.CHECKPOINT_MARKER).is_file()

    ours = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "full")
    stock = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "stock")
    _assert_tied(ours)
    assert _stored_keys(tmp_path / "full") == _stored_keys(tmp_path / "stock")
    trained = _params(full.model)
    for key, value in _params(ours).items():
        assert torch.equal(value, trained[key]) and torch.equal(value, _params(stock)[key]), key

    # a fresh trainer resumes from the newest complete checkpoint (step 6, in the second epoch); the leftover of an
    # interrupted save of step 8 is skipped with a warning
    shutil.copytree(tmp_path / "full" / "checkpoint-6", tmp_path / "resumed" / "checkpoint-6")
    shutil.copytree(tmp_path / "full" / "checkpoint-8", tmp_path / "resumed" / "tmp-checkpoint-8")
    resumed = _trainer(tiny_model_dir, tmp_path / "resumed")
    with caplog.at_level(logging.WARNING, logger="hf_ext.checkpoints"):
        resumed.train(resume_from_checkpoint=True)
    assert "tmp-checkpoint-8" in caplog.text
    for key, value in _params(resumed.model).items():
        assert torch.equal(value, trained[key]), key
    assert sorted(p.name for p in (tmp_path / "resumed").glob("*checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
