"""hf_ext.trl on one GPU in bf16 (``make test-gpu``; never part of ``make test``): the CPU tier's SFT and DPO runs
(tests/distributed/test_trl.py) on CUDA, NCCL and DeepSpeed's fused Adam, stock TRL beside hf-ext's.

GPU kernels sum in their own order (atomics in the embedding backward, split reductions), so stock and hf-ext are
compared within bf16's resolution (2**-7 relative) rather than for equality; the printed differences are what the
closing note reports.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import ROOT, free_port, run

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "trl_train.py"


@pytest.fixture(scope="module")
def gpu_chat_model(tmp_path_factory) -> Path:
    """The tiny chat model: ``HF_EXT_GPU_MODEL`` (a copy carried to a machine without the corpora), else built."""
    if os.environ.get("HF_EXT_GPU_MODEL"):
        return Path(os.environ["HF_EXT_GPU_MODEL"])
    from chat_e.data.models import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny_chat", "tiny", seed=0)


@pytest.mark.parametrize("trainer, stage", [("sft", 2), ("dpo", 3)])
def test_trl_trainer_in_bf16_on_one_gpu(trainer, stage, gpu_chat_model, tmp_path):
    assert torch.cuda.is_available()
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_port",
        str(free_port()),
    ]
    run([*launch, str(SCRIPT), "--trainer", trainer, "--stage", str(stage), "--bf16", "--model", str(gpu_chat_model),
         "--out", str(tmp_path)])  # fmt: skip
    stock, ours = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("stock", "hf_ext"))
    differences = {step: abs(ours["losses"][step] - loss) for step, loss in stock["losses"].items()}
    print(f"{trainer} ZeRO-{stage} bf16: hf-ext {ours['losses']}, stock {stock['losses']}, |diff| {differences}")
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
