"""The planner's FSDP2 full-shard row and DDP under mixed precision, by hand: FSDP keeps 16 bytes per parameter ÷ N
in fp32 and under bf16 alike (no separate master copy), plus a gathered block in the compute dtype and its fp32
gradients; DDP's bf16 is autocast, its states stay fp32."""

from __future__ import annotations

import dataclasses

from hf_ext.memory import formulas as planner
from hf_ext.model_info import layer_classes, layer_sizes

PSI = 100_000_000
# 10 blocks of 8M parameters, 20M outside them (embeddings, norms), the largest parameter 10M (the embedding)
FACTS = planner.ModelFacts(num_params=PSI, trainable=PSI, hidden_size=1000, persistent_params=0,
                           largest_param=10_000_000, largest_block=8_000_000, block_params=80_000_000)  # fmt: skip
PROFILE = planner.ActivationProfile(128, False, [(1, 2**20), (2, 2 * 2**20)])


def fsdp(precision: str, world: int = 2) -> planner.Plan:
    return planner.plan(planner.FSDP_FULL_SHARD, FACTS, PROFILE, world, 1, precision)


def test_model_states_are_16_bytes_per_parameter_over_the_ranks_in_any_precision():
    for precision in ("fp32", "bf16"):
        states = fsdp(precision, world=4).states
        assert (states.params, states.grads, states.optimizer) == (100_000_000, 100_000_000, 200_000_000)
    zero3 = planner.plan(planner.Candidate(3), FACTS, PROFILE, 4, 1, "fp32")
    assert zero3.buffers["fp32_master_copy"] == 100_000_000  # DeepSpeed in fp32 keeps a master copy; FSDP does not


def test_gathered_blocks_and_their_gradients():
    # root 20M + two blocks (the current one and the prefetched one) + the all-gather's flat buffer of one block, in
    # the compute dtype; root + one block of gradients + the reduce-scatter's flat input of one block, in the dtype
    # accelerate's mixed precision policy reduces in (its param dtype: bf16 under bf16)
    assert fsdp("fp32").buffers == {"gathered_blocks": 4 * 44_000_000, "unsharded_gradients": 4 * 36_000_000}
    assert fsdp("bf16").buffers == {"gathered_blocks": 2 * 44_000_000, "unsharded_gradients": 2 * 36_000_000}
    # the optimizer steps each local shard on its own: sqrt(v) and the quotient of the largest one, 2 x 4 x 10M / 2
    assert fsdp("fp32").step_transient == 40_000_000
    assert fsdp("fp32").gathered_eval_bytes == 0  # generation runs on the sharded model
    assert planner.FSDP_FULL_SHARD.name == "FSDP full shard"
    assert planner.FSDP_FULL_SHARD not in planner.CANDIDATES  # DeepSpeed's "auto" does not choose FSDP


