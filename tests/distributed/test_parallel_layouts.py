"""DeepSpeed AutoTP on 2 real CPU ranks (gloo): hf-ext fills the ``train_batch_size`` DeepSpeed's batch check wants
(it counts the tensor-parallel ranks: 2 ranks x micro-batch 2 x accumulation 2 = 8), the Trainer counts the rows one
step trains on by the data-parallel ranks (4, stock's arithmetic), and the run computes what one rank computes
without tensor parallelism on the same rows (tests/distributed/workers/autotp_train.py). Its checkpoint of step 3,
resumed on the same ranks, is loaded as written (no universal conversion: hf-ext reads DeepSpeed's data- and
tensor-parallel sizes from it) with the same 4 rows a step, and steps 4-6 repeat the uninterrupted run's; resumed on
1 rank without tensor parallelism, it goes through DeepSpeed's universal checkpoint, and steps 4-6 are AutoTP's too
(and so for the Ulysses run's checkpoint-3).

Beside it, DeepSpeed's Ulysses sequence parallelism (accelerate's ``ParallelismConfig``, sp_size 2) on the same 2 ranks:
its all-to-all runs on gloo, and the run takes the one rank's rows in the same order, counts each token once and has
its losses (:func:`check_ulysses`).

The config-level rules (Ulysses on more ranks, context parallelism, 4 and 8 ranks, the planner, padding-free refused
with a split sequence): tests/unit/test_parallel_layout.py.
"""

from __future__ import annotations

import json

import pytest

from hf_ext.saving.resume import read_zero_checkpoint

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run, run_side_by_side

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "autotp_train.py"
#: AutoTP splits each projection's sum over the 2 ranks and adds the halves with an all-reduce: fp32 order only.
#: Measured: losses (about 6.9) 2.7e-7 apart relative, grad norms (about 2.3) 3.1e-6; 2e-5 is 6x the larger.
TOLERANCE = 2e-5


def test_autotp_trains_what_one_rank_trains_with_the_batch_deepspeed_checks(tiny_chat_model_dir, tmp_path):
    sharded, single, ulysses = tmp_path / "autotp.json", tmp_path / "one.json", tmp_path / "ulysses.json"
    common = ["--model", str(tiny_chat_model_dir)]
    procs = run_side_by_side([[*launcher_cmd(TRAIN_LAUNCHER, WORKER), *common, "--out", str(sharded), "--autotp", "2",
                               "--resume"],
                              [*launcher_cmd("python", WORKER), *common, "--out", str(single)],
                              [*launcher_cmd(TRAIN_LAUNCHER, WORKER), *common, "--out", str(ulysses), "--ulysses", "2",
                               "--checkpoint"]],
                             timeout=600)  # fmt: skip
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    tp, one = json.loads(sharded.read_text()), json.loads(single.read_text())
    check_ulysses(json.loads(ulysses.read_text()), one)
    assert tp["world_size"] == 2 and tp["deepspeed_train_batch_size"] == 8  # DeepSpeed accepted it and trained
    assert tp["rows_per_step"] == one["rows_per_step"] == 4
    assert tp["rows"][0] == tp["rows"][1] == one["rows"][0]  # both ranks of the group share each micro-batch
    assert tp["tokens_seen"] == one["tokens_seen"] == 6 * 4 * 12  # 6 steps of 4 rows of 12 tokens, each counted once
    assert len(tp["losses"]) == 6
    assert tp["losses"] == pytest.approx(one["losses"], rel=TOLERANCE)
    assert tp["grad_norms"] == pytest.approx(one["grad_norms"], rel=TOLERANCE)
    # the checkpoint as DeepSpeed wrote it: each tensor-parallel rank its slice, one data-parallel rank per slice
    written = read_zero_checkpoint(tmp_path / "autotp.json.run" / "checkpoint-3")
    assert (written.world_size, written.tensor_parallel, written.train_batch_size) == (1, 2, 8)
    assert written.rows_per_step == 4
    assert tp["resume_kind"] == "as_written" and tp["resumed_accumulation"] == 2
    # the same ranks, engine and rows: the same arithmetic as the uninterrupted steps 4-6 (measured 0 apart)
    assert tp["resumed_losses"] == pytest.approx(tp["losses"][3:], rel=1e-6)

    # and on another layout: 1 rank, ZeRO-1 without tensor or sequence parallelism, through DeepSpeed's universal
    # checkpoint, with the global batch of 4 rows kept: AutoTP's checkpoint-3 (ds_to_universal merges its slices) and
    # Ulysses' (ZeRO-1's partitions of its 2 ranks; DeepSpeed records its sequence-parallel size as the tensor-parallel
    # one, which hf-ext corrects for ds_to_universal), one after the other in one launch. Steps 4-6 are each run's own
    # within the tolerances above against one rank (measured: losses 1.4e-7 and 6.9e-8 apart relative, grad norms
    # 1.0e-7 for both)
    elsewhere = tmp_path / "one-resumed.json"
    written = [tmp_path / f"{name}.json.run" / "checkpoint-3" for name in ("autotp", "ulysses")]
    proc = run(launcher_cmd(TRAIN_LAUNCHER, WORKER, nproc=1) + [*common, "--out", str(elsewhere), "--resume_from",
                                                               *map(str, written)])  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "Resuming checkpoint-3 (written on 2 ranks, tensor-parallel 2) on 1: loaded from the DeepSpeed" in log
    moved = json.loads(elsewhere.read_text())
    assert moved["world_size"] == 1
    for resumed, uninterrupted in zip(moved["resumes"], (tp, json.loads(ulysses.read_text()))):
        assert (resumed["kind"], resumed["accumulation"]) == ("universal", 2)
        assert resumed["losses"][:3] == uninterrupted["losses"][:3]  # the checkpoint's own history
        assert resumed["losses"] == pytest.approx(uninterrupted["losses"], rel=TOLERANCE)
        assert resumed["grad_norms"] == pytest.approx(uninterrupted["grad_norms"], rel=TOLERANCE)


