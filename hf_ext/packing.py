"""Padding-free training: a micro-batch's rows concatenated into one, each with its own positions and attention.

transformers does the work. ``DataCollatorWithFlattening`` concatenates the rows of a micro-batch, restarts
``position_ids`` at 0 for each row and puts a ``-100`` label where two rows meet (so no row learns to predict the next
row's first token); a decoder-only model whose masks come from ``transformers.masking_utils`` finds the row boundaries
in ``position_ids`` when no ``attention_mask`` and no cache are given (the Trainer sets the model's ``use_cache`` to
``TrainingArguments.use_cache``, ``False`` by default; hf-ext refuses ``True`` with ``padding_free``) and builds a
block-diagonal causal mask (SDPA, eager, flex; flash-attention reads the same boundaries). The loss stays on the labelled tokens, normalized by their count over the
whole global batch as in a padded run.

What hf-ext adds:

* the switch, ``padding_free`` (:class:`PaddingFreeArguments`): the trainer's padding collator is replaced by
  ``DataCollatorWithFlattening`` for training and evaluation, and a model that cannot take packed rows is refused in
  one line. An encoder-decoder (BlenderBot) cannot: its encoder's positions come from the padded shape
  (``BlenderbotLearnedPositionalEmbedding`` takes no ``position_ids``) and its masks from ``attention_mask`` only, so
  rows packed into one would attend to each other; ``train_sampling_strategy="batch_rebalance"`` cuts its padding
  instead;
* logits only where a label follows: the loss uses no other position, and the vocabulary projection is a large share
  of a small model's step (SmolLM2-135M: 28M of its 135M parameters, and a 49k-wide softmax per position). The
  collator (:class:`LabelledLogitsCollator`) passes transformers' own ``logits_to_keep`` as a boolean mask, the
  model projects those positions alone, and :func:`labelled_logits_loss` (the Trainer's public ``compute_loss_func``)
  takes the cross-entropy there, normalized as the model's own loss is. Only where nothing else reads the logits (no
  ``compute_metrics``, ``compute_loss_func`` or label smoothing), the model's ``forward`` takes ``logits_to_keep``
  and its loss is the cross-entropy alone: a mixture-of-experts model with ``output_router_logits`` adds its router's
  auxiliary loss, and keeps its own loss (:func:`hf_ext.loss.adds_router_loss`);
* the cost :class:`PackedRebalanceSampler` balances: stock's ``BatchRebalanceSampler`` prices a micro-batch by its
  padded size (rows × longest row), a packed one costs its tokens (plus attention's quadratic term per row), so with
  ``padding_free`` each rank and accumulation step gets about the same number of real tokens;
* the run's seed for that sampler (stock builds it with its default seed, 42, whatever ``seed``/``data_seed`` say).

The sampler cuts every global batch out of one seeded permutation of the dataset (``seed + epoch``) and only then
splits it over ranks and accumulation steps, so an optimizer step trains on the same rows on every world size, and a
resume on another world size (hf-ext keeps the global batch) sees each row once.
"""

from __future__ import annotations

import heapq
import inspect
import logging
from dataclasses import dataclass, field

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, DataCollatorWithPadding
from transformers.data.data_collator import DefaultDataCollator, default_data_collator
from transformers.trainer_pt_utils import BatchRebalanceSampler, LengthGroupedSampler, get_length_grouped_indices

from .batching import args_layout
from .loss import adds_router_loss
from .model_info import base_model_of

logger = logging.getLogger(__name__)

#: the collators ``padding_free`` stands in for: they only pad, which flattening makes unnecessary
PADDING_COLLATORS = (DataCollatorWithPadding, DataCollatorForSeq2Seq, DefaultDataCollator)


