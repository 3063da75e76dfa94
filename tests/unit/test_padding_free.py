"""Padding-free batches (hf_ext.packing): a packed micro-batch computes what the padded one does, row by row.

Oracle: the same model on the padded batch ``DataCollatorForSeq2Seq`` makes (the stock path). Each row's loss (the
summed cross-entropy of its reply tokens, ``torch.nn.functional.cross_entropy`` on the logits) and that loss's gradient
with respect to every parameter must agree. Tolerance: float32 throughout, and the two batches reach the same sums
through matrix products of different shapes (one row of T tokens against B rows of the longest length), so they differ
in summation order only: a few ulps of the values summed. Measured on this model: the losses (up to 62) agree exactly,
the gradients (up to 4.3) within 9.5e-7 under SDPA and 1.5e-8 under eager attention; the bounds are rtol 1e-5 and atol
1e-6. A row that attended to another row's tokens would change by
orders of magnitude more (the positive control below shows it).

The sampler half: stock's ``BatchRebalanceSampler`` with a packed cost model must hand every optimizer step the same
rows on every world size (the property a resume on another world size relies on), balance tokens, and use the run's
seed.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
)
from transformers.trainer_pt_utils import BatchRebalanceSampler

import hf_ext
from hf_ext.packing import (
    LabelledLogitsCollator,
    PackedRebalanceSampler,
    labelled_logits_loss,
    padding_free_collator,
    run_sampler,
)

LENGTHS = [(9, 4), (23, 7), (5, 3), (31, 2), (14, 9)]  # (prompt, reply) tokens per row


def rows(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for prompt, reply in LENGTHS:
        ids = torch.randint(4, vocab, (prompt + reply,), generator=g).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * prompt + ids[prompt:]})
    return out


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model_and_rows(request, tiny_chat_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, attn_implementation=request.param).eval()
    model.config.use_cache = False  # what the Trainer sets from TrainingArguments.use_cache (False by default)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    return model, tokenizer, rows(model.config.vocab_size)


def row_losses(logits: torch.Tensor, labels: torch.Tensor, spans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Summed reply cross-entropy of each row; ``spans``: (batch index, first token, length). Logit t predicts t+1."""
    out = []
    for b, start, length in spans:
        lg, lb = logits[b, start : start + length - 1], labels[b, start + 1 : start + length]
        out.append(torch.nn.functional.cross_entropy(lg.float(), lb, ignore_index=-100, reduction="sum"))
    return out


def padded_forward(model, tokenizer, examples):
    batch = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(examples)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    spans = [(i, 0, len(e["input_ids"])) for i, e in enumerate(examples)]
    return row_losses(logits, batch["labels"], spans), logits, spans


def packed_forward(model, examples, position_ids=None):
    collator = padding_free_collator(model, DataCollatorForSeq2Seq(None, label_pad_token_id=-100))
    batch = collator(examples)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: the mask comes from positions
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"] if position_ids is None else
                   position_ids).logits  # fmt: skip
    starts = torch.tensor([0] + [len(e["input_ids"]) for e in examples]).cumsum(0).tolist()
    spans = [(0, s, len(e["input_ids"])) for s, e in zip(starts, examples)]
    return row_losses(logits, batch["labels"], spans), logits, spans


def test_packed_rows_have_the_padded_rows_losses_and_gradients(model_and_rows):
    model, tokenizer, examples = model_and_rows
    params = [p for p in model.parameters() if p.requires_grad]
    padded, _, _ = padded_forward(model, tokenizer, examples)
    packed, _, _ = packed_forward(model, examples)
    for i, (a, b) in enumerate(zip(padded, packed)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"row {i} loss")
        grads_a = torch.autograd.grad(a, params, retain_graph=True)
        grads_b = torch.autograd.grad(b, params, retain_graph=True)
        for p_a, p_b in zip(grads_a, grads_b):
            torch.testing.assert_close(p_b, p_a, rtol=1e-5, atol=1e-6, msg=f"row {i} gradient")
    # the labels the flattening made: no row's last token learns the next row's first one
    labelled = sum(len(e["input_ids"]) - p for e, (p, _) in zip(examples, LENGTHS))
    assert sum(int((torch.tensor(e["labels"]) != -100).sum()) for e in examples) == labelled


def test_no_token_attends_across_rows(model_and_rows):
    model, _, examples = model_and_rows
    _, logits, spans = packed_forward(model, examples)
    changed = [dict(e) for e in examples]
    changed[0] = dict(changed[0], input_ids=[4 + (t + 7) % 500 for t in examples[0]["input_ids"]])
    _, after, _ = packed_forward(model, changed)
    first = spans[0][2]
    assert not torch.allclose(after[0, :first], logits[0, :first])  # row 0 itself did change
    torch.testing.assert_close(after[0, first:], logits[0, first:], rtol=0, atol=0)  # no other row moved at all
    # positive control: positions that run on across the rows make one sequence, and then the later rows do move
    total = logits.shape[1]
    _, joined, _ = packed_forward(model, examples, torch.arange(total)[None])
    _, joined_after, _ = packed_forward(model, changed, torch.arange(total)[None])
    assert not torch.allclose(joined_after[0, first:], joined[0, first:])


