"""Memory planner: ZeRO model-state formulas against the paper's totals, the activation probe, "auto" resolution and
`hf-ext ds plan` (real 2-rank runs: tests/distributed/test_memory_distributed.py)."""

from __future__ import annotations

import json
import math

import pytest

from hf_ext.memory import formulas as planner
from hf_ext.memory.probe import model_facts, probe_activations
from hf_ext.sizes import parse_bytes


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)


# --- model states: the ZeRO formulas, computed here from the parameter count -----------------------------------


# Ψ = 1e6 parameters, N = 2 ranks: per-rank bytes of (params, grads, optimizer states) by the ZeRO paper's accounting,
# written out as numbers. Mixed precision: 2-byte params and grads, 12 bytes of Adam state (fp32 master, m, v); DDP
# 16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N. fp32: 4 + 4 + 8 bytes, sharded the same way.
PAPER_TOTALS = {
    ("bf16", 0): (2_000_000, 2_000_000, 12_000_000),  # 16 MB
    ("bf16", 1): (2_000_000, 2_000_000, 6_000_000),  # 10 MB = 4Ψ + 12Ψ/2
    ("bf16", 2): (2_000_000, 1_000_000, 6_000_000),  # 9 MB = 2Ψ + 14Ψ/2
    ("bf16", 3): (1_000_000, 1_000_000, 6_000_000),  # 8 MB = 16Ψ/2
    ("fp32", 0): (4_000_000, 4_000_000, 8_000_000),  # 16 MB
    ("fp32", 1): (4_000_000, 4_000_000, 4_000_000),  # 12 MB
    ("fp32", 2): (4_000_000, 2_000_000, 4_000_000),  # 10 MB
    ("fp32", 3): (2_000_000, 2_000_000, 4_000_000),  # 8 MB
}


@pytest.mark.parametrize("precision,stage", list(PAPER_TOTALS))
def test_model_state_bytes_equal_zero_formulas(precision, stage):
    got = planner.model_state_bytes(1_000_000, stage, 2, precision)
    assert (got.params, got.grads, got.optimizer) == PAPER_TOTALS[precision, stage]
    assert got.host == 0 and got.total == sum(PAPER_TOTALS[precision, stage])
    one_rank = planner.model_state_bytes(1_000_000, stage, 1, precision)
    assert one_rank.total == 16_000_000  # every stage is plain data parallelism on one rank


def test_model_facts_count_every_parameter_once(tiny_model):
    facts = model_facts(tiny_model)
    # the tiny BlenderBot ties its embeddings: parameters() yields the shared tensor once
    assert facts.num_params == facts.trainable == sum(p.numel() for p in tiny_model.parameters())
    assert facts.hidden_size == tiny_model.config.d_model


def test_model_state_partitions_round_up():
    # Ψ = 1,000,001 on 2 ranks: partitions of 500,001 elements; fp32 ZeRO-3 holds 16 bytes of each
    assert planner.model_state_bytes(1_000_001, 3, 2, "fp32").total == 8_000_016


@pytest.mark.parametrize(
    "stage,offload_param,device,host",
    [
        # optimizer states (12 bytes x Ψ/2) and the fp32 gradient partition the optimizer reads (4 x Ψ/2) move to
        # the host; at stage >= 2 the device then keeps no gradient partition
        (1, False, (2_000_000, 2_000_000, 0), (0, 2_000_000, 6_000_000)),
        (2, False, (2_000_000, 0, 0), (0, 2_000_000, 6_000_000)),
        # stage 3 also keeps DeepSpeed's gradient-accumulation partition (grad_partitions_flat_buffer, bf16 = the
        # model's dtype, 2 x Ψ/2) on the host beside the fp32 copy: 2 MB + 1 MB
        (3, False, (1_000_000, 0, 0), (0, 3_000_000, 6_000_000)),
        (3, True, (0, 0, 0), (1_000_000, 3_000_000, 6_000_000)),  # and the bf16 parameter partition too
    ],
)
def test_offloaded_states_move_to_the_host(stage, offload_param, device, host):
    got = planner.model_state_bytes(1_000_000, stage, 2, "bf16", offload_optimizer=True, offload_param=offload_param)
    assert (got.params, got.grads, got.optimizer) == device
    assert (got.host_params, got.host_grads, got.host_optimizer) == host


