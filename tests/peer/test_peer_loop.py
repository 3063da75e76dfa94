"""The training loop as a stock Trainer user sees it: callbacks (which, in what order, with what), the trainer state
and its log history, a custom ``compute_loss``, iterable datasets, ``model_init`` and label smoothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

from .conftest import classes
from .regression import EventLog, RegressionData, RegressionStream, regression_model, trainer, weights

STEPS = 24  # 64 rows, 8 a step, 3 epochs
LOOP = dict(logging_steps=5, eval_strategy="steps", eval_steps=10, save_steps=10)

# keyword arguments every event gets, and the extra one of the events that carry a payload
CONTEXT = ("eval_dataloader", "lr_scheduler", "model", "optimizer", "processing_class", "train_dataloader")
PAYLOAD = {"on_log": "logs", "on_evaluate": "metrics", "on_predict": "metrics"}


def test_callbacks_get_every_event_in_order_with_their_arguments(peer, tmp_path):
    log = EventLog()
    trainer(peer, tmp_path, callbacks=[log], **LOOP).train()
    names = log.names()
    assert names[:4] == ["on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin"]
    assert names[-1] == "on_train_end"
    counts = {name: names.count(name) for name in set(names)}
    assert counts["on_step_begin"] == counts["on_step_end"] == counts["on_optimizer_step"] == STEPS
    assert counts["on_epoch_begin"] == counts["on_epoch_end"] == 3
    # evaluations and saves at 10, 20 and the last step, 24
    assert counts["on_evaluate"] == 3 and counts["on_save"] == 3
    assert counts["on_log"] == 4 + 3 + 1  # losses at 5..20, the three evaluations, the train summary
    assert counts["on_prediction_step"] == 3 * 4  # 32 evaluation rows, 8 a batch
    # within a step: begin, pre-optimizer, optimizer, end; after step 10: its loss, the evaluation's batches, the
    # evaluation's metrics logged, the evaluation event, the save
    first_step = names[names.index("on_step_begin") : names.index("on_step_end") + 1]
    assert first_step == ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    step_10_end = [i for i, name in enumerate(names) if name == "on_step_end"][9]
    after = names[step_10_end + 1 : step_10_end + 9]
    assert after == ["on_log", *["on_prediction_step"] * 4, "on_log", "on_evaluate", "on_save"]
    for name, kwargs in log.events:
        extra = (PAYLOAD[name],) if name in PAYLOAD else ()
        assert kwargs == tuple(sorted(CONTEXT + extra)), name


@pytest.mark.peer_difference("callbacks")
def test_the_callback_list_and_its_edits(peer, tmp_path):
    run = trainer(peer, tmp_path, callbacks=[EventLog])
    stock_list = [DefaultFlowCallback, EventLog, PrinterCallback]  # disable_tqdm: printed logs, no progress bar
    added = [] if peer.stock else _hf_ext_callbacks()
    assert [type(cb) for cb in run.callback_handler.callbacks] == stock_list + added
    run.remove_callback(PrinterCallback)
    run.add_callback(ProgressCallback())
    assert [type(cb) for cb in run.callback_handler.callbacks] == [
        DefaultFlowCallback,
        EventLog,
        *added,
        ProgressCallback,
    ]
    popped = run.pop_callback(EventLog)
    assert isinstance(popped, EventLog) and EventLog not in [type(cb) for cb in run.callback_handler.callbacks]


def _hf_ext_callbacks() -> list[type]:
    # the callbacks hf-ext adds to every trainer (docs/drop-in.md#callbacks)
    from hf_ext.memory.measure import MemoryPlanCallback
    from hf_ext.preemption import PreemptionCallback
    from hf_ext.schedule import ResumedScheduleCallback

    return [MemoryPlanCallback, ResumedScheduleCallback, PreemptionCallback]


@pytest.mark.peer_sides("stock", "hf_ext")
@pytest.mark.peer_difference("memory-keys")
def test_hf_ext_gives_a_user_callback_the_events_and_state_stock_gives(tmp_path):
    runs = {}
    for side in ("stock", "hf_ext"):
        log = EventLog()
        run = trainer(classes(side), tmp_path / side, callbacks=[log], **LOOP)
        run.train()
        runs[side] = (log.events, run.state)
    assert runs["hf_ext"][0] == runs["stock"][0]
    stock_state, state = runs["stock"][1], runs["hf_ext"][1]
    # the measured memory peak joins the train summary (docs/drop-in.md#memory-keys); every other key is stock's
    assert state.log_history[-1]["memory_peak_gib"] > 0 and "train_loss" in state.log_history[-1]
    timing = ("_runtime", "_per_second")
    for ours, theirs in zip(state.log_history, stock_state.log_history, strict=True):
        assert {k: v for k, v in ours.items() if not k.endswith(timing) and not k.startswith("memory_")} == {
            k: v for k, v in theirs.items() if not k.endswith(timing)
        }
    for field in ("epoch", "global_step", "max_steps", "num_train_epochs", "total_flos", "train_batch_size",
                  "logging_steps", "eval_steps", "save_steps", "best_metric", "best_model_checkpoint"):  # fmt: skip
        assert getattr(state, field) == getattr(stock_state, field), field


def test_the_log_history_ends_with_the_train_summary(peer, tmp_path):
    run = trainer(peer, tmp_path, **LOOP)
    output = run.train()
    history = run.state.log_history
    assert [e["step"] for e in history if "loss" in e] == [5, 10, 15, 20]
    assert [e["step"] for e in history if "eval_loss" in e] == [10, 20, STEPS]
    summary = history[-1]
    assert summary["step"] == STEPS and summary["epoch"] == 3.0
    assert summary["train_loss"] == pytest.approx(output.training_loss) and output.global_step == STEPS
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"} <= set(summary)


class DoubledLossTrainerMixin:
    """A user's ``compute_loss``: twice the model's loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        return (2 * loss, outputs) if return_outputs else 2 * loss


