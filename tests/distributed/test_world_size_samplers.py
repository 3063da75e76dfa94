"""An uninterrupted run on 1 rank and on 2 ranks at the same global batch is the same run, step by step, for each
training sampler the recipe offers (tests/distributed/workers/sampler_oracle.py: padding-free, rows of varied
lengths, 2 epochs). The same rows make the same count of real tokens at every step; the losses and grad norms then
differ only by fp32 summation order (all-reduce over 2 ranks against accumulation on 1), within the engine oracle's
tolerances (tests/distributed/test_engines.py, the same cause). Stock's group_by_length groups by one rank's
micro-batch x accumulation and takes other rows on 2 ranks (its tokens per step differ from step 1)."""

from __future__ import annotations

import json

import pytest

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run
from .test_engines import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "sampler_oracle.py"
SAMPLERS = ("random", "sequential", "group_by_length", "batch_rebalance")


@pytest.fixture(scope="module")
def runs(tiny_chat_model_dir, tmp_path_factory) -> dict[int, dict[str, dict]]:
    found = {}
    for ranks, accumulation in ((1, 2), (2, 1)):
        out = tmp_path_factory.mktemp(f"samplers{ranks}") / "runs.json"
        run(launcher_cmd(TRAIN_LAUNCHER, WORKER, nproc=ranks) + ["--model", str(tiny_chat_model_dir), "--out",
                                                                 str(out), "--accum", str(accumulation)])  # fmt: skip
        found[ranks] = {r["sampler"]: r for r in json.loads(out.read_text())}
    return found


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_one_rank_and_two_ranks_train_the_same_steps(sampler, runs):
    one, two = runs[1][sampler], runs[2][sampler]
    assert (one["world_size"], one["accumulation"], two["world_size"], two["accumulation"]) == (1, 2, 2, 1)
    assert len(one["losses"]) == len(two["losses"]) == 12  # 48 rows, a global batch of 8, 2 epochs
    assert one["tokens_seen"] == two["tokens_seen"]  # the same rows at every step
    assert two["losses"] == pytest.approx(one["losses"], rel=LOSS_TOLERANCE)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=GRAD_NORM_TOLERANCE)
    if sampler == "group_by_length":  # stock's order, grouped by the global batch (hf_ext.packing)
        assert one["sampler_class"] == two["sampler_class"] == "GlobalLengthGroupedSampler"
