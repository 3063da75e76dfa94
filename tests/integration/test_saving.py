"""Training without DeepSpeed in one process: the streaming writer saves, checkpoints are complete and rotated, and
a resumed run equals the uninterrupted one bit for bit (the writer alone: tests/unit/test_saving_writer.py)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from transformers import BlenderbotForConditionalGeneration, default_data_collator
from transformers import Trainer as StockTrainer

import hf_ext
from hf_ext.saving import checkpoints

from ..saving_support import assert_tied, named_params, stored_keys, synthetic_rows

pytestmark = pytest.mark.slow


def _trainer(model_dir, out, trainer_class=hf_ext.Trainer, **overrides):
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
    trainer = trainer_class(
        model=model,
        args=hf_args,
        train_dataset=synthetic_rows(16, model.config.vocab_size),
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
    assert_tied(ours)
    assert stored_keys(tmp_path / "full") == stored_keys(tmp_path / "stock")
    trained = named_params(full.model)
    for key, value in named_params(ours).items():
        assert torch.equal(value, trained[key]) and torch.equal(value, named_params(stock)[key]), key

    # a fresh trainer resumes from the newest complete checkpoint (step 6, in the second epoch); the leftover of an
    # interrupted save of step 8 is skipped with a warning
    shutil.copytree(tmp_path / "full" / "checkpoint-6", tmp_path / "resumed" / "checkpoint-6")
    shutil.copytree(tmp_path / "full" / "checkpoint-8", tmp_path / "resumed" / "tmp-checkpoint-8")
    resumed = _trainer(tiny_model_dir, tmp_path / "resumed")
    with caplog.at_level(logging.WARNING, logger="hf_ext.saving.checkpoints"):
        resumed.train(resume_from_checkpoint=True)
    assert "tmp-checkpoint-8" in caplog.text
    for key, value in named_params(resumed.model).items():
        assert torch.equal(value, trained[key]), key
    assert sorted(p.name for p in (tmp_path / "resumed").glob("*checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]


def _lr_at_step_begin(trainer) -> list[float]:
    """The learning rate the optimizer holds as each step begins (what that step trains with)."""
    from transformers import TrainerCallback

    seen: list[float] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            seen.append(optimizer.param_groups[0]["lr"])

    trainer.add_callback(Record())
    return seen


@pytest.mark.parametrize("trainer_class", [StockTrainer, hf_ext.Trainer], ids=["stock", "hf-ext"])
def test_extending_max_steps_starts_from_the_new_schedule(trainer_class, tiny_model_dir, tmp_path, caplog):
    """Train 4 steps (linear decay to 0 at step 4), then resume checkpoint-4 with max_steps=8: the first resumed step
    trains at the 8-step schedule's rate for step 4 (half the peak), as an uninterrupted 8-step run does; stock
    trains it at 0, the 4-step schedule's last value."""
    base = dict(max_steps=4, num_train_epochs=1, save_steps=4, learning_rate=1e-3, lr_scheduler_type="linear")
    _trainer(tiny_model_dir, tmp_path / "run", **base).train()
    resumed = _trainer(tiny_model_dir, tmp_path / "run", trainer_class, **{**base, "max_steps": 8})
    seen = _lr_at_step_begin(resumed)
    with caplog.at_level(logging.WARNING, logger="hf_ext.schedule"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    uninterrupted = _trainer(tiny_model_dir, tmp_path / "long", **{**base, "max_steps": 8, "save_strategy": "no"})
    reference = _lr_at_step_begin(uninterrupted)
    uninterrupted.train()
    assert len(seen) == 4 and reference[4] == pytest.approx(0.5e-3)
    if trainer_class is StockTrainer:
        assert seen[0] == 0.0  # what the issue is about
        return
    assert seen == pytest.approx(reference[4:], rel=1e-6)  # steps 5..8 at the 8-step schedule's rates
    assert "Resumed at step 4 of 8: learning rate set to 0.0005" in caplog.text


def test_resuming_with_max_steps_below_the_checkpoint_step_is_an_error(tiny_model_dir, tmp_path):
    _trainer(tiny_model_dir, tmp_path / "run", max_steps=4, save_steps=4).train()
    with pytest.raises(ValueError, match="checkpoint is at step 4 but this run stops at max_steps=2"):
        _trainer(tiny_model_dir, tmp_path / "run", max_steps=2, save_steps=4).train(resume_from_checkpoint=True)
