"""One oracle across engines: the same rows, seed and global batch under DDP, ZeRO-0/1/2/3, ZeRO-3 with CPU offload
and FSDP2, with gradient accumulation 1 and 4, give the same per-step losses, grad norms, learning rates and final
weights, up to fp32 summation order; and stock transformers under the layouts it runs the same way (DDP, ZeRO-2,
ZeRO-3) gives them too. One 2-rank launch runs every segment (tests/distributed/workers/engine_oracle.py); the
reference is its first, hf-ext under DDP with accumulation 1. The same launch preempts DDP, ZeRO-1 and ZeRO-3 with CPU
offload by a signal to one rank, and resumes them.

Tolerances, from the measured differences (written beside each; 10x the largest): the engines reduce the same
gradient in other orders (DDP's buckets, ZeRO's partitions and reduce-scatter, FSDP2's per-parameter reduce-scatter)
and accumulation 4 sums a rank's four micro-batches after the forward instead of inside one matmul.

What the same run logs differently, each from upstream code that stock runs too (checked on stock's segments):
under DeepSpeed the Trainer logs the learning rate DeepSpeed's engine reports after its step, the next step's (the
weights show that the same schedule ran); at ZeRO-0 DeepSpeed keeps no global grad norm, and none is logged. The
DeepSpeed configs are hf-ext's presets without their scheduler section: DeepSpeed's ``WarmupDecayLR`` is another schedule
than transformers' ``linear`` with the same warm-up (docs/testing.md): a difference of schedule, not of engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "engine_oracle.py"
LAYOUTS = ["ddp", "zero0", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2"]
SEGMENTS = [f"hf-ext-{layout}-{accum}" for layout in LAYOUTS for accum in (1, 4)]
SEGMENTS += [f"stock-{layout}-1" for layout in ("ddp", "zero2", "zero3")]
#: what ran: (engine class, ZeRO stage, [optimizer offload, parameter offload], optimizer class)
EXPECTED_ENGINE = {
    "ddp": ("DistributedDataParallel", None, ["none", "none"], "AcceleratedOptimizer"),
    "zero0": ("DeepSpeedEngine", 0, ["none", "none"], "AdamW"),
    "zero1": ("DeepSpeedEngine", 1, ["none", "none"], "DeepSpeedZeroOptimizer"),
    "zero2": ("DeepSpeedEngine", 2, ["none", "none"], "DeepSpeedZeroOptimizer"),
    "zero3": ("DeepSpeedEngine", 3, ["none", "none"], "DeepSpeedZeroOptimizer_Stage3"),
    "zero3_offload": ("DeepSpeedEngine", 3, ["cpu", "cpu"], "DeepSpeedZeroOptimizer_Stage3"),
    "fsdp2": ("FSDPModule", None, ["none", "none"], "AcceleratedOptimizer"),
}
LOSS_TOLERANCE = 1e-6  # relative; measured 6.9e-8 (losses about 6.9)
GRAD_NORM_TOLERANCE = 3e-5  # relative; measured 2.6e-6 (DeepSpeed and FSDP2 against DDP; norms about 1.3)
WEIGHT_TOLERANCE = 2e-6  # absolute; measured 1.2e-7, on weights the 4 steps moved by up to 2.0e-3


@pytest.fixture(scope="module")
def engines_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def segments(tiny_chat_model_dir, engines_dir) -> dict[str, dict]:
    out = engines_dir / "segments.json"
    run(launcher_cmd(TRAIN_LAUNCHER, WORKER) + ["--model", str(tiny_chat_model_dir), "--out", str(out)])
    results = json.loads(out.read_text())
    return {r["name"]: r for r in results}


def test_every_segment_ran_its_engine(segments):
    assert list(segments)[: len(SEGMENTS)] == SEGMENTS
    for name, result in list(segments.items())[: len(SEGMENTS)]:
        engine, stage, offload, optimizer = EXPECTED_ENGINE[result["layout"]]
        ran = (result["engine"], result["zero_stage"], result["offload"], result["optimizer"])
        if result["layout"] == "fsdp2" and result["path"] == "hf-ext":
            assert result["fsdp2"], name
            ran = ("FSDPModule", *ran[1:])
        assert ran == (engine, stage, offload, optimizer), name
        assert not result["auto_left"], name


@pytest.mark.parametrize("name", SEGMENTS[1:])
def test_the_same_run_on_every_engine(name, segments):
    reference, result = segments[SEGMENTS[0]], segments[name]
    logged = reference["learning_rates"]
    if result["engine"] == "DeepSpeedEngine":  # the next step's, as DeepSpeed's engine reports it (module docstring)
        logged = logged[1:] + [0.0]
    assert result["learning_rates"] == pytest.approx(logged, rel=1e-12)
    assert result["losses"] == pytest.approx(reference["losses"], rel=LOSS_TOLERANCE)
    if result["zero_stage"] == 0:
        assert result["grad_norms"] == [None] * len(reference["grad_norms"])  # DeepSpeed keeps none at stage 0
    else:
        assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=GRAD_NORM_TOLERANCE)
    assert result["weights_moved"] > 100 * WEIGHT_TOLERANCE  # the premise: training moved the weights well past it
    assert result["max_weight_difference"] <= WEIGHT_TOLERANCE


#: preemption by a real signal to one rank, in-process: rank 1 alone gets it at the end of step 1 (the worker's
#: SIGNAL_AT): SIGUSR1 under DDP and ZeRO-1, SIGTERM under ZeRO-3 with CPU offload. The ranks agree during step 2
#: and both save checkpoint-2, nothing else, and stop; its resume to step 4 is the uninterrupted run, within the
#: tolerances above (the same engine on the same ranks). ZeRO-2, ZeRO-3 and FSDP2 get SIGTERM to one worker in
#: their launched recipe runs (tests/distributed/test_recipe_distributed.py), which exit after the checkpoint and
#: are restarted by their launcher.
PREEMPTED = {"ddp": "SIGUSR1", "zero1": "SIGUSR1", "zero3_offload": "SIGTERM"}


@pytest.mark.parametrize("layout", list(PREEMPTED))
def test_a_signal_to_one_rank_saves_one_agreed_checkpoint_that_resumes_as_the_uninterrupted_run(layout, segments):
    preempted, resumed = segments[f"preempted-{layout}"], segments[f"preempted-{layout}-resumed"]
    engine, stage, offload, _ = EXPECTED_ENGINE[layout]
    ran = "FSDPModule" if preempted["fsdp2"] else preempted["engine"]
    assert (ran, preempted["zero_stage"], preempted["offload"]) == (engine, stage, offload)
    assert preempted["signal"] == PREEMPTED[layout]
    assert preempted["saved_at"] == [2, 2] and preempted["global_step"] == 2
    assert preempted["checkpoints"] == ["checkpoint-2"]  # complete, under its own name; no temporary one left
    whole = segments[f"hf-ext-{layout}-1"]
    assert resumed["global_step"] == whole["global_step"] == 4
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=LOSS_TOLERANCE)
    assert resumed["max_weight_difference"] <= WEIGHT_TOLERANCE
    assert whole["weights_moved"] > 100 * WEIGHT_TOLERANCE


def test_stock_jit_checkpoint_on_one_rank_is_written_by_both_at_the_same_step_and_resumes(segments):
    """Stock's ``enable_jit_checkpoint=True`` under ZeRO-2: SIGTERM to rank 1 alone at the end of step 1, its kill
    wait over before step 2 (the worker's ``SignalPastKillWait``). Stock's per-rank flag would take rank 1 alone into
    the collective save at step 2's beginning; hf-ext agrees on it during step 2 and both ranks save step 2's."""
    preempted, resumed, whole = segments["jit"], segments["jit-resumed"], segments["hf-ext-zero2-1"]
    assert (preempted["engine"], preempted["zero_stage"]) == ("DeepSpeedEngine", 2) and preempted["agreed"]
    assert preempted["steps"] == [2, 2]
    assert preempted["checkpoints"][0] == "checkpoint-2"  # stock's sentinel file is gone: it finished
    assert not any("incomplete" in name or name.startswith("tmp-") for name in preempted["checkpoints"])
    assert resumed["global_step"] == whole["global_step"] == 4
    # steps 3 and 4's losses (stock's JIT checkpoint is written at the step end, before that step's loss is logged,
    # so the resumed history has no step 2)
    assert resumed["losses"][-2:] == pytest.approx(whole["losses"][2:], rel=LOSS_TOLERANCE)
    assert resumed["max_weight_difference"] <= WEIGHT_TOLERANCE


#: ``hf-ext convert`` (issue: a ZeRO checkpoint becomes an FSDP2 one and back): 8 steps of the first engine saving
#: checkpoint-4; the conversion; the second engine resumed from it for steps 5-8. The uninterrupted run is the
#: oracle, within the tolerances above (measured, each of the three: weights 6.0e-8 apart, losses equal, grad norms
#: 5-7e-7 relative; a conversion that zeroed Adam's moments instead ends 1.8e-3 away, with step 6's loss 8e-6 off)
ROUND_TRIPS = [("zero2", "fsdp2"), ("fsdp2", "zero2")]
#: and ZeRO-3's partitioned state to FSDP2 (resumed on 2 ranks; the FSDP2 side on 1 rank is ZeRO-2's round trip's),
#: the FSDP2 checkpoint resumed under ZeRO-1 and ZeRO-3 too, and ZeRO-1's: the preempted ZeRO-1 segment's checkpoint-2
#: (above) converted and resumed under FSDP2 for steps 3-4, against the uninterrupted 4-step ZeRO-1 segment. Every
#: DeepSpeed side runs hf-ext's preset as a user gets it (the Trainer's schedule: what makes its checkpoint convert),
#: zero3_offload's too (the `auto` preset resolves to one of these configs, its stage from the memory planner)
CONVERSIONS = [*ROUND_TRIPS, ("zero3", "fsdp2"), ("fsdp2", "zero1"), ("fsdp2", "zero3"), ("zero3_offload", "fsdp2"),
               ("zero1", "fsdp2")]  # fmt: skip
ENGINE_OF = {"zero1": "DeepSpeedEngine", "zero2": "DeepSpeedEngine", "zero3": "DeepSpeedEngine",
             "zero3_offload": "DeepSpeedEngine", "fsdp2": "FSDPModule"}  # fmt: skip


def conversion(first: str, second: str) -> tuple[str, str, str, int]:
    """The segments of a conversion: the first engine's uninterrupted run, the second engine's resume of the converted
    checkpoint, the second engine's own uninterrupted run, and the step the checkpoint was saved at."""
    if first == "zero1":
        return f"hf-ext-{first}-1", f"preempted-{first}-to-{second}-resumed", f"hf-ext-{second}-1", 2
    # ZeRO-1 has no 8-step run of its own: the schedule DeepSpeed's engine logs is ZeRO-2's
    return f"{first}-8", f"{first}-to-{second}-resumed", f"{'zero2' if second == 'zero1' else second}-8", 4


@pytest.mark.parametrize(("first", "second"), CONVERSIONS, ids=[f"{a}-to-{b}" for a, b in CONVERSIONS])
def test_a_converted_checkpoint_resumes_as_the_uninterrupted_run(first, second, segments):
    whole_name, resumed_name, same_engine_name, saved = conversion(first, second)
    whole, resumed = segments[whole_name], segments[resumed_name]
    ran = "FSDPModule" if resumed["fsdp2"] else resumed["engine"]
    assert ENGINE_OF[first] != ENGINE_OF[second] and ran == ENGINE_OF[second]
    assert resumed["global_step"] == whole["global_step"] == 2 * saved
    # steps up to the checkpoint come from its trainer state; the rest ran on the other engine from the converted state
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=LOSS_TOLERANCE)
    assert resumed["grad_norms"][saved:] == pytest.approx(whole["grad_norms"][saved:], rel=GRAD_NORM_TOLERANCE)
    # the schedule went on where it was: as the second engine logs it in its own uninterrupted run
    same_engine = segments[same_engine_name]
    assert resumed["learning_rates"][saved:] == pytest.approx(same_engine["learning_rates"][saved:], rel=1e-12)
    assert resumed["weights_moved"] > 100 * WEIGHT_TOLERANCE
    assert resumed["max_weight_difference"] <= WEIGHT_TOLERANCE