def test_layers_are_the_declared_no_split_modules_else_the_repeated_ones():
    from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration, GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=100, n_positions=16))
    assert layer_classes(gpt2) == ["GPT2Block"]  # declared by the model
    assert layer_sizes(gpt2) == [sum(p.numel() for p in gpt2.transformer.h[0].parameters())] * 3
    # BlenderBot declares none: its encoder and decoder layers, found in their ModuleLists
    config = BlenderbotConfig(vocab_size=100, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    blenderbot = BlenderbotForConditionalGeneration(config)
    assert not blenderbot._no_split_modules
    assert layer_classes(blenderbot) == ["BlenderbotEncoderLayer", "BlenderbotDecoderLayer"]
    encoder = sum(p.numel() for p in blenderbot.model.encoder.layers[0].parameters())
    decoder = sum(p.numel() for p in blenderbot.model.decoder.layers[0].parameters())
    assert layer_sizes(blenderbot) == [encoder] * 2 + [decoder] * 3


def test_ddp_under_mixed_precision_keeps_fp32_states():
    """Without DeepSpeed or FSDP, bf16 is autocast: the parameters, gradients, DDP's buckets and Adam stay fp32
    (16 bytes per parameter + 4 of buckets); only the activations shrink."""
    ddp = planner.Candidate(0, ddp=True)
    fp32 = planner.plan(ddp, FACTS, PROFILE, 2, 1, "fp32")
    bf16 = planner.plan(ddp, FACTS, PROFILE, 2, 1, "bf16")
    assert (bf16.states.params, bf16.states.grads, bf16.states.optimizer) == (4 * PSI, 4 * PSI, 8 * PSI)
    assert bf16.buffers == fp32.buffers == {"ddp_gradient_buckets": 4 * PSI}
    assert bf16.activations == fp32.activations // 2


def test_engine_for_a_micro_batch_is_the_least_sharded_that_fits():
    """docs/memory.md, "Which engine?": DDP while the whole model, its gradients and Adam fit; then ZeRO-1, ZeRO-2, ZeRO-3,
    FSDP full shard; offloads last (and never on a CPU-only host, where they save nothing)."""

    # fine-tuning from a checkpoint (fp32 safetensors, 4 bytes per parameter): on a CPU host ZeRO-1/2 keep the file's
    # pages beside their copy, FSDP its shard's share of them (planner.checkpoint_pages_bytes)
    facts = dataclasses.replace(FACTS, checkpoint_bytes=4 * PSI)

    def need(name: str, device: str = "cpu") -> int:
        candidate = next(c for c in planner.ENGINES if c.name == name)
        return planner.plan(candidate, facts, PROFILE, 2, 1, device=device).total_bytes

    def engine(budget: int, device: str = "cpu") -> str | None:
        chosen, _ = planner.choose(facts, PROFILE, 2, budget, 1, planner.ENGINES, device=device)
        return chosen.candidate.name if chosen else None

    order = ["DDP", "ZeRO-2", "ZeRO-3", "FSDP full shard"]
    needs = [need(name) for name in order]
    # each needs less than the one before: DDP 20 bytes/parameter (16 + its fp32 buckets), ..., FSDP 8 (16 / 2)
    assert needs == sorted(needs, reverse=True) and needs[0] > 20 * PSI > needs[-1] > 8 * PSI
    # in fp32 on 2 ranks ZeRO-1 needs more than DDP (DeepSpeed's fp32 master and gradient copies, the step's
    # temporaries: measured at the 400M shape, docs/benchmarks.md "Memory"), so it is never the answer here
    assert need("ZeRO-1") > needs[0]
    for name, budget in zip(order, needs):
        assert engine(budget) == name  # at exactly its need; every less sharded row needs more
    assert engine(needs[-1] - 1) is None  # the CPU planner never offers an offload
    # on a GPU host, below what every unoffloaded row needs, an offload is the answer
    below = min(need(name, "cuda") for name in order) - 1
    assert engine(below, "cuda") in ("ZeRO-2 + offload optimizer", "ZeRO-3 + offload optimizer")


def test_checkpoint_pages_count_where_the_engine_copies_the_mapped_weights():
    """from_pretrained maps the weight files; ZeRO-1/2 copy every parameter out of them (all pages read), FSDP each
    rank's shard (1/N), DDP trains on them in place, ZeRO-3 partitions while loading; a GPU's memory holds none."""
    fine_tuned = dataclasses.replace(FACTS, checkpoint_bytes=4 * PSI)
    pages = {c.name: planner.checkpoint_pages_bytes(c, fine_tuned, 2) for c in planner.ENGINES}
    assert pages["ZeRO-1"] == pages["ZeRO-2"] == 4 * PSI and pages["FSDP full shard"] == 2 * PSI
    assert pages["DDP"] == pages["ZeRO-3"] == 0
    assert planner.checkpoint_pages_bytes(planner.Candidate(2), fine_tuned, 2, device="cuda") == 0
    assert planner.checkpoint_pages_bytes(planner.Candidate(2), FACTS, 2) == 0  # from scratch: no file
    zero2 = planner.plan(planner.Candidate(2), fine_tuned, PROFILE, 2, 1)
    assert zero2.checkpoint_pages == zero2.components()["checkpoint_pages"] == 4 * PSI
    # resident throughout: beside the step's temporaries (the activations are small here) and beside activations
    # larger than the step (the 400M shape's ZeRO-2 micro-batches 12-18 measured states + pages + activations)
    big = planner.ActivationProfile(128, False, [(1, 10 * PSI), (2, 20 * PSI)])
    for profile in (PROFILE, big):
        with_file = planner.plan(planner.Candidate(2), fine_tuned, profile, 2, 1).total_bytes
        assert with_file - planner.plan(planner.Candidate(2), FACTS, profile, 2, 1).total_bytes == 4 * PSI


def test_zero2_gradient_partition_takes_turns_with_the_activations():
    """ZeRO-2 allocates its gradient partition in backward and releases it after the step; the fp32 copy exists in
    the step only. Beside large activations the peak is the rest of the states plus the activations (measured at the
    DeBERTa-v3-large shape, micro-batches 5 and 8); with gradient accumulation the partition stays beside the next
    forward. fp32, N = 2: parameters 4Ψ, Adam 8Ψ/2, DeepSpeed's fp32 master copy 4Ψ/2; partition and copy 4Ψ/2 each."""
    big = planner.ActivationProfile(128, False, [(1, 10 * PSI), (2, 20 * PSI)])
    zero2 = planner.plan(planner.Candidate(2), FACTS, big, 2, 1)
    rest = zero2.buffers["reduce_buckets"] + zero2.overhead
    assert zero2.gradient_partition_turns == 2 * PSI + 2 * PSI
    assert zero2.total_bytes == 4 * PSI + 4 * PSI + 2 * PSI + 10 * PSI + rest
    accumulating = planner.plan(planner.Candidate(2), FACTS, big, 2, 1, accumulation_steps=2)
    assert accumulating.total_bytes - zero2.total_bytes == 2 * PSI
    # small activations: the partition, its copy and the step's sqrt(v) of the partition (4Ψ/2 each) all count
    small = planner.plan(planner.Candidate(2), FACTS, PROFILE, 2, 1)
    assert small.activations < 6 * PSI
    assert small.total_bytes == 4 * PSI + 4 * PSI + 2 * PSI + 3 * 2 * PSI + rest
