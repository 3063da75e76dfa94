"""DeepSpeed AutoTP on 2 real CPU ranks (gloo): hf-ext fills the ``train_batch_size`` DeepSpeed's batch check wants
(it counts the tensor-parallel ranks: 2 ranks x micro-batch 2 x accumulation 2 = 8), the Trainer counts the rows one
step trains on by the data-parallel ranks (4, stock's arithmetic), and the run computes what one rank computes
without tensor parallelism on the same rows (tests/distributed/workers/autotp_train.py). Its checkpoint of step 3,
resumed on the same ranks, is loaded as written (no universal conversion: hf-ext reads DeepSpeed's data- and
tensor-parallel sizes from it) with the same 4 rows a step, and steps 4-6 repeat the uninterrupted run's.

The config-level rules (Ulysses sequence parallelism, context parallelism, 4 and 8 ranks, the planner, padding-free
refused with a split sequence): tests/unit/test_parallel_layout.py.
"""

from __future__ import annotations

import json

import pytest

from hf_ext.saving.resume import read_zero_checkpoint

from ..conftest import ROOT, launcher_cmd, run_side_by_side

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "autotp_train.py"
#: AutoTP splits each projection's sum over the 2 ranks and adds the halves with an all-reduce: fp32 order only.
#: Measured: losses (about 6.9) 2.7e-7 apart relative, grad norms (about 2.3) 3.1e-6; 2e-5 is 6x the larger.
TOLERANCE = 2e-5


def test_autotp_trains_what_one_rank_trains_with_the_batch_deepspeed_checks(tiny_chat_model_dir, tmp_path):
    sharded, single = tmp_path / "autotp.json", tmp_path / "one.json"
    common = ["--model", str(tiny_chat_model_dir)]
    procs = run_side_by_side([[*launcher_cmd("torchrun", WORKER), *common, "--out", str(sharded), "--autotp", "2",
                               "--resume"],
                              [*launcher_cmd("python", WORKER), *common, "--out", str(single)]], timeout=600)  # fmt: skip
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    tp, one = json.loads(sharded.read_text()), json.loads(single.read_text())
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
