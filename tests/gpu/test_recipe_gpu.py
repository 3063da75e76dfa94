"""The dialogue recipe on one GPU in bf16: its CPU twins are tests/distributed/test_recipe_distributed.py (training
that learns, output that loads, a real SIGTERM and the resume) and tests/distributed/test_saving_distributed.py (the
16-bit save under ZeRO-3).

Oracles:
* the 16-bit save against DeepSpeed's own ``zero_to_fp32`` of the run's last checkpoint (the fp32 master weights): in
  bf16 DeepSpeed's module weights are those masters cast to bf16 after every step, so the saved tensors are the
  masters rounded to bf16. Tolerance: one bf16 step (2**-7 relative: the cast rounds to nearest, and the saved copy was
  cast once, on the GPU); the printed count says how many are bit-equal;
* the preempted run, resumed, against the same run left uninterrupted. Both run with ``full_determinism`` (the GPU's
  atomic-add reductions, in the embedding backward for one, are otherwise free to sum in any order), so the resume
  repeats the same arithmetic: the CPU twin's tolerance (1e-5, measured 0 apart on the same ranks) applies.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, BlenderbotForConditionalGeneration

from ..conftest import RECIPE, ROOT, TINY_YAML, launch_env, run
from .conftest import DEVICE, max_abs_difference, one_gpu, report

STEPS = 30
RESUME_TOLERANCE = 1e-5  # as tests/distributed/test_recipe_distributed.py


def recipe_args(model_dir: Path, out: Path, stage: int, *extra: str) -> list[str]:
    return ["--config", str(TINY_YAML), "--model_name_or_path", str(model_dir), "--output_dir", str(out),
            "--max_steps", str(STEPS), "--logging_steps", "1", "--bf16", "true", "--deepspeed", f"zero{stage}",
            "--save_strategy", "steps", "--save_steps", "10", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def recipe_runs(tiny_model_no_dropout_dir, tmp_path_factory) -> dict[int, Path]:
    """ZeRO-2 (deterministic kernels: the preemption test's oracle) and ZeRO-3, 30 steps each, under DeepSpeed's
    launcher, checkpoints every 10 steps."""
    runs = {}
    for stage, extra in ((2, ["--full_determinism", "true", "--samples_to_print", "0"]),
                         (3, ["--samples_to_print", "2"])):  # fmt: skip
        out = tmp_path_factory.mktemp(f"recipe-zero{stage}")
        run(one_gpu("deepspeed", RECIPE) + recipe_args(tiny_model_no_dropout_dir, out, stage, *extra))
        runs[stage] = out
    return runs


def losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row["loss"] for row in history if "loss" in row}


@pytest.mark.parametrize("stage", [2, 3])
def test_recipe_trains_in_bf16_and_its_16bit_save_is_the_master_weights(stage, recipe_runs):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = recipe_runs[stage]
    results = json.loads((out / "all_results.json").read_text())
    assert results["run"]["engine"] == "DeepSpeedEngine" and results["run"]["zero_stage"] == stage
    assert results["run"]["world_size"] == 1
    resolved = json.loads((out / "deepspeed_config.resolved.json").read_text())
    assert resolved["bf16"]["enabled"] is True and '"auto"' not in json.dumps(resolved)
    per_step = losses(out)
    assert sorted(per_step) == list(range(1, STEPS + 1)) and per_step[STEPS] < per_step[1]

    saved = load_file(out / "model.safetensors")
    # the 16-bit save of a bf16 run: every parameter in bf16. A buffer (BlenderBot's final_logits_bias) is saved as
    # the engine holds it: DeepSpeed casts the whole module under ZeRO-3, the parameters only under ZeRO-2
    buffers = {n for n, _ in BlenderbotForConditionalGeneration(AutoConfig.from_pretrained(out)).named_buffers()}
    assert {k for k, t in saved.items() if t.dtype != torch.bfloat16} <= buffers
    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / f"checkpoint-{STEPS}"))
    assert set(saved) <= set(masters)
    exact = sum(torch.equal(saved[k], masters[k].to(torch.bfloat16)) for k in saved)
    for k, tensor in saved.items():
        torch.testing.assert_close(tensor.float(), masters[k], rtol=2**-7, atol=0, msg=k)
    report(f"recipe ZeRO-{stage} bf16", losses=[per_step[1], per_step[STEPS]], tensors=len(saved),
           bit_equal_to_masters=exact)  # fmt: skip

    model = BlenderbotForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16).to(DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(out)
    reply = model.generate(**tokenizer(["Hello, how are you?"], return_tensors="pt").to(DEVICE), max_new_tokens=8,
                           min_length=2, num_beams=1)  # fmt: skip
    assert reply.shape[1] > 1


def test_a_sigterm_saves_one_checkpoint_and_the_resume_ends_as_the_uninterrupted_run(
    recipe_runs, tiny_model_no_dropout_dir, tmp_path
):
    out = tmp_path / "out"
    args = recipe_args(tiny_model_no_dropout_dir, out, 2, "--full_determinism", "true", "--samples_to_print", "0",
                       "--do_eval", "false", "--save_strategy", "no")  # fmt: skip
    proc = subprocess.run(one_gpu("torchrun", RECIPE) + args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=launch_env(HF_EXT_TEST_SIGNAL_AT="8:SIGTERM:self"))  # fmt: skip
    log = proc.stdout + proc.stderr
    assert "SIGTERM to self" in log, log[-4000:]
    saved = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert saved == ["checkpoint-9"], (saved, log[-4000:])
    assert "Preempted (SIGTERM): checkpoint-9 is saved" in log
    assert set(re.findall(r"exitcode\s*: (-?\d+)", log)) == {"75"}, log[-3000:]

    started = time.monotonic()
    run(one_gpu("torchrun", RECIPE) + args + ["--resume_from_checkpoint", "True"])
    expected, got = load_file(recipe_runs[2] / "model.safetensors"), load_file(out / "model.safetensors")
    difference = max_abs_difference(expected, got)
    report("preemption ZeRO-2 bf16", resumed_weights_max_abs_diff=difference,
           resume_seconds=round(time.monotonic() - started, 1))  # fmt: skip
    assert difference <= RESUME_TOLERANCE
    assert losses(out) == pytest.approx(losses(recipe_runs[2]), rel=1e-6)
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