@dataclass(kw_only=True)
class PaddingFreeArguments:
    """The padding-free field of :class:`hf_ext.TrainingArguments` and :class:`hf_ext.Seq2SeqTrainingArguments`
    (TRL's configs have their own ``padding_free``, which TRL's trainers implement).

    Args:
        padding_free (`bool`, defaults to `False`):
            Concatenate each micro-batch's rows into one without padding (``DataCollatorWithFlattening``), each row
            keeping its own positions and attention; decoder-only models. With
            ``train_sampling_strategy="batch_rebalance"`` every rank and accumulation step gets about the same number
            of tokens.
    """

    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Concatenate each micro-batch's rows without padding (DataCollatorWithFlattening), each row keeping "
            "its own positions and attention (decoder-only models)."
        },
    )


class PackedRebalanceSampler(BatchRebalanceSampler):
    """``BatchRebalanceSampler`` for packed micro-batches: a group of rows costs its tokens, not its padded size, and
    the groups are filled longest row first, each row joining the cheapest group so far (stock cuts the sorted rows
    into contiguous runs, which minimizes padding but balances packed tokens poorly)."""

    def _row_cost(self, length: int) -> float:
        # a packed micro-batch computes every token once and attends within each row
        return length + self.QUADRATIC_COST_COEF * length * length

    def _group_cost(self, group):
        return float(sum(self._row_cost(length) for _, length in group))  # group: (index, length) pairs

    def _balance_groups(self, sorted_pairs):
        groups_count = self.dp_size * self.grad_accum
        if len(sorted_pairs) < groups_count:
            raise ValueError(
                f"{len(sorted_pairs)} rows cannot give each of the {groups_count} micro-batches of a step one. "
                "Fix: a larger global batch, or fewer ranks or accumulation steps."
            )
        groups = [[] for _ in range(groups_count)]
        heap = [(0.0, g) for g in range(groups_count)]
        for pair in sorted_pairs:  # sorted longest first, identically on every rank
            cost, g = heapq.heappop(heap)
            groups[g].append(pair)
            heapq.heappush(heap, (cost + self._row_cost(pair[1]), g))
        return groups


class LabelledLogitsCollator(DataCollatorWithFlattening):
    """``DataCollatorWithFlattening`` that also asks the model for logits only at the positions followed by a label
    (``logits_to_keep``, a boolean mask: transformers then returns them flattened, in order)."""

    def __call__(self, features, return_tensors=None, separator_id=None):
        batch = super().__call__(features, return_tensors, separator_id)
        labels = batch["labels"]
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[:, :-1] = labels[:, 1:] != -100  # the logit at t predicts the label at t + 1
        batch["logits_to_keep"] = keep
        return batch


def labelled_logits_loss(outputs, labels, num_items_in_batch=None):
    """The causal-LM loss of logits :class:`LabelledLogitsCollator` kept: the summed cross-entropy over the labelled
    tokens divided by ``num_items_in_batch`` (the labelled tokens of the whole global batch), else their mean; what
    transformers' ``ForCausalLMLoss`` computes from all logits."""
    logits = outputs["logits"]
    targets = labels[:, 1:][labels[:, 1:] != -100].to(logits.device)
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(logits.float(), targets)
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def takes_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(base_model_of(model).forward).parameters


class GlobalLengthGroupedSampler(LengthGroupedSampler):
    """Stock's ``group_by_length`` order (``get_length_grouped_indices``: a permutation cut into mega-batches, each
    sorted by length) grouped by the global batch, from the run's seed and the epoch. Stock groups by one rank's
    micro-batch x accumulation and draws from torch's global generator, so 1 rank and 2 ranks at the same global batch
    train on other rows; here every world size at that global batch cuts the same rows into its optimizer steps (the
    rows of a global batch still have similar lengths), and a resume draws its epoch's order again."""

    def __init__(self, global_batch: int, lengths: list[int], seed: int):
        super().__init__(global_batch, lengths=lengths)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