def test_headline_ratios():
    """DDP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N in mixed precision (DESIGN.md)."""
    totals = [planner.model_state_bytes(1_000_000, s, 8, "bf16").total for s in range(4)]
    assert totals == [16_000_000, 5_500_000, 3_750_000, 2_000_000]  # Ψ = 1e6, N = 8


def test_impossible_offloads_are_refused():
    with pytest.raises(ValueError, match="stage 3"):
        planner.model_state_bytes(10, 2, 2, offload_param=True)
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        planner.model_state_bytes(10, 0, 2, offload_optimizer=True)


def test_parse_bytes():
    # Hugging Face's convention (max_shard_size="5GB"): decimal units, binary ones spelled with an "i"
    assert parse_bytes("5GB") == 5_000_000_000 and parse_bytes("5G") == 5_000_000_000
    assert parse_bytes("5GiB") == 5 * 1024**3 and parse_bytes("256MiB") == 256 * 1024**2
    assert parse_bytes("20KB") == 20_000
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="5GB"):
        parse_bytes("eight gigs")


def test_activations_take_turns_with_gradients_and_step_temporaries():
    """DDP (no accumulation) and ZeRO-1/2/3 peak at the larger of activations and what the step holds; with gradient
    accumulation, and under ZeRO-0, activations add on top (the 400M sweep in docs/benchmarks.md measured DDP and
    ZeRO-1/2; GPT-2 124M on 2 CPU ranks ZeRO-3: the sub-group step runs after backward, its 147 MiB not on top of
    backward's peak)."""
    psi = 10_000_000
    facts = planner.ModelFacts(num_params=psi, trainable=psi, hidden_size=1000, persistent_params=0, largest_param=psi // 10)  # fmt: skip
    per_sample = 2 * 2**20
    profile = planner.ActivationProfile(128, False, [(1, per_sample), (2, 2 * per_sample)])

    def totals(candidate, **kwargs):
        return [planner.plan(candidate, facts, profile, 2, b, **kwargs).total_bytes for b in (1, 2, 100)]

    ddp = planner.Candidate(0, ddp=True)
    small, medium, large = totals(ddp)
    assert small == medium < large  # 4Ψ bytes of gradients leave room for 20 samples before the peak moves
    small, medium, large = totals(ddp, accumulation_steps=2)
    assert small < medium < large  # the gradients stay while the next micro-batch runs forward
    small, medium, large = totals(planner.Candidate(2))
    assert small == medium < large  # 3 x 4 bytes x Ψ/2 of step temporaries on CPU
    # ZeRO-3 with DeepSpeed's default sub_group_size (1e9): one sub-group = the partition, 2 x 4 bytes x Ψ/2 = 40 MB of
    # AdamW temporaries, more than 2 samples' activations (4 MiB) and less than 100 (200 MiB)
    small, medium, large = totals(planner.Candidate(3))
    assert small == medium < large and large - medium == 100 * per_sample - 40_000_000
    small, medium, large = totals(planner.Candidate(0))
    assert medium - small == per_sample and large - medium == 98 * per_sample


# --- activations --------------------------------------------------------------------------------------------------


def test_probe_grows_with_batch_and_checkpointing_saves_memory(tiny_model):
    seq = 64
    plain = probe_activations(tiny_model, seq, (1, 4))
    ckpt = probe_activations(tiny_model, seq, (1, 4), checkpointing=True)
    assert plain.per_sample > 0 and ckpt.per_sample > 0
    assert ckpt.per_sample < plain.per_sample
    assert plain.at(8) > plain.at(4) > plain.at(1)
    assert plain.at(4, "bf16") == plain.at(4) // 2
    assert all(p.grad is None for p in tiny_model.parameters())  # the probe leaves no gradients behind
    assert not getattr(tiny_model, "is_activation_checkpointing", False)


def test_probe_works_for_a_causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64))
    profile = probe_activations(model, 32, (1, 2))
    assert profile.per_sample > 0


# --- "auto" resolution ---------------------------------------------------------------------------------------------


GPU = dict(device="cuda", precision="bf16", baseline=planner.GPU_RESERVE)  # a deterministic baseline


def _resolve_auto(model, memory: str, device: str = "cuda", **args_kwargs):
    import hf_ext
    from hf_ext.deepspeed.resolve import Hardware, explain_deepspeed_config

    args = hf_ext.TrainingArguments("unused", report_to=[], plan_seq_len=32, memory_per_device=memory, **args_kwargs)
    hardware = Hardware(device, device != "cpu", True)
    return args, explain_deepspeed_config("auto", args, model, world_size=2, defer=True, hardware=hardware)


