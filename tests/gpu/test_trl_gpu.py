"""hf_ext.trl on one GPU in bf16 (``make test-gpu``; never part of ``make test``): the CPU tier's SFT and DPO runs
(tests/distributed/test_trl.py) on CUDA, NCCL and DeepSpeed's fused Adam, stock TRL beside hf-ext's.

GPU kernels sum in their own order (atomics in the embedding backward, split reductions), so stock and hf-ext are
compared within bf16's resolution (2**-7 relative) rather than for equality; the printed differences are what the
closing note reports.
"""

from __future__ import annotations

import json

import pytest
import torch

from ..conftest import ROOT, run
from .conftest import one_gpu, report

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "trl_train.py"


@pytest.mark.parametrize("trainer, stage", [("sft", 2), ("dpo", 3)])
def test_trl_trainer_in_bf16_on_one_gpu(trainer, stage, tiny_chat_model_dir, tmp_path):
    run([*one_gpu("torchrun", SCRIPT), "--trainer", trainer, "--stage", str(stage), "--bf16", "--model", str(tiny_chat_model_dir),
         "--out", str(tmp_path)])  # fmt: skip
    stock, ours = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("stock", "hf_ext"))
    differences = {step: abs(ours["losses"][step] - loss) for step, loss in stock["losses"].items()}
    report(f"trl {trainer} ZeRO-{stage} bf16", hf_ext=ours["losses"], stock=stock["losses"], diff=differences)
    assert ours["losses"].keys() == stock["losses"].keys() == {"1", "2", "3", "4"}
    for step, loss in stock["losses"].items():
        assert ours["losses"][step] == pytest.approx(loss, rel=2**-7)
    assert ours["resolved"]["bf16"]["enabled"] is True

    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_ext")
    assert saved.dtype == torch.bfloat16  # the 16-bit save of a bf16 run
    gathered = torch.load(tmp_path / "hf_ext.pt")
    loaded = {n: p.detach().float() for n, p in saved.named_parameters(remove_duplicate=False)}
    assert loaded.keys() == gathered.keys()
    assert all(torch.equal(loaded[n], gathered[n]) for n in loaded)
    if trainer == "dpo":
        assert ours["reference_engine_config"]["bf16"]["enabled"] is True