def run_sampler(args, sampler):
    """The train sampler hf-ext uses in place of the stock one ``sampler``: stock's ``BatchRebalanceSampler``
    rebuilt with the run's seed, and pricing packed micro-batches when ``padding_free`` is on; stock's
    ``LengthGroupedSampler`` grouped by the global batch from the run's seed (:class:`GlobalLengthGroupedSampler`);
    any other unchanged."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    if type(sampler) is LengthGroupedSampler:
        global_batch = args.train_batch_size * args.gradient_accumulation_steps * args_layout(args).dp
        return GlobalLengthGroupedSampler(global_batch, sampler.lengths, seed)
    if type(sampler) is not BatchRebalanceSampler:
        return sampler
    cls = PackedRebalanceSampler if getattr(args, "padding_free", False) else BatchRebalanceSampler
    return cls(
        lengths=sampler.lengths,
        effective_batch_size=sampler.effective_batch_size,
        dp_size=sampler.dp_size,
        grad_accum=sampler.grad_accum,
        shuffle=sampler.shuffle,
        seed=seed,
        rank=sampler.rank,
        drop_last=sampler.drop_last,
    )


def refuse_split_sequences(padding_free: bool, layout) -> None:
    """``padding_free`` with sequence or context parallelism (a :class:`hf_ext.batching.Layout`), refused: the packed
    row would be split across ranks, and there the row boundaries do not hold (Ulysses attends over the gathered
    sequence with SDPA's mask, not the rows' positions; context parallelism drops the attention mask altogether)."""
    if padding_free and (layout.sp > 1 or layout.cp > 1):
        kind = (
            f"sequence parallelism (sp_size {layout.sp})"
            if layout.sp > 1
            else f"context parallelism (cp_size {layout.cp})"
        )
        raise ValueError(
            f"padding_free=True with {kind}: the packed rows would attend to each other once the sequence is split "
            "across ranks. Fix: padding_free=False (train_sampling_strategy='batch_rebalance' cuts the padding)."
        )


def padding_free_collator(model, collator):
    """``DataCollatorWithFlattening`` standing in for ``collator``, or a ``ValueError`` saying why it cannot."""
    if isinstance(collator, DataCollatorWithFlattening):
        return collator
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"padding_free=True needs a decoder-only model, and {type(model).__name__} is an encoder-decoder (its "
            "encoder takes positions and masks from the padded shape). Fix: padding_free=False, with "
            'train_sampling_strategy="batch_rebalance" to cut the padding.'
        )
    if collator is not None and collator is not default_data_collator and not isinstance(collator, PADDING_COLLATORS):
        raise ValueError(
            f"padding_free=True replaces the data collator with DataCollatorWithFlattening, and {type(collator).__name__} "
            "does more than pad. Fix: pass no data_collator, or padding_free=False."
        )
    return DataCollatorWithFlattening()


def enable_on_trainer(trainer) -> None:
    """With ``padding_free`` on, the trainer's collator becomes ``DataCollatorWithFlattening`` (unless the trainer
    flattens batches itself, as TRL's do) and ``include_num_input_tokens_seen="non_padding"`` counts every token."""
    args = trainer.args
    if not getattr(args, "padding_free", False):
        return
    if args.use_cache:
        raise ValueError(
            "padding_free=True needs use_cache=False: a model that starts a cache does not look for row boundaries in "
            "position_ids (transformers.masking_utils), and packed rows would attend to each other. Fix: "
            "use_cache=False (the default)."
        )
    if trainer.collates_padding_free:
        given = trainer.data_collator
        trainer.data_collator = padding_free_collator(trainer.model, given)
        labelled_only = (
            trainer.data_collator is not given  # a flattening collator of the user's own is kept as it is
            and trainer.compute_loss_func is None
            and trainer.compute_metrics is None
            and trainer.label_smoother is None
            and takes_logits_to_keep(trainer.model)
            and not adds_router_loss(trainer.model)
        )
        if labelled_only:
            trainer.data_collator = LabelledLogitsCollator()
            trainer.compute_loss_func = labelled_logits_loss
        logger.info(
            "Padding-free: each micro-batch is one row of concatenated examples (DataCollatorWithFlattening)"
            + (", logits only where a label follows." if labelled_only else ".")
        )
    if args.include_num_input_tokens_seen == "non_padding":
        # a packed batch has no padding and no attention_mask: stock would count the tokens unequal to the pad id,
        # which misses every real token that shares it (the end-of-turn token, when it doubles as padding)
        args.include_num_input_tokens_seen = "all"
