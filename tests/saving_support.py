"""Rows and checks on saved BlenderBot weights shared by the saving tests of every tier and their workers."""

from __future__ import annotations

import torch

from hf_ext.saving import writer


def named_params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


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