def in_order(rows_by_step: dict) -> list[int]:
    """The rows a rank's dataloader gave, in order (the record is by the step they were collated in)."""
    return [row for step in sorted(rows_by_step, key=int) for row in rows_by_step[step]]


#: Ulysses splits each row's sequence over the 2 ranks and exchanges the attention heads with an all-to-all: each
#: sum runs in another order. Measured: losses (about 6.9) 1.4e-7 apart relative; 2e-5 is the AutoTP bound above.
def check_ulysses(sp: dict, one: dict) -> None:
    """DeepSpeed's Ulysses (accelerate's ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")``) on 2 gloo ranks:
    one data-parallel rank, so 4 rows a step (stock's arithmetic) and a DeepSpeed ``train_batch_size`` of 4 (the unit
    accelerate passes DeepSpeed divides the world by the sequence-parallel size); the same rows in the same order as
    one rank without it, each token counted once, the same losses."""
    assert sp["world_size"] == 2 and sp["rows_per_step"] == one["rows_per_step"] == 4
    assert sp["deepspeed_train_batch_size"] == 4
    # DeepSpeed's dataloader adapter: both ranks train rank 0's micro-batch, then rank 1's (sliced by sequence)
    first, second = in_order(sp["rows"][0]), in_order(sp["rows"][1])
    taken = [row for i in range(0, len(first), 2) for row in first[i : i + 2] + second[i : i + 2]]
    assert taken[: 6 * 4] == in_order(one["rows"][0])[: 6 * 4]
    assert sp["tokens_seen"] == one["tokens_seen"] == 6 * 4 * 12
    assert sp["losses"] == pytest.approx(one["losses"], rel=TOLERANCE)
    # the step's gradient is the one rank's: its norm, which DeepSpeed computes on the gradient it applies and clips
    # with. Without hf-ext's correction (hf_ext.loss.ulysses_gradient_factor) transformers 5.23 + DeepSpeed 0.19 give
    # exactly 2x the norm at sp_size 2, and the gradient is 2x too: the losses above still match, as Adam does not
    # see a gradient's scale, but plain SGD without clipping moved the weights twice as far (measured with
    # autotp_train.py's --optim sgd --max_grad_norm 1e9), and clipping acted at half of max_grad_norm
    assert sp["grad_norms"] == pytest.approx(one["grad_norms"], rel=TOLERANCE)
