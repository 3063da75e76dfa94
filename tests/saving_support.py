"""Checks on saved BlenderBot weights shared by the saving tests of every tier."""

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