def test_padding_free_refuses_what_it_cannot_stand_in_for(tiny_model_dir, tiny_chat_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    blenderbot = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="encoder-decoder.*Fix: padding_free=False"):
        padding_free_collator(blenderbot, None)
    chat = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    with pytest.raises(ValueError, match="DataCollatorForTokenClassification does more than pad"):
        padding_free_collator(chat, DataCollatorForTokenClassification(tokenizer))
    assert isinstance(padding_free_collator(chat, None), DataCollatorWithFlattening)


def test_a_cache_would_hide_the_row_boundaries_so_the_trainer_refuses_it(model_and_rows, tmp_path):
    model, tokenizer, examples = model_and_rows
    padded, _, _ = padded_forward(model, tokenizer, examples)
    model.config.use_cache = True
    try:
        cached, _, _ = packed_forward(model, examples)
    finally:
        model.config.use_cache = False
    assert not torch.allclose(torch.stack(cached), torch.stack(padded))  # the later rows saw the earlier ones
    args = hf_ext.TrainingArguments(output_dir=str(tmp_path), padding_free=True, use_cache=True, report_to=[])
    with pytest.raises(ValueError, match="needs use_cache=False"):
        hf_ext.Trainer(model=model, args=args, processing_class=tokenizer)


def test_the_trainers_loss_and_gradients_match_the_stock_padded_trainers(model_and_rows, tmp_path):
    """End to end through ``compute_loss``: hf-ext's packed batch with logits only where a label follows against stock
    ``transformers.Trainer`` on the padded batch, the loss normalized by a global token count as in training."""
    model, tokenizer, examples = model_and_rows
    args = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    stock = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args), processing_class=tokenizer,
                                 data_collator=DataCollatorForSeq2Seq(tokenizer))  # fmt: skip
    ours = hf_ext.Trainer(model=model, args=hf_ext.TrainingArguments(**args, padding_free=True),
                          processing_class=tokenizer, data_collator=DataCollatorForSeq2Seq(tokenizer))  # fmt: skip
    assert isinstance(ours.data_collator, LabelledLogitsCollator) and ours.compute_loss_func is labelled_logits_loss
    params = [p for p in model.parameters() if p.requires_grad]
    labelled = sum(int((torch.tensor(e["labels"][1:]) != -100).sum()) for e in examples)
    for num_items in (torch.tensor(3 * labelled), None):  # training (a global count), evaluation (a mean)
        losses, grads = [], []
        for trainer in (stock, ours):
            batch = trainer.data_collator(examples)
            loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items)
            losses.append(loss)
            grads.append(torch.autograd.grad(loss, params))
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for g_stock, g_ours in zip(*grads):
            torch.testing.assert_close(g_ours, g_stock, rtol=1e-5, atol=1e-6)
    kept = ours.data_collator(examples)["logits_to_keep"]
    assert int(kept.sum()) == labelled  # one logit per labelled token, no more


