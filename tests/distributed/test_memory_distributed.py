"""Real 2-rank runs of tests/distributed/workers/memory_worker.py: the measured per-rank peak falls inside the
planner's stated error band, a planned run returns freed memory to the OS, and `auto` under a budget trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hf_ext.memory import formulas as planner
from hf_ext.memory.probe import model_facts, probe_activations, weight_file_bytes

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "memory_worker.py"


def _launch(tmp_path, model_dir, config: str, *extra: str) -> list[dict]:
    out = tmp_path / f"mem_{Path(config).stem}"
    if Path(f"{out}.rank1.json").exists():  # launched already (a module-scoped folder: see planned_zero3)
        return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    launcher = "torchrun" if config == "ddp" else TRAIN_LAUNCHER
    cmd = launcher_cmd(launcher, WORKER) + ["--model", str(model_dir), "--config", config, "--out", str(out)]
    run(cmd + ["--seq_len", "32", "--batch", "2", "--steps", "3", *extra])
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


def _predicted(model_dir, zero: dict | None) -> planner.Plan:
    """The plan of the configuration a run used (``zero``: its ``zero_optimization`` section; None: DDP)."""
    model = _model(model_dir)
    facts = model_facts(model, weight_file_bytes(model_dir))  # the worker loads it from_pretrained: a mapped file
    profile = probe_activations(model, 32, (1, 2))
    if zero is None:
        return planner.plan(planner.Candidate(0, ddp=True), facts, profile, 2, 2)
    return planner.plan(planner.Candidate(zero["stage"]), facts, profile, 2, 2, zero=zero)


@pytest.fixture(scope="module")
def planned_zero3(tmp_path_factory, medium_model_dir):
    """A ZeRO-3 run under a memory budget: the planner plans it and releases freed memory, which its plan assumes
    (the run of both the error band's ZeRO-3 case and the freed-memory comparison)."""
    folder = tmp_path_factory.mktemp("planned")
    _launch(folder, medium_model_dir, "zero3", "--memory_per_device", "64GB")
    return folder


def auto_budget(model_dir) -> int:
    """A budget a fraction of this machine's RAM, set by the ZeRO paper's fp32 accounting: plain data parallelism
    needs 16 bytes per parameter per rank (params 4 + grads 4 + Adam 8), which for the ~19M-parameter model is
    ~0.3 GB; with 4 GiB on top for the runtime (torch, DeepSpeed, communication: 0.4-0.6 GiB measured) and
    activations, every stage fits."""
    return 16 * model_facts(_model(model_dir)).num_params + 4 * 2**30


@pytest.fixture(scope="module")
def planned_auto(tmp_path_factory, medium_model_dir):
    """``auto`` under :func:`auto_budget`: the planner picks ZeRO-0 and releases freed memory (the run of both the
    error band's ZeRO-0 case and the ``auto`` test)."""
    folder = tmp_path_factory.mktemp("auto")
    _launch(folder, medium_model_dir, "auto", "--memory_per_device", str(auto_budget(medium_model_dir)))
    return folder


@pytest.mark.parametrize("config", ["zero0", "zero2", "zero3"])
def test_measured_peak_within_error_band(tmp_path, medium_model_dir, config, request):
    """Peak RSS above the RSS before the model existed (model loading, engine, 3 steps), per rank. ZeRO-0 and ZeRO-3
    are planned runs (``auto`` chose ZeRO-0); ZeRO-2 releases freed memory as a planned run does."""
    if config == "zero3":
        results = _launch(request.getfixturevalue("planned_zero3"), medium_model_dir, "zero3")
    elif config == "zero0":
        results = _launch(request.getfixturevalue("planned_auto"), medium_model_dir, "auto")
        assert results[0]["zero_stage"] == 0
    else:
        results = _launch(tmp_path, medium_model_dir, config, "--release_freed_memory", "on")  # as when planned
    assert results[0]["zero_optimization"] == results[1]["zero_optimization"]
    plan = _predicted(medium_model_dir, results[0]["zero_optimization"])
    low, high = plan.band  # the stated band, ±15 % + 64 MiB: about ±30 % at this model's size (docs/memory.md says so)
    for r in results:
        print(f"{config} rank {r['rank']}: measured {r['increment_bytes'] / 2**20:.0f} MiB, band "
              f"{low / 2**20:.0f}..{high / 2**20:.0f} MiB (±{(high - low) / 2 / plan.total_bytes:.0%})")  # fmt: skip
        assert r["world_size"] == 2 and r["zero_stage"] == plan.candidate.stage
        assert low <= r["increment_bytes"] <= high, (
            f"rank {r['rank']}: measured {r['increment_bytes'] / 2**20:.0f} MiB, predicted "
            f"{plan.total_bytes / 2**20:.0f} MiB (band {low / 2**20:.0f}..{high / 2**20:.0f})\n{plan.describe()}"
        )


def test_freed_memory_is_released_when_the_planner_plans(tmp_path, medium_model_dir, planned_zero3):
    """By default hf-ext leaves glibc as it is, as stock does; a planned run releases freed memory at once, which its
    plan assumes: the same ZeRO-3 run then peaks well lower."""
    default = _launch(tmp_path, medium_model_dir, "zero3")
    planned = _launch(planned_zero3, medium_model_dir, "zero3")
    assert not any(r["released_freed_memory"] for r in default) and default[0]["plan"] is None
    assert all(r["released_freed_memory"] for r in planned) and planned[0]["plan"] is not None
    for d, p in zip(default, planned):
        assert p["increment_bytes"] < 0.85 * d["increment_bytes"], (d["increment_bytes"], p["increment_bytes"])


def test_auto_with_a_small_budget_trains(planned_auto, medium_model_dir):
    """`auto` under :func:`auto_budget`: every stage fits, so the least sharded one, ZeRO stage 0, is the answer, on
    both ranks; and the measured peak stays inside the budget."""
    budget = auto_budget(medium_model_dir)
    results = _launch(planned_auto, medium_model_dir, "auto")
    for r in results:
        assert r["world_size"] == 2
        assert r["zero_stage"] == 0 and r["offload_optimizer"] is None
        assert r["plan"]["name"] == "ZeRO-0" and r["plan"]["fits"] and r["plan"]["budget"] == budget
        assert r["plan"]["baseline"] + r["increment_bytes"] < budget
        assert math.isfinite(r["final_loss"])


def _model(model_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(model_dir)
