"""A model that averages its own micro-batch (BlenderBot) trains the same however its global batch is split.

One process, one optimizer step of 16 rows of varied length, split as 16 x 1, 8 x 2 and 4 x 4 (micro-batch x
gradient accumulation), with the padded ``batch_rebalance`` sampler that puts long rows into small micro-batches. The
accumulation split stands for the world size here: every micro-batch of a step contributes to the gradient the same
way whether a rank or an accumulation step computes it (2-rank runs against 1-rank ones:
tests/distributed/test_resume_world_size.py).

Oracle: the 16 x 1 step, where there is one micro-batch and the model's own mean is the mean over the global batch.
The step is SGD at learning rate 1, so the weights move by the gradient itself (Adam's first step, g / (|g| + eps),
would magnify the rounding of gradients near eps). Tolerance: the splits compute the same token losses with other
padded shapes and sum them in another order; measured with AVX512 and AVX2 kernels, 1 and 2 threads: at most 1.7e-8
apart on gradients of at most 0.072 (2 fp32 ulps there). 1e-7 is 6x that. Stock transformers, which averages the
per-micro-batch means, lands 0.05 away on the same splits: the test fails without the fix.
"""

from __future__ import annotations

import pytest
import torch
from transformers import BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq
from transformers import Seq2SeqTrainer as StockTrainer
from transformers import Seq2SeqTrainingArguments as StockArguments

import hf_ext
from hf_ext.loss import global_token_mean_loss

pytestmark = pytest.mark.slow

TOLERANCE = 1e-7
SPLITS = ((16, 1), (8, 2), (4, 4))


def varied_rows(n: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        n_in, n_out = int(torch.randint(3, 30, (), generator=g)), int(torch.randint(1, 20, (), generator=g))
        rows.append({"input_ids": torch.randint(4, vocab, (n_in,), generator=g).tolist(),
                     "labels": torch.randint(4, vocab, (n_out,), generator=g).tolist() + [2]})  # fmt: skip
    return rows


def one_step(model_dir, tokenizer, out, micro: int, accum: int, stock: bool = False) -> dict[str, torch.Tensor]:
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir, dropout=0.0, attention_dropout=0.0,
                                                               activation_dropout=0.0)  # fmt: skip
    settings = dict(output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                    max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", report_to=[], save_strategy="no",
                    disable_tqdm=True, seed=0, train_sampling_strategy="batch_rebalance", use_cpu=True)  # fmt: skip
    args_class, trainer_class = (StockArguments, StockTrainer) if stock else (hf_ext.Seq2SeqTrainingArguments,
                                                                             hf_ext.Seq2SeqTrainer)  # fmt: skip
    trainer = trainer_class(model=model, args=args_class(**settings), train_dataset=varied_rows(16, 96),
                            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))  # fmt: skip
    if not stock:
        assert trainer.compute_loss_func is global_token_mean_loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}  # SGD at lr 1: the gradient


def max_difference(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_the_accumulation_split_does_not_change_the_gradient(tiny_model_dir, tiny_tokenizer, tmp_path):
    oracle = one_step(tiny_model_dir, tiny_tokenizer, tmp_path / "oracle", 16, 1)
    stock_oracle = one_step(tiny_model_dir, tiny_tokenizer, tmp_path / "stock", 16, 1, stock=True)
    assert max_difference(oracle, stock_oracle) < TOLERANCE  # one micro-batch: the model's own mean is the global one
    for micro, accum in SPLITS[1:]:
        ours = one_step(tiny_model_dir, tiny_tokenizer, tmp_path / f"{micro}x{accum}", micro, accum)
        assert max_difference(ours, oracle) < TOLERANCE, (micro, accum)
        stock = one_step(tiny_model_dir, tiny_tokenizer, tmp_path / f"stock{micro}x{accum}", micro, accum, stock=True)
        assert max_difference(stock, oracle) > 1e4 * TOLERANCE, (micro, accum)  # the case the fix is for