@pytest.fixture(scope="module")
def one_rank_resumes(segments, tiny_chat_model_dir, engines_dir) -> dict[str, dict]:
    """The two conversions (written from 2 ranks) resumed on 1 rank, each in its engine (one launch)."""
    out = engines_dir / "one_rank.json"
    run(launcher_cmd(TRAIN_LAUNCHER, WORKER, nproc=1) + ["--model", str(tiny_chat_model_dir), "--out", str(out),
                                                      "--only", "resume"])  # fmt: skip
    return {r["name"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize(("first", "second"), ROUND_TRIPS, ids=[f"{a}-to-{b}" for a, b in ROUND_TRIPS])
def test_a_converted_checkpoint_resumes_on_another_world_size(first, second, segments, one_rank_resumes):
    """Either side on any number of ranks: DCP reshards the FSDP2 state, DeepSpeed's universal load repartitions
    its own, and hf-ext keeps the global batch of 8 (micro-batch 4: accumulation 1 -> 2). One rank sums in another
    order than two: within the same tolerances."""
    whole, resumed = segments[f"{first}-8"], one_rank_resumes[f"{first}-to-{second}-on-1"]
    assert resumed["world_size"] == 1 and resumed["accumulation_ran"] == 2 and resumed["global_step"] == 8
    assert ("FSDPModule" if resumed["fsdp2"] else resumed["engine"]) == ENGINE_OF[second]
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=LOSS_TOLERANCE)
    assert resumed["grad_norms"][4:] == pytest.approx(whole["grad_norms"][4:], rel=GRAD_NORM_TOLERANCE)
    assert resumed["max_weight_difference"] <= WEIGHT_TOLERANCE
