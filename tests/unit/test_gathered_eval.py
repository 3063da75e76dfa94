"""The ZeRO-3 generation-eval choice: gather the weights once when a full copy fits beside the training state (the
memory plan's ``gathered_eval_bytes``, else the memory free on the rank), per token otherwise; the copy's size in the
plan and in ``hf-ext ds plan``. Generation through the gathered copy on 2 real ranks: tests/distributed/
test_bleu_eval_distributed.py."""

from __future__ import annotations

import json
import math

import pytest
from transformers import BlenderbotForConditionalGeneration

from hf_ext.evaluation.gathered import choose_generation_path, full_parameter_bytes
from hf_ext.memory import formulas as planner

PSI = 10_000_000
FACTS = planner.ModelFacts(num_params=PSI, trainable=PSI, hidden_size=1000, persistent_params=0, largest_param=PSI // 10)  # fmt: skip
PROFILE = planner.ActivationProfile(128, False, [(1, 2**20), (2, 2 * 2**20)])


def make_plan(stage: int, budget: int | None, **candidate) -> planner.Plan:
    return planner.plan(planner.Candidate(stage, **candidate), FACTS, PROFILE, 2, 1, budget=budget)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)


def test_gathered_eval_is_a_full_copy_plus_room_at_stage_3_only():
    assert make_plan(3, None).gathered_eval_bytes == int(4 * PSI * 1.25)  # fp32 weights, whole, + 25 %
    assert make_plan(3, None, offload_param=True, offload_optimizer=True).gathered_eval_bytes == int(4 * PSI * 1.25)
    for stage in (0, 1, 2):  # the weights are whole on every rank already
        assert make_plan(stage, None).gathered_eval_bytes == 0
    plan = make_plan(3, None)
    assert plan.eval_state_bytes < plan.baseline + plan.total_bytes  # no activations between steps


def test_full_parameter_bytes_count_tied_weights_once(model, tiny_model_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:  # what save_pretrained wrote: ties once
        saved = {name: math.prod(f.get_slice(name).get_shape()) * 4 for name in f.keys()}  # fp32
    saved_bytes = sum(saved.values())
    buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name in saved)
    assert full_parameter_bytes(model) == saved_bytes - buffers
    assert len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))  # tied


def test_the_plan_decides_when_there_is_one(model):
    roomy = make_plan(3, 64 * 2**30)
    tight = make_plan(3, make_plan(3, None).eval_state_bytes + 2**20)  # the state fits, the copy does not
    assert choose_generation_path(model, "auto", roomy).gathered
    path = choose_generation_path(model, "auto", tight)
    assert not path.gathered and "no room" in path.reason


def test_without_a_plan_the_free_memory_decides(model):
    assert choose_generation_path(model, "auto", device="cpu").gathered  # a tiny model fits this machine
    need = full_parameter_bytes(model)
    path = choose_generation_path(model, "auto", device="cpu", local_ranks=10**9)  # RAM shared by countless ranks
    assert not path.gathered and "needed" in path.reason and need > 0


def test_explicit_settings_and_wrapped_models(model):
    assert choose_generation_path(model, "true", make_plan(3, 1)).gathered  # asked for: even without room
    assert not choose_generation_path(model, "false", make_plan(3, 64 * 2**30)).gathered
    wrapped = type("Wrapper", (), {"parameters": model.parameters})()
    assert not choose_generation_path(wrapped, "true").gathered


def test_ds_plan_shows_the_gathered_eval(tiny_model_dir, capsys):
    from hf_ext.cli import main

    argv = ["ds", "plan", "--model", str(tiny_model_dir), "--world_size", "2", "--seq_len", "32",
            "--memory_per_device", "4GB"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    rows = {row["config"]: row["plan_at_max"] for row in json.loads(capsys.readouterr().out)["rows"]}
    full = full_parameter_bytes(BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir))
    assert rows["ZeRO-3"]["gathered_eval_bytes"] == pytest.approx(full * 1.25, rel=0.01)
    assert rows["ZeRO-2"]["gathered_eval_bytes"] == 0 and rows["ZeRO-3"]["gathered_eval_fits"]
    assert main(argv) == 0
    assert "gathered eval GiB" in capsys.readouterr().out