def test_a_mixture_of_experts_keeps_its_router_loss(tmp_path):
    """A Mixtral with ``output_router_logits`` adds ``router_aux_loss_coef`` times its load-balancing loss to the
    cross-entropy. The padding-free trainer's loss must be the model's own: stock ``Trainer`` on the same packed batch,
    and the cross-entropy of the same model with the router term off plus that term (the model's ``aux_loss``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.5, use_cache=False)  # fmt: skip
    model = MixtralForCausalLM(config)
    examples = rows(config.vocab_size)
    args = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    stock = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args),
                                 data_collator=DataCollatorWithFlattening())  # fmt: skip
    ours = hf_ext.Trainer(model=model, args=hf_ext.TrainingArguments(**args, padding_free=True))
    assert isinstance(ours.data_collator, DataCollatorWithFlattening) and ours.compute_loss_func is None
    batch = DataCollatorWithFlattening()(examples)
    num_items = torch.tensor(int((batch["labels"] != -100).sum()))
    with torch.no_grad():
        loss = ours.compute_loss(model, ours.data_collator(examples), num_items_in_batch=num_items)
        expected = stock.compute_loss(model, batch, num_items_in_batch=num_items)
        outputs = model(**batch, num_items_in_batch=num_items)
        cross_entropy = model(**batch, num_items_in_batch=num_items, output_router_logits=False).loss
    router_term = config.router_aux_loss_coef * outputs.aux_loss
    assert router_term > 0.1  # about coef x top-k = 1 for a balanced router: a term the test would see go missing
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)  # the same forward on the same batch
    # the same sums, added in another grouping: float32 rounding of values near 5
    torch.testing.assert_close(loss, cross_entropy + router_term, rtol=1e-6, atol=1e-6)


def test_trainer_flattens_and_counts_every_token(tiny_chat_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    args = hf_ext.TrainingArguments(output_dir=str(tmp_path), padding_free=True, report_to=[],
                                    include_num_input_tokens_seen="non_padding")  # fmt: skip
    trainer = hf_ext.Trainer(model=model, args=args, processing_class=tokenizer,
                             data_collator=DataCollatorForSeq2Seq(tokenizer))  # fmt: skip
    assert isinstance(trainer.data_collator, DataCollatorWithFlattening)
    assert trainer.args.include_num_input_tokens_seen == "all"  # every packed token is a real one
    # a flattening collator of the user's own is kept, and the logits stay whole
    own = DataCollatorWithFlattening(return_seq_idx=True)
    trainer = hf_ext.Trainer(model=model, args=args, processing_class=tokenizer, data_collator=own)
    assert trainer.data_collator is own and trainer.compute_loss_func is None


# --- the sampler ----------------------------------------------------------------------------------------------------

DATA_LENGTHS = [int(x) for x in torch.randint(8, 128, (96,), generator=torch.Generator().manual_seed(1))]


def steps(world: int, accum: int, global_batch: int = 16, epoch: int = 0, seed: int = 7) -> list[list[list[int]]]:
    """Per optimizer step, per (rank, accumulation slot): the rows a packed sampler hands out."""
    per_rank = []
    for rank in range(world):
        sampler = PackedRebalanceSampler(lengths=DATA_LENGTHS, effective_batch_size=global_batch, dp_size=world,
                                         grad_accum=accum, rank=rank, seed=seed)  # fmt: skip
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    n_steps = len(per_rank[0]) // accum
    return [[per_rank[r][s * accum + a] for r in range(world) for a in range(accum)] for s in range(n_steps)]


def test_every_world_size_trains_each_step_on_the_same_rows():
    layouts = {(1, 4): steps(1, 4), (2, 2): steps(2, 2), (4, 1): steps(4, 1), (2, 1): steps(2, 1)}
    sets = {k: [sorted(i for mb in step for i in mb) for step in v] for k, v in layouts.items()}
    reference = sets[(2, 2)]
    assert all(s == reference for s in sets.values())
    assert sorted(i for step in reference for i in step) == list(range(len(DATA_LENGTHS)))  # each row once an epoch
    assert steps(2, 2, epoch=1) != steps(2, 2, epoch=0)  # a new order each epoch


def test_packed_micro_batches_carry_balanced_tokens():
    def spread(step):
        tokens = [sum(DATA_LENGTHS[i] for i in mb) for mb in step]
        return max(tokens) / min(tokens)

    packed = steps(2, 2)
    assert all(len(mb) >= 1 for step in packed for mb in step)
    assert max(spread(step) for step in packed) < 1.1  # the largest micro-batch within 10 % of the smallest
    # stock's cost model (padded size) on the same data: its micro-batches' token counts lie much further apart
    stock = [list(BatchRebalanceSampler(lengths=DATA_LENGTHS, effective_batch_size=16, dp_size=2, grad_accum=2,
                                        rank=r, seed=7)) for r in range(2)]  # fmt: skip
    stock_steps = [[stock[r][s * 2 + a] for r in range(2) for a in range(2)] for s in range(len(packed))]
    assert min(spread(step) for step in stock_steps) > max(spread(step) for step in packed)


def test_the_stock_sampler_gets_the_runs_seed_and_the_packed_cost(tmp_path):
    stock = BatchRebalanceSampler(lengths=DATA_LENGTHS, effective_batch_size=16, dp_size=2, grad_accum=2)
    padded = hf_ext.TrainingArguments(output_dir=str(tmp_path), report_to=[], seed=3)
    mine = run_sampler(padded, stock)
    assert type(mine) is BatchRebalanceSampler and mine.seed == 3 and list(mine) != list(stock)
    packed = run_sampler(hf_ext.TrainingArguments(output_dir=str(tmp_path), report_to=[], seed=3, data_seed=5,
                                                  padding_free=True), stock)  # fmt: skip
    assert type(packed) is PackedRebalanceSampler and packed.seed == 5
    other = torch.utils.data.RandomSampler(range(4))
    assert run_sampler(padded, other) is other


def test_group_by_length_is_stocks_order_over_the_global_batch_drawn_again_per_epoch(tmp_path):
    """Stock's LengthGroupedSampler (grouped by micro-batch x accumulation, torch's global generator) becomes stock's
    order grouped by the global batch from the run's seed and epoch: a resumed epoch draws its order again."""
    from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

    args = hf_ext.TrainingArguments(output_dir=str(tmp_path), report_to=[], seed=3, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=3)  # fmt: skip
    mine = run_sampler(args, LengthGroupedSampler(6, lengths=DATA_LENGTHS))
    assert mine.batch_size == 2 * 3 * args.world_size and sorted(mine) == list(range(len(DATA_LENGTHS)))
    assert list(mine) == get_length_grouped_indices(DATA_LENGTHS, 6, generator=torch.Generator().manual_seed(3))
    again = run_sampler(args, LengthGroupedSampler(6, lengths=DATA_LENGTHS))
    mine.set_epoch(1)
    again.set_epoch(1)
    assert (
        list(mine)
        == list(again)
        != get_length_grouped_indices(DATA_LENGTHS, 6, generator=torch.Generator().manual_seed(3))
    )