@pytest.fixture(scope="session")
def medium_measured(medium_model_dir):
    from hf_ext.memory.probe import from_measurement, measure

    return from_measurement(measure(medium_model_dir, 32, False))


def test_auto_stage_small_budget_is_more_sharded(medium_model_dir, medium_measured):
    facts, profile = medium_measured
    plans = [planner.plan(c, facts, profile, 2, 2, **GPU) for c in planner.CANDIDATES]
    least, smallest = plans[0], min(plans, key=lambda p: p.total_bytes)
    assert smallest.total_bytes < least.total_bytes
    _, roomy = _resolve_auto(medium_model_dir, "1TB", per_device_train_batch_size=2)
    assert roomy.config["zero_optimization"]["stage"] == 0 and "offload_optimizer" not in roomy.config["zero_optimization"]  # fmt: skip
    # between the least-sharded need and the smallest need: only more sharded configurations fit
    budget = planner.GPU_RESERVE + (least.total_bytes + smallest.total_bytes) // 2
    _, tight = _resolve_auto(medium_model_dir, str(budget), per_device_train_batch_size=2)
    chosen = tight.memory_plan
    assert chosen.candidate.sharding_rank() > least.candidate.sharding_rank()
    assert chosen.fits and chosen.baseline + chosen.total_bytes <= budget
    zero = tight.config["zero_optimization"]
    assert zero["stage"] == chosen.candidate.stage
    assert ("offload_optimizer" in zero) == chosen.candidate.offload_optimizer
    # and it is the least sharded one that fits: every less sharded candidate does not
    for p in plans:
        if p.candidate.sharding_rank() < chosen.candidate.sharding_rank():
            assert p.baseline + p.total_bytes > budget
    assert any(c.key == "zero_optimization.stage" and "planner" in c.source for c in tight.changes)


def test_auto_on_cpu_never_offloads(medium_model_dir):
    _, res = _resolve_auto(medium_model_dir, "1TB", device="cpu", per_device_train_batch_size=2)
    zero = res.config["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert res.memory_plan.precision == "fp32"


def test_auto_micro_batch_is_the_largest_that_fits(medium_model_dir, medium_measured):
    facts, profile = medium_measured
    args, res = _resolve_auto(medium_model_dir, "3GB", per_device_train_batch_size="auto")
    plan = res.memory_plan
    assert res.args_updates["per_device_train_batch_size"] == plan.micro_batch == res.config["train_micro_batch_size_per_gpu"]  # fmt: skip
    assert args.per_device_train_batch_size == "auto"  # the resolver reports what the arguments should become
    assert plan.micro_batch > 1
    bigger = planner.plan(plan.candidate, facts, profile, 2, plan.micro_batch + 1, budget=plan.budget, **GPU)
    assert plan.fits and not bigger.fits


def test_auto_needs_a_model_and_says_so():
    import hf_ext
    from hf_ext.deepspeed.resolve import DeepSpeedConfigError, Hardware, explain_deepspeed_config

    args = hf_ext.TrainingArguments("unused", report_to=[])
    with pytest.raises(DeepSpeedConfigError, match="plan_model"):
        explain_deepspeed_config("auto", args, world_size=2, defer=True, hardware=Hardware("cpu", False, True))


def test_nothing_fits_is_one_clear_error(medium_model_dir):
    from hf_ext.deepspeed.resolve import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError) as err:
        _resolve_auto(medium_model_dir, "1MB", per_device_train_batch_size=2)
    assert len(err.value.problems) == 1 and "memory_per_device" in err.value.problems[0].fix


# --- CLI -----------------------------------------------------------------------------------------------------------


