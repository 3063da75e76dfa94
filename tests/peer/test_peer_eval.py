"""Evaluation and prediction as a stock Trainer user sees them: metrics and their names, predictions gathered
across batches of different lengths, tuple outputs, and ``Seq2SeqTrainer``'s ``predict_with_generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration

from .regression import RegressionConfig, RegressionData, RegressionModel, trainer, weights


def almost_accuracy(prediction) -> dict:
    predictions, labels = prediction
    return {"accuracy": float(np.mean(np.abs(predictions - labels) <= 0.25))}


def test_evaluate_and_predict_name_their_metrics_and_predict_every_row(peer, tmp_path):
    run = trainer(peer, tmp_path, max_steps=16, save_strategy="no")
    run.compute_metrics = almost_accuracy
    run.train()
    a, b = weights(run.model)
    rows = RegressionData(30, seed=9)  # 30 rows, batches of 8: the last batch has 6
    expected = a * rows.x + b
    metrics = run.evaluate(rows, metric_key_prefix="heldout")
    assert set(metrics) == {"heldout_loss", "heldout_accuracy", "heldout_runtime", "heldout_samples_per_second",
                            "heldout_steps_per_second", "epoch"}  # fmt: skip
    assert metrics["heldout_loss"] == pytest.approx(np.mean((expected - rows.y) ** 2), rel=1e-5)
    assert metrics["heldout_accuracy"] == pytest.approx(np.mean(np.abs(expected - rows.y) <= 0.25))
    output = run.predict(rows)
    np.testing.assert_allclose(output.predictions, expected, rtol=1e-6)
    np.testing.assert_array_equal(output.label_ids, rows.y)
    assert output.metrics["test_loss"] == pytest.approx(metrics["heldout_loss"])
    assert set(output.metrics) == {"test_loss", "test_accuracy", "test_runtime", "test_samples_per_second",
                                   "test_steps_per_second"}  # fmt: skip


class VariableLength(torch.utils.data.Dataset):
    """Rows of 1 to 5 values; rows of one batch have the same length, batches differ."""

    def __init__(self, lengths=(3, 3, 5, 5, 1, 1, 4)):
        rng = np.random.default_rng(1)
        self.x = [rng.normal(size=n).astype(np.float32) for n in lengths]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": 2 * self.x[i]}


class TwoOutputs(RegressionModel):
    """``(loss, a·x + b, x · 10)``: predictions come back as a tuple of two arrays."""

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        return (nn.functional.mse_loss(y, labels), y, 10 * input_x)


def test_predictions_of_batches_of_different_lengths_are_padded_with_minus_100(peer, tmp_path):
    model = TwoOutputs(RegressionConfig(a=1.5, b=0.5))
    run = trainer(peer, tmp_path, model=model, per_device_eval_batch_size=2)
    rows = VariableLength()
    output = run.predict(rows)
    first, second = output.predictions
    assert first.shape == second.shape == output.label_ids.shape == (7, 5)
    for i, x in enumerate(rows.x):
        n = len(x)
        np.testing.assert_allclose(first[i, :n], 1.5 * x + 0.5, rtol=1e-6)
        np.testing.assert_allclose(second[i, :n], 10 * x, rtol=1e-6)
        np.testing.assert_allclose(output.label_ids[i, :n], 2 * x, rtol=1e-6)
        assert (first[i, n:] == -100).all() and (output.label_ids[i, n:] == -100).all()


@pytest.fixture(scope="module")
def seq2seq_rows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["hello there", "how are you today?", "i like to read books", "what is your favourite food"]
    rows = [dict(tokenizer(t), labels=tokenizer(t[::-1])["input_ids"]) for t in texts]
    return tokenizer, rows


@pytest.mark.peer_difference("bleu-eval")
def test_seq2seq_predict_with_generate_returns_generate_s_tokens(peer, tmp_path, tiny_model_dir, seq2seq_rows):
    from transformers import DataCollatorForSeq2Seq

    tokenizer, rows = seq2seq_rows
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    args = peer.Seq2SeqTrainingArguments(str(tmp_path), report_to=[], predict_with_generate=True, disable_tqdm=True,
                                         per_device_eval_batch_size=2, generation_max_length=24,
                                         dataloader_pin_memory=False)  # fmt: skip
    run = peer.Seq2SeqTrainer(model, args, data_collator=DataCollatorForSeq2Seq(tokenizer, model),
                              processing_class=tokenizer)  # fmt: skip
    output = run.predict(rows)
    # oracle: generate() itself on each padded batch of two, greedy, up to 24 tokens
    collate = DataCollatorForSeq2Seq(tokenizer, model)
    for start in (0, 2):
        batch = collate(rows[start : start + 2])
        with torch.no_grad():
            generated = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       max_length=24)  # fmt: skip
        for i, tokens in enumerate(generated.tolist()):
            predicted = [t for t in output.predictions[start + i].tolist() if t != -100]
            assert predicted[: len(tokens)] == tokens
    assert output.metrics["test_loss"] > 0
    # an evaluation reports the stock metrics; hf-ext adds the BLEU eval's (docs/drop-in.md#bleu-eval)
    metrics = run.evaluate(rows)
    stock_keys = {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
    bleu_keys = set() if peer.stock else {"eval_bleu", "eval_chrf", "eval_gen_len"}
    assert stock_keys | bleu_keys <= set(metrics) and not {"eval_bleu"} & (set(metrics) - bleu_keys)
