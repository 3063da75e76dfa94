"""What a model's own probabilities say about held-out replies: the honest before/after of a preference run.

TRL's implicit-reward accuracy (``rewards/accuracies``) compares ``beta * (logp_policy - logp_ref)`` of the chosen and
the rejected reply. Before training the policy *is* the reference, every reward is 0 and the accuracy is 0 by
construction, so it cannot be a "before". The measures here ask the model itself, the same way before and after:

* **preferred (summed)**: the share of held-out pairs whose chosen reply the model finds likelier than the rejected
  one, ``log p(chosen | prompt) > log p(rejected | prompt)``;
* **preferred (per token)**: the same with each reply's log-probability divided by its length, so that a short
  reply is not preferred for being short;
* for KTO rows, the pairs are each desirable reply against each undesirable one of the same prompt (all held-out
  desirable against all undesirable replies when no prompt has both, said so in ``pairing``);
* **reply NLL**: the mean negative log-likelihood per token of the held-out preferred (chosen, desirable) replies.

Each share comes with its row count and Wilson's 95 % interval (:func:`chat_e.data.stats.share`). A tie (the same
log-probability, as for two replies that tokenize alike) is not a preference.

:func:`reply_logprobs` scores (prompt, reply) rows sharded over the ranks, every rank taking the same number of
forward passes (ZeRO-3 gathers parameters in each), and sums them back in row order on every rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from ..data.stats import share
from .launch import PREFERRED_PER_TOKEN, PREFERRED_SUM, REPLY_NLL

Row = tuple[Sequence[int], Sequence[int]]


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _batch(rows: list[Row], pad_id: int, encoder_decoder: bool) -> dict[str, torch.Tensor]:
    """Model inputs for ``rows``: a decoder-only model reads prompt + reply (labels on the reply), an
    encoder-decoder the prompt with the reply as its labels."""
    if encoder_decoder:
        width, target = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full((len(rows), target), -100, dtype=torch.long)
        for i, (prompt, reply) in enumerate(rows):
            ids[i, : len(prompt)] = torch.tensor(list(prompt))
            mask[i, : len(prompt)] = 1
            labels[i, : len(reply)] = torch.tensor(list(reply))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (prompt, reply) in enumerate(rows):
        n = len(prompt) + len(reply)
        ids[i, :n] = torch.tensor([*prompt, *reply])
        mask[i, :n] = 1
        labels[i, len(prompt) : n] = torch.tensor(list(reply))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reply_logprobs(
    model, rows: Sequence[Row], batch_size: int, pad_id: int, device=None, progress=None
) -> torch.Tensor:
    """``(len(rows), 2)`` float64: each reply's summed log-probability given its prompt, and its token count.

    A row is ``(prompt ids, reply ids)``. The rows are sharded over the ranks (every rank takes the same number of
    forward passes) and the results summed across them, so every rank returns all rows. ``progress(done, total)``
    is called after each forward pass with the rows scored so far (over every rank)."""
    rank, world = _world()
    rows = [(list(p), list(r)) for p, r in rows]
    device = device if device is not None else next(model.parameters()).device
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    mine = list(range(rank, len(rows), world))
    steps = math.ceil(math.ceil(len(rows) / world) / batch_size) if rows else 0
    out = torch.zeros(len(rows), 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for step in range(steps):
            indices = mine[step * batch_size : (step + 1) * batch_size]
            batch = [rows[i] for i in indices] or rows[:1]  # a pass taken so that the other ranks' have a partner
            inputs = {k: v.to(device) for k, v in _batch(batch, pad_id, encoder_decoder).items()}
            labels = inputs.pop("labels")
            if encoder_decoder:
                logits = model(**inputs, labels=labels).logits.float()
            else:
                logits = model(**inputs).logits.float()[:, :-1]
                labels = labels[:, 1:]
            logp = torch.log_softmax(logits, dim=-1)
            kept = labels != -100
            token_logp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * kept
            for j, i in enumerate(indices):
                out[i, 0] = float(token_logp[j].double().sum())  # float64: equal tokens give equal means
                out[i, 1] = float(kept[j].sum())
            if progress is not None:
                progress(min(len(rows), (step + 1) * batch_size * world), len(rows))
    model.train(was_training)
    if world > 1:
        summed = out.to(device)
        torch.distributed.all_reduce(summed)
        out = summed.cpu()
    return out


def scored_rows(dataset, loss: str) -> tuple[list[Row], list[tuple[int, int]], list[int], str]:
    """The (prompt, reply) rows to score of a held-out set that TRL tokenized, the pairs ``(preferred row,
    other row)`` to compare, the preferred rows (for the NLL) and how the pairs were made.

    DPO: each pair's chosen and rejected reply. KTO: each desirable reply against each undesirable one of the same
    prompt, or against every undesirable one where no prompt has both."""
    if loss == "dpo":
        rows: list[Row] = []
        for prompt, chosen, rejected in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"]):
            rows += [(prompt, chosen), (prompt, rejected)]
        pairs = [(2 * i, 2 * i + 1) for i in range(len(rows) // 2)]
        return rows, pairs, [i for i, _ in pairs], "chosen against rejected"
    rows = list(zip(dataset["prompt_ids"], dataset["completion_ids"]))
    good = [i for i, label in enumerate(dataset["label"]) if label]
    bad = [i for i, label in enumerate(dataset["label"]) if not label]
    by_prompt = defaultdict(lambda: ([], []))
    for i in good:
        by_prompt[tuple(rows[i][0])][0].append(i)
    for i in bad:
        by_prompt[tuple(rows[i][0])][1].append(i)
    pairs = [(g, b) for goods, bads in by_prompt.values() for g in goods for b in bads]
    if pairs:
        return rows, pairs, good, "desirable against undesirable, same prompt"
    return rows, [(g, b) for g in good for b in bad], good, "desirable against undesirable, across prompts"


def preference_metrics(logprobs: torch.Tensor, pairs: Sequence[tuple[int, int]], preferred: Sequence[int]) -> dict:
    """The shares of ``pairs`` whose first row is likelier (summed and per token), and the preferred rows' NLL per
    token, from :func:`reply_logprobs`' table."""
    total, tokens = logprobs[:, 0], logprobs[:, 1].clamp(min=1)
    per_token = total / tokens
    summed = sum(1 for a, b in pairs if total[a] > total[b])
    normed = sum(1 for a, b in pairs if per_token[a] > per_token[b])
    counted = sum(float(logprobs[i, 1]) for i in preferred)
    nll = -sum(float(logprobs[i, 0]) for i in preferred) / counted if counted else None
    return {
        PREFERRED_SUM: share(summed, len(pairs)).as_dict(),
        PREFERRED_PER_TOKEN: share(normed, len(pairs)).as_dict(),
        REPLY_NLL: nll,
        "reply_tokens": int(counted),
    }


def heldout_metrics(model, dataset, loss: str, batch_size: int, pad_id: int, device=None, progress=None) -> dict:
    """:func:`preference_metrics` of ``model`` on a TRL-tokenized held-out ``dataset`` of ``loss`` (dpo, kto);
    ``progress`` as :func:`reply_logprobs` takes it."""
    rows, pairs, preferred, pairing = scored_rows(dataset, loss)
    logprobs = reply_logprobs(model, rows, batch_size, pad_id, device, progress)
    return {**preference_metrics(logprobs, pairs, preferred), "rows": len(dataset), "pairing": pairing}