def test_ds_plan_cli_json_and_table(tiny_model_dir, capsys):
    from hf_ext.cli import main

    assert main(["ds", "plan", "--model", str(tiny_model_dir), "--world_size", "2", "--seq_len", "32",
                 "--memory_per_device", "4GB", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    names = [row["config"] for row in result["rows"]]
    assert {"DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"} <= set(names)
    assert result["recommended"] in names and result["recommended_micro_batch"] >= 1
    assert main(["ds", "plan", "--model", str(tiny_model_dir), "--world_size", "2", "--seq_len", "32",
                 "--memory_per_device", "4GB", "--gradient_checkpointing"]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "* recommended:" in table and "checkpointing on" in table
    assert any(line.startswith("*") for line in table.splitlines())


def test_ds_plan_for_gpus_from_a_cpu_host(tiny_model_dir, capsys):
    from hf_ext.cli import main
    from hf_ext.memory.formulas import GPU_RESERVE

    argv = ["ds", "plan", "--model", str(tiny_model_dir), "--world_size", "2", "--seq_len", "32", "--device", "cuda"]
    assert main(argv) == 1  # no budget to read from a GPU this host lacks
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "needs --memory_per_device" in error
    assert main([*argv, "--memory_per_device", "80GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["device"], result["precision"], result["baseline_bytes"]) == ("cuda", "fp32", GPU_RESERVE)


def test_release_freed_memory_switch():
    from types import SimpleNamespace

    import hf_ext
    from hf_ext.runtime import wants_freed_memory_released

    assert not wants_freed_memory_released(SimpleNamespace())
    assert wants_freed_memory_released(SimpleNamespace(memory_plan=object()))
    assert not wants_freed_memory_released(SimpleNamespace(release_freed_memory=False, memory_plan=object()))
    assert wants_freed_memory_released(SimpleNamespace(release_freed_memory=True))
    args = hf_ext.TrainingArguments("unused", report_to=[])
    assert args.release_freed_memory is None and args.memory_plan is None
    assert not wants_freed_memory_released(args)


def test_depth_extrapolation_arithmetic():
    from hf_ext.memory.probe import depth_fields, extrapolate_depth

    # 2 layers: 100 bytes, 3 layers: 130 -> each further layer 30; 48 layers: 100 + 46 x 30
    assert extrapolate_depth([(1, 100), (2, 190)], [(1, 130), (2, 250)], 48) == [(1, 1480), (2, 2950)]
    from transformers import BlenderbotConfig, GPT2Config

    assert depth_fields(GPT2Config(n_layer=48)) == (("num_hidden_layers",), 48)
    assert depth_fields(BlenderbotConfig(encoder_layers=12, decoder_layers=12)) == (
        ("encoder_layers", "decoder_layers"),
        12,
    )
    assert depth_fields(BlenderbotConfig(encoder_layers=2, decoder_layers=24)) is None  # unequal: probed whole


def test_probe_drops_kineto_lines_and_keeps_the_rest_of_stderr(capfd):
    """The activation probe starts and stops torch's profiler once per micro-batch; kineto writes a line to fd 2 at
    each (torch 2.13 prints them at every log level), which made `hf-ext ds plan` print them between its rows. The
    probe keeps them out of stderr; what the measured code itself writes, from Python or C, still arrives. ``capfd``
    reads file descriptor 2 itself, where kineto's C++ writes."""
    import os
    import sys

    import torch

    from hf_ext.memory.probe import _peak_allocated

    def fn():
        print("from python", file=sys.stderr)
        os.write(2, b"from fd 2\n")
        return torch.ones(1 << 20)

    assert _peak_allocated(fn) >= 4 << 20  # the 4 MiB tensor was measured
    err = capfd.readouterr().err
    assert "from python" in err and "from fd 2" in err
    assert "USDT:" not in err and "STAGE:" not in err


def test_a_model_loaded_before_the_zero3_arguments_is_said_loaded_whole(tiny_model_dir, no_global_deepspeed_config):
    """The line Trainer start logs when ZeRO-3 is on but the model's parameters were not partitioned as they loaded
    (the arguments came after from_pretrained), with the host RAM of both orders; nothing without ZeRO-3. Its absence
    for a model zero.Init partitioned: tests/distributed/test_comm_layer.py."""
    from transformers import AutoModelForSeq2SeqLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from hf_ext.memory.measure import loaded_whole_under_zero3
    from hf_ext.sizes import gb

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    assert loaded_whole_under_zero3(model, 4, 2) is None  # no DeepSpeed config: nothing to say
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # noqa: F841 (registered while it lives)
    line = loaded_whole_under_zero3(model, 4, 2)
    count = sum(p.numel() for p in model.parameters())
    assert f"2 x {gb(4 * count)} = {gb(8 * count)}" in line  # fp32: 4 bytes a parameter, on each of 2 ranks
    assert f"2 x {gb(4 * math.ceil(count / 4))} = {gb(8 * math.ceil(count / 4))}" in line  # a quarter each
    assert line.endswith("Fix: create the TrainingArguments (deepspeed=...) before from_pretrained.")
