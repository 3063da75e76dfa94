"""Checkpoints a stock Trainer user relies on: rotation with the best model kept, ``save_strategy="best"``, resuming
the newest checkpoint, the resume errors, ``auto_find_batch_size`` and what a checkpoint holds."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback, TrainerState

from .regression import EventLog, RegressionData, RegressionModel, regression_model, trainer, weights

# 64 rows, 8 a step, 3 epochs: 24 steps
STEPS = 24


def _checkpoints(run_dir) -> list[str]:
    return sorted((p for p in os.listdir(run_dir) if p.startswith("checkpoint-")), key=lambda p: int(p.split("-")[1]))


@pytest.mark.parametrize("save_total_limit", [1, 2])
def test_rotation_keeps_the_best_checkpoint_and_the_newest(peer, tmp_path, save_total_limit):
    """While training the best and the newest checkpoints stay; at the end, a limit of 1 keeps the best only."""
    # "best" is the highest eval loss, so the first evaluated checkpoint (step 5) stays best while the loss falls
    run = trainer(peer, tmp_path, eval_strategy="steps", eval_steps=5, save_steps=5, save_total_limit=save_total_limit,
                  load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)  # fmt: skip
    run.train()
    evaluated = [e for e in run.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evaluated] == [5, 10, 15, 20, STEPS]
    assert max(evaluated, key=lambda e: e["eval_loss"])["step"] == 5
    kept = ["checkpoint-5"] if save_total_limit == 1 else ["checkpoint-5", f"checkpoint-{STEPS}"]
    assert _checkpoints(tmp_path) == kept
    assert run.state.best_model_checkpoint == str(tmp_path / "checkpoint-5")
    # load_best_model_at_end: the trainer ends with checkpoint-5's weights
    saved = load_file(tmp_path / "checkpoint-5" / "model.safetensors")
    assert weights(run.model) == (saved["a"].item(), saved["b"].item())


def test_save_strategy_best_saves_each_new_best_only(peer, tmp_path):
    # the eval loss falls at every evaluation, so with greater_is_better only the first one is a best
    run = trainer(peer, tmp_path, eval_strategy="steps", eval_steps=5, save_strategy="best",
                  metric_for_best_model="loss", greater_is_better=True)  # fmt: skip
    run.train()
    assert _checkpoints(tmp_path) == ["checkpoint-5"]
    assert run.state.best_global_step == 5 and run.state.best_model_checkpoint == str(tmp_path / "checkpoint-5")


def test_rotation_without_best_model_keeps_the_newest(peer, tmp_path):
    trainer(peer, tmp_path, save_steps=5, save_total_limit=2).train()
    assert _checkpoints(tmp_path) == ["checkpoint-20", f"checkpoint-{STEPS}"]


def test_resume_from_checkpoint_true_takes_the_newest_and_ends_as_the_uninterrupted_run(peer, tmp_path):
    full = trainer(peer, tmp_path / "full", save_steps=5, logging_steps=5)
    full.train()
    # a run that stopped after checkpoint-15 (the newest of its output_dir)
    os.makedirs(tmp_path / "cut")
    for name in ("checkpoint-5", "checkpoint-15", "checkpoint-10"):
        os.rename(tmp_path / "full" / name, tmp_path / "cut" / name)
    log = EventLog()
    resumed = trainer(peer, tmp_path / "cut", save_steps=5, logging_steps=5, callbacks=[log])
    resumed.train(resume_from_checkpoint=True)
    assert log.steps_at_train_begin == [15]
    assert log.names().count("on_step_begin") == STEPS - 15
    assert weights(resumed.model) == weights(full.model)  # same data order, same RNG: bit for bit
    assert resumed.state.global_step == STEPS and resumed.state.epoch == 3.0
    # the log history carries on from the checkpoint's: the same losses at the same steps
    losses = [(e["step"], e["loss"]) for e in resumed.state.log_history if "loss" in e]
    assert losses == [(e["step"], e["loss"]) for e in full.state.log_history if "loss" in e]


@pytest.mark.parametrize("variant", ["accumulation", "frozen"])
def test_a_resume_mid_epoch_ends_as_the_uninterrupted_run(peer, tmp_path, variant):
    """Gradient accumulation (4 rows a micro-batch, 2 a step: the same 8 a step) and a frozen parameter."""
    kwargs = dict(save_steps=5, logging_steps=5)
    if variant == "accumulation":
        kwargs.update(per_device_train_batch_size=4, gradient_accumulation_steps=2)

    def model():
        built = regression_model(a=0.5)
        if variant == "frozen":
            built.a.requires_grad_(False)
        return built

    full = trainer(peer, tmp_path, model=model(), **kwargs)
    full.train()
    resumed = trainer(peer, tmp_path, model=model(), **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-10"))  # step 10 of 24: in the second epoch
    assert weights(resumed.model) == weights(full.model)
    if variant == "frozen":
        assert weights(resumed.model)[0] == 0.5


@pytest.mark.peer_difference("use-cpu")
def test_stock_training_arguments_keep_every_value(peer, tmp_path):
    import transformers

    given = transformers.TrainingArguments(str(tmp_path), learning_rate=3e-4, warmup_steps=7, save_total_limit=3,
                                           lr_scheduler_type="cosine", label_smoothing_factor=0.2, seed=5,
                                           report_to=[], eval_strategy="steps", eval_steps=3)  # fmt: skip
    run = peer.Trainer(regression_model(), given, train_dataset=RegressionData(), eval_dataset=RegressionData(8))
    assert isinstance(run.args, peer.TrainingArguments)
    expected = given.to_dict()
    if not peer.stock and not torch.accelerator.is_available():
        # docs/drop-in.md#use-cpu; stock's own use_cpu rule then turns pinned memory off
        expected.update(use_cpu=True, dataloader_pin_memory=False)
    seen = run.args.to_dict()
    for key, value in expected.items():
        assert seen[key] == value, key


def test_resume_errors(peer, tmp_path):
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        trainer(peer, tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-5-bogus"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer(peer, tmp_path).train(resume_from_checkpoint=True)


class OutOfMemoryAtBatch(TrainerCallback):
    """Raises the CUDA out-of-memory error while the batch size is ``limit`` or more, as a too-large batch would."""

    def __init__(self, limit: int):
        self.limit = limit

    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= self.limit:
            raise RuntimeError("CUDA out of memory.")


def test_auto_find_batch_size_lowers_the_batch_until_it_fits_and_a_resume_keeps_it(peer, tmp_path):
    # accelerate lowers the batch size by 10 % after each out-of-memory error: 16 fails, int(16 * 0.9) = 14 fits
    kwargs = dict(per_device_train_batch_size=16, auto_find_batch_size=True, save_steps=4, max_steps=8)
    run = trainer(peer, tmp_path, callbacks=[OutOfMemoryAtBatch(16)], **kwargs)
    run.train()
    assert run.state.train_batch_size == 14
    assert TrainerState.load_from_json(tmp_path / "checkpoint-4" / "trainer_state.json").train_batch_size == 14
    resumed = trainer(peer, tmp_path, callbacks=[OutOfMemoryAtBatch(16)], **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed.state.train_batch_size == 14 and resumed.state.global_step == 8
    assert weights(resumed.model) == weights(run.model)


# what stock writes into a checkpoint of a plain (non-DeepSpeed) run; hf-ext adds its completion marker
STOCK_CHECKPOINT_FILES = ["model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json",
                          "training_args.bin"]  # fmt: skip
# save_only_model: no optimizer, scheduler or RNG state
MODEL_ONLY_FILES = ["model.safetensors", "trainer_state.json", "training_args.bin"]


class PlainRegression(torch.nn.Module):
    """The regression model as a plain ``nn.Module``: no config, no ``save_pretrained``."""

    forward = RegressionModel.forward

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(0.0)), torch.nn.Parameter(torch.tensor(0.0))


@pytest.mark.peer_difference("checkpoint-marker")
@pytest.mark.parametrize("kind", ["pretrained", "plain", "model only"])
def test_a_checkpoint_and_a_saved_model_hold_the_stock_files(peer, tmp_path, kind):
    run = trainer(peer, tmp_path, model=PlainRegression() if kind == "plain" else regression_model(),
                  save_steps=STEPS, save_only_model=kind == "model only")  # fmt: skip
    run.train()
    run.save_model(str(tmp_path / "final"))
    config = [] if kind == "plain" else ["config.json"]
    checkpoint = tmp_path / f"checkpoint-{STEPS}"
    stock_files = STOCK_CHECKPOINT_FILES if kind != "model only" else MODEL_ONLY_FILES
    files = sorted([*stock_files, *config] + ([] if peer.stock else ["hf_ext_checkpoint.json"]))
    assert sorted(os.listdir(checkpoint)) == files
    assert sorted(os.listdir(tmp_path / "final")) == sorted([*config, "model.safetensors", "training_args.bin"])
    if not peer.stock:
        marker = json.loads((checkpoint / "hf_ext_checkpoint.json").read_text())
        assert marker["complete"] is True and marker["global_step"] == STEPS
    # the weights files load into a fresh model as the trained weights; the state file is the trainer's state
    for folder in (checkpoint, tmp_path / "final"):
        fresh = regression_model()
        fresh.load_state_dict(load_file(folder / "model.safetensors"))
        assert weights(fresh) == weights(run.model)
    state = TrainerState.load_from_json(checkpoint / "trainer_state.json")
    assert state.global_step == STEPS and state.max_steps == STEPS and state.num_train_epochs == 3
    args = torch.load(checkpoint / "training_args.bin", weights_only=False)
    assert isinstance(args, peer.TrainingArguments) and args.save_steps == STEPS
