"""Real 2-rank runs of tests/distributed/workers/memory_worker.py: the measured per-rank peak falls inside the
planner's stated error band, a planned run returns freed memory to the OS, and `auto` under a budget trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hf_ext.memory import formulas as planner
from hf_ext.memory.probe import model_facts, probe_activations, weight_file_bytes

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run_together

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "memory_worker.py"


def _command(model_dir, config: str, out: Path, *extra: str) -> list[str]:
    # fresh interpreters: a forked rank's resident memory starts at its parent's
    return launcher_cmd(TRAIN_LAUNCHER, WORKER, fresh=True) + ["--model", str(model_dir), "--config", config,
                                                              "--out", str(out), "--seq_len", "32", "--batch", "2",
                                                              "--steps", "3", *extra]  # fmt: skip


def _results(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


def _predicted(model_dir, zero: dict | None) -> planner.Plan:
    """The plan of the configuration a run used (``zero``: its ``zero_optimization`` section; None: DDP)."""
    model = _model(model_dir)
    facts = model_facts(model, weight_file_bytes(model_dir))  # the worker loads it from_pretrained: a mapped file
    profile = probe_activations(model, 32, (1, 2))
    if zero is None:
        return planner.plan(planner.Candidate(0, ddp=True), facts, profile, 2, 2)
    return planner.plan(planner.Candidate(zero["stage"]), facts, profile, 2, 2, zero=zero)


def auto_budget(model_dir) -> int:
    """A budget a fraction of this machine's RAM, set by the ZeRO paper's fp32 accounting: plain data parallelism
    needs 16 bytes per parameter per rank (params 4 + grads 4 + Adam 8), which for the ~19M-parameter model is
    ~0.3 GB; with 4 GiB on top for the runtime (torch, DeepSpeed, communication: 0.4-0.6 GiB measured) and
    activations, every stage fits."""
    return 16 * model_facts(_model(model_dir)).num_params + 4 * 2**30


@pytest.fixture(scope="module")
def runs(tmp_path_factory, medium_model_dir) -> dict[str, list[dict]]:
    """The module's four 2-rank runs, each in fresh processes (each rank measures its own process), as many launches
    at a time as there are cores: by name, each rank's result.

    * ``planned_auto``: ``auto`` under :func:`auto_budget`; the planner picks ZeRO-0 and releases freed memory (the
      error band's ZeRO-0 case and the ``auto`` test);
    * ``planned_zero3``: ZeRO-3 under a memory budget; the planner plans it and releases freed memory, which its plan
      assumes (the error band's ZeRO-3 case and the freed-memory comparison);
    * ``zero2``: ZeRO-2 releasing freed memory, as a planned run does;
    * ``default_zero3``: the same ZeRO-3 run without a plan, glibc left as it is."""
    folder = tmp_path_factory.mktemp("memory")
    launches = {
        "planned_auto": ("auto", "--memory_per_device", str(auto_budget(medium_model_dir))),
        "planned_zero3": ("zero3", "--memory_per_device", "64GB"),
        "zero2": ("zero2", "--release_freed_memory", "on"),
        "default_zero3": ("zero3",),
    }
    run_together([_command(medium_model_dir, config, folder / name, *extra)
                  for name, (config, *extra) in launches.items()])  # fmt: skip
    return {name: _results(folder / name) for name in launches}


@pytest.mark.parametrize("config", ["zero0", "zero2", "zero3"])
def test_measured_peak_within_error_band(runs, medium_model_dir, config):
    """Peak RSS above the RSS before the model existed (model loading, engine, 3 steps), per rank. ZeRO-0 and ZeRO-3
    are planned runs (``auto`` chose ZeRO-0); ZeRO-2 releases freed memory as a planned run does."""
    results = runs[{"zero0": "planned_auto", "zero2": "zero2", "zero3": "planned_zero3"}[config]]
    if config == "zero0":
        assert results[0]["zero_stage"] == 0
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


def test_freed_memory_is_released_when_the_planner_plans(runs):
    """By default hf-ext leaves glibc as it is, as stock does; a planned run releases freed memory at once, which its
    plan assumes: the same ZeRO-3 run then peaks well lower."""
    default, planned = runs["default_zero3"], runs["planned_zero3"]
    assert not any(r["released_freed_memory"] for r in default) and default[0]["plan"] is None
    assert all(r["released_freed_memory"] for r in planned) and planned[0]["plan"] is not None
    for d, p in zip(default, planned):
        assert p["increment_bytes"] < 0.85 * d["increment_bytes"], (d["increment_bytes"], p["increment_bytes"])


def test_auto_with_a_small_budget_trains(runs, medium_model_dir):
    """`auto` under :func:`auto_budget`: every stage fits, so the least sharded one, ZeRO stage 0, is the answer, on
    both ranks; and the measured peak stays inside the budget."""
    budget = auto_budget(medium_model_dir)
    results = runs["planned_auto"]
    for r in results:
        assert r["world_size"] == 2
        assert r["zero_stage"] == 0 and r["offload_optimizer"] is None
        assert r["plan"]["name"] == "ZeRO-0" and r["plan"]["fits"] and r["plan"]["budget"] == budget
        assert r["plan"]["baseline"] + r["increment_bytes"] < budget
        assert math.isfinite(r["final_loss"])


def _model(model_dir):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(model_dir)