def test_a_custom_compute_loss_is_what_trains_and_what_is_logged(peer, tmp_path):
    user_class = type("DoubledLossTrainer", (DoubledLossTrainerMixin, peer.Trainer), {})
    run = trainer(peer, tmp_path, trainer_class=user_class, max_steps=1, logging_steps=1, optim="sgd",
                  train_sampling_strategy="sequential", eval_strategy="no", learning_rate=0.01,
                  max_grad_norm=0)  # fmt: skip
    run.train()
    # step 1 sees rows 0..7 at a = b = 0: loss 2 * mean(y^2); SGD moves b by -lr * d/db = -lr * 2 * mean(-2y)
    data = RegressionData()
    x, y = data.x[:8].astype(np.float64), data.y[:8].astype(np.float64)
    assert run.state.log_history[0]["loss"] == pytest.approx(2 * np.mean(y**2), rel=1e-5)
    a, b = weights(run.model)
    assert a == pytest.approx(0.01 * 4 * np.mean(x * y), rel=1e-5)
    assert b == pytest.approx(0.01 * 4 * np.mean(y), rel=1e-5)


def test_an_iterable_dataset_trains_for_max_steps_and_predicts_every_row(peer, tmp_path):
    run = trainer(peer, tmp_path, train_dataset=RegressionStream(), max_steps=10, save_strategy="no")
    run.train()
    assert run.state.global_step == 10 and run.state.max_steps == 10
    rows = RegressionStream(20, seed=3)
    predicted = run.predict(rows)
    a, b = weights(run.model)
    assert predicted.predictions.shape == (20,)
    np.testing.assert_allclose(predicted.predictions, a * rows.rows.x + b, rtol=1e-6)
    np.testing.assert_array_equal(predicted.label_ids, rows.rows.y)


def test_model_init_builds_a_fresh_model_for_each_train(peer, tmp_path):
    run = trainer(peer, tmp_path, model_init=lambda: regression_model(), save_strategy="no", seed=11)
    run.train()
    first = weights(run.model)
    run.train()  # model_init again: the same start, the same seed, the same end
    assert weights(run.model) == first
    given = trainer(peer, tmp_path, model=regression_model(), save_strategy="no", seed=11)
    given.train()
    assert weights(given.model) == first


class TokenClassifierConfig(PreTrainedConfig):
    model_type = "peer-token-classifier"

    def __init__(self, vocab_size: int = 11, num_labels: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.num_labels = vocab_size, num_labels


class TokenClassifier(PreTrainedModel):
    """Embedding → labels per token; returns logits only, so the Trainer computes the (smoothed) loss."""

    config_class = TokenClassifierConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids, labels=None, **kwargs):
        return {"logits": self.embed(input_ids)}


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, n: int = 12):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 11, (n, 6), generator=g)
        self.labels = torch.randint(0, 5, (n, 6), generator=g)
        self.labels[:, -2:] = -100  # ignored positions

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def test_label_smoothing_gives_torchs_smoothed_cross_entropy(peer, tmp_path):
    torch.manual_seed(0)
    model = TokenClassifier(TokenClassifierConfig())
    rows = TokenRows()
    run = trainer(peer, tmp_path, model=model, label_smoothing_factor=0.1, per_device_eval_batch_size=12)
    metrics = run.evaluate(rows)
    with torch.no_grad():
        logits = model.embed(rows.ids)
    expected = nn.functional.cross_entropy(logits.reshape(-1, 5), rows.labels.reshape(-1), label_smoothing=0.1,
                                           ignore_index=-100)  # fmt: skip
    assert metrics["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_a_logits_only_model_without_label_smoothing_has_no_loss(peer, tmp_path):
    # sanity of the oracle above: without smoothing, the Trainer has no loss for a logits-only model
    run = trainer(peer, tmp_path, model=TokenClassifier(TokenClassifierConfig()), train_dataset=TokenRows(),
                  max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match="did not return a loss"):
        run.train()
