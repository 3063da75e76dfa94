"""Rows and checks on saved BlenderBot weights shared by the saving tests of every tier and their workers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from hf_ext.saving import writer


def named_params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def parameter_names(model_dir, remove_duplicate: bool = False) -> set[str]:
    """The parameter names of the model saved in ``model_dir``: every name, tied ones too (what a gathered full state
    dict holds), or with ``remove_duplicate`` each parameter once, a tied one under its first name (what each FSDP
    rank's shards hold)."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    names = {name for name, _ in model.named_parameters(remove_duplicate=remove_duplicate)}
    assert len(names) > 50, names
    return names


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: set[str]) -> None:
    """``a`` and ``b`` hold exactly ``names``, bit for bit the same."""
    assert set(a) == set(b) == names, (sorted(names ^ set(a))[:5], sorted(names ^ set(b))[:5])
    assert [k for k in sorted(names) if not torch.equal(a[k], b[k])] == []


def assert_tied(model) -> None:
    shared = model.model.shared.weight
    assert model.lm_head.weight is shared
    assert model.model.encoder.embed_tokens.weight is shared
    assert model.model.decoder.embed_tokens.weight is shared


def stored_keys(output_dir) -> set[str]:
    return set(writer.saved_weight_shapes(output_dir))


def synthetic_rows(n: int, vocab: int) -> list[dict]:
    """``n`` seeded seq2seq rows (12 input tokens, 8 label tokens + ``</s>``) for a vocabulary of ``vocab``."""
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(4, vocab, (12,), generator=g).tolist(),
            "attention_mask": [1] * 12,
            "labels": torch.randint(4, vocab, (8,), generator=g).tolist() + [2],
        }
        for _ in range(n)
    ]


def gathered_state_dict(model) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` at full size by every name (tied ones too), on every rank; under FSDP2 on rank 0
    only (the others get ``{}``). Call it on every rank."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if any(isinstance(p, DTensor) for p in params):  # FSDP2: torch's own full state dict
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:  # the full values live on rank 0 only
            return {}
        first_name = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        return {n: full[n if n in full else first_name[id(p)]].clone()
                for n, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip
    zero3 = any(hasattr(p, "ds_id") for p in params)
    if zero3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def samples_by_step(run_dir: Path) -> dict[int, list[int]]:
    """``{optimizer step: sorted sample ids}`` from the ``samples.rank*.json`` files train_save.py's ``--samples``
    writes (every rank's, merged)."""
    steps: dict[int, list[int]] = {}
    for path in sorted(Path(run_dir).glob("samples.rank*.json")):
        for step, sample in json.loads(path.read_text()):
            steps.setdefault(step, []).append(sample)
    return {step: sorted(ids) for step, ids in steps.items()}
