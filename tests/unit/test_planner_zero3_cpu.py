"""ZeRO-3 (+ offload) on a CPU-only host: the planner's terms against DeepSpeed's allocations, written out by hand.

The measured numbers come from GPT-2 124M (``n_embd`` 768, 12 layers, from_config) trained 3 steps on 2 CPU ranks
under hf-ext's zero3 / zero3_offload presets (sub_group_size, stage3_max_live_parameters and
stage3_max_reuse_distance 1e7 on CPU), micro-batch 1 x 128 tokens, freed memory returned to the OS; peak RSS above
the RSS before the model existed, rank 0 (rank 1 within 0.3 MiB). DeepSpeed's buffers were read in
``deepspeed/runtime/zero/stage3.py`` (0.19.8).
"""

from __future__ import annotations

import pytest

from hf_ext.memory import formulas as planner

MiB = 2**20

# GPT-2 124M: 124,439,808 parameters; the tied 50257 x 768 embedding is the largest (38,597,376); below ZeRO-3's
# persistence threshold (10 x 768) are the biases and layer norms: 12 x (6 x 768 + 2304 + 3072) + 2 x 768
GPT2 = planner.ModelFacts(
    num_params=124_439_808, trainable=124_439_808, hidden_size=768, persistent_params=121_344,
    largest_param=38_597_376,
)  # fmt: skip
PARTITION = 62_219_904  # 124,439,808 / 2
# the probe's peak bytes of one forward + backward at micro-batch 1 and 2 x 128 tokens (fp32)
ACTIVATIONS = planner.ActivationProfile(128, False, [(1, 498_337_288), (2, 609_689_896)])
CPU_PRESET = {"sub_group_size": 10**7, "stage3_max_live_parameters": 10**7, "stage3_max_reuse_distance": 10**7}
MEASURED_PEAK_MIB = {"zero3": 1763.0, "zero3_offload": 2000.8}


def test_zero3_offload_keeps_both_gradient_partitions_on_the_host():
    # fp32, Ψ = 1e6, N = 2: the optimizer's fp32 gradient copy (4 x 5e5) and DeepSpeed's gradient-accumulation
    # partition (grad_partitions_flat_buffer, fp32 = the model's dtype, 4 x 5e5), both on the host
    got = planner.model_state_bytes(1_000_000, 3, 2, "fp32", offload_optimizer=True)
    assert (got.params, got.grads, got.optimizer) == (2_000_000, 0, 0)
    assert (got.host_params, got.host_grads, got.host_optimizer) == (0, 4_000_000, 4_000_000)
    # so on a CPU-only host offload costs 2 MB more than plain ZeRO-3 (8 MB of states + the master copy)
    plain = planner.model_state_bytes(1_000_000, 3, 2, "fp32")
    assert got.total - plain.total == 2_000_000


def test_largest_sub_group_is_one_parameter_partition_past_the_size():
    # DeepSpeed closes a sub-group once it holds >= sub_group_size elements: at most 1e7 - 1 + the embedding's
    # partition (38,597,376 / 2 = 19,298,688)
    assert planner.largest_sub_group(GPT2, 2, 10**7) == 10**7 - 1 + 19_298_688
    # DeepSpeed's default (1e9): the whole partition is one sub-group
    assert planner.largest_sub_group(GPT2, 2, 10**9) == PARTITION


def test_zero3_step_transient_by_sub_group_and_offload():
    sub_group = 10**7 - 1 + 19_298_688
    # torch AdamW on the sub-group: sqrt(exp_avg_sq) and its quotient, 2 x 4 bytes each element
    assert planner.step_transient_bytes(planner.Candidate(3), GPT2, 2, "cpu", 10**7) == 8 * sub_group
    offload = planner.Candidate(3, offload_optimizer=True, offload_param=True)
    # offloaded, the same AdamW step runs on the host, which is the device's RAM on a CPU-only host (the fp64 norm of
    # the embedding's gradient partition, 8 x 19,298,688, is smaller)
    assert planner.step_transient_bytes(offload, GPT2, 2, "cpu", 10**7) == 8 * sub_group
    # on an accelerator host the offloaded step's temporaries are host memory, which a GPU plan does not count
    assert planner.step_transient_bytes(offload, GPT2, 2, "cuda", 10**7) == 0


@pytest.mark.parametrize(
    "candidate,name",
    [(planner.Candidate(3), "zero3"), (planner.Candidate(3, True, True), "zero3_offload")],
)
def test_gpt2_124m_zero3_plans_within_the_band_of_the_measured_peak(candidate, name):
    plan = planner.plan(candidate, GPT2, ACTIVATIONS, 2, 1, zero=CPU_PRESET)
    parts = plan.components()
    # the fp32 partition: parameters, DeepSpeed's fp32 master copy, gradients (offloaded: the optimizer's fp32 copy
    # plus the gradient-accumulation partition), Adam's m and v
    state = {"params": 4 * PARTITION, "buffer:fp32_master_copy": 4 * PARTITION}
    if candidate.offload_optimizer:
        state |= {
            "params": 0,
            "host_params": 4 * PARTITION,
            "host_grads": 8 * PARTITION,
            "host_optimizer": 8 * PARTITION,
        }
    else:
        state |= {"grads": 4 * PARTITION, "optimizer": 8 * PARTITION}
    for key, value in state.items():
        assert parts[key] == value, key
    assert parts["buffer:gathered_params"] == 4 * 38_597_376  # the embedding gathered whole (> 1e7 live elements)
    # the step's AdamW temporaries (234 MB) take turns with the activations (498 MB): the peak has the larger only
    assert plan.total_bytes == sum(v for k, v in parts.items() if k != "step_transient")
    measured = MEASURED_PEAK_MIB[name] * MiB
    assert abs(plan.total_bytes / measured - 1) <= planner.ERROR_BAND
