"""Preemption in one process (no launcher): a real SIGTERM at an exact step ends the run with one complete
checkpoint (adapter-only under LoRA) and exit status 75, and the resumed run ends where the uninterrupted one did.
The 2-rank runs (a signal to one rank, to torchrun or to DeepSpeed's launcher; ZeRO-2, ZeRO-3, FSDP2) and Ray's:
tests/distributed/test_recipe_distributed.py.

Tolerance of the resumed weights: one process, the same kernels and the same order of operations on both sides, but
the resumed run reloads the optimizer and RNG state through files; measured 0 apart here. 1e-7 allows for a platform
whose kernels round a reloaded state's arithmetic differently, and is far below the 8 resumed steps' update (~1e-3).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from transformers import BlenderbotForConditionalGeneration, default_data_collator

import hf_ext
from hf_ext.preemption import PREEMPTED_EXIT_CODE
from hf_ext.saving import checkpoints

from ..conftest import ROOT
from ..launched.signal_at import SignalAt
from ..saving_support import synthetic_rows

pytestmark = pytest.mark.slow

TOLERANCE = 1e-7


def trainer_for(model_dir, out, *callbacks, lora: bool = False, **overrides):
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=12, learning_rate=1e-3,
                    save_strategy="no", report_to=[], seed=0, disable_tqdm=True, logging_steps=1)  # fmt: skip
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
    if lora:  # the same adapter initialisation in every run
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return hf_ext.Trainer(model=model, args=hf_ext.TrainingArguments(**{**settings, **overrides}),
                          train_dataset=synthetic_rows(48, model.config.vocab_size),
                          data_collator=default_data_collator, callbacks=list(callbacks))  # fmt: skip


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigterm_saves_one_checkpoint_exits_75_and_resumes_to_the_same_weights(tiny_model_dir, tmp_path, lora):
    uninterrupted = trainer_for(tiny_model_dir, tmp_path / "full", lora=lora)
    uninterrupted.train(resume_from_checkpoint="last")  # nothing to resume yet: from the start

    # SIGTERM at the end of step 3, agreed on every 2 steps (during step 4): the run saves checkpoint-4 and nothing else
    out = tmp_path / "preempted"
    with pytest.raises(SystemExit) as exited:
        trainer_for(tiny_model_dir, out, SignalAt(3, rank=0), lora=lora, save_on_preemption_check_steps=2).train()
    assert exited.value.code == PREEMPTED_EXIT_CODE
    assert [p.name for p in out.iterdir() if "checkpoint" in p.name] == ["checkpoint-4"]
    assert checkpoints.is_complete_checkpoint(out / "checkpoint-4")
    weights_files = {p.name for p in (out / "checkpoint-4").glob("*.safetensors")}
    assert ("adapter_model.safetensors" in weights_files) is lora  # LoRA: the adapter, never the base model
    assert ("model.safetensors" in weights_files) is not lora
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # in-process: given back before the exit

    resumed = trainer_for(tiny_model_dir, out, lora=lora)
    resumed.train(resume_from_checkpoint="last")  # as a requeued job's unchanged command gives it
    assert resumed.state.global_step == 12 and resumed.resume_plan.checkpoint.name == "checkpoint-4"
    full, ours = weights(uninterrupted), weights(resumed)
    assert max((full[k] - ours[k]).abs().max().item() for k in full) <= TOLERANCE


def test_save_on_preemption_false_leaves_the_signals_alone(tiny_model_dir, tmp_path):
    seen = []

    class Record(SignalAt):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(signal.getsignal(signal.SIGTERM))

    trainer_for(tiny_model_dir, tmp_path, Record(0), save_on_preemption=False, max_steps=2).train()
    assert seen == [signal.SIG_DFL, signal.SIG_DFL]


def test_beside_enable_jit_checkpoint_the_other_signals_stay_hf_exts(tiny_model_dir, tmp_path, caplog):
    """SIGTERM is stock's JIT checkpoint's (tests/peer/test_peer_jit_checkpoint.py); SIGUSR1 still saves the agreed
    checkpoint and exits 75, and the run says which signal does what in one line."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited, caplog.at_level("WARNING", logger="hf_ext.preemption"):
        trainer_for(tiny_model_dir, out, SignalAt(2, "SIGUSR1", rank=0), enable_jit_checkpoint=True).train()
    assert exited.value.code == PREEMPTED_EXIT_CODE
    assert [p.name for p in out.iterdir()] == ["checkpoint-3"]
    said = [r.getMessage() for r in caplog.records if "enable_jit_checkpoint" in r.getMessage()]
    assert said == [
        "enable_jit_checkpoint=True: SIGTERM is transformers' JIT checkpoint's (a checkpoint once its 3 s kill wait "
        "is over, then train() returns); save_on_preemption keeps SIGUSR1 (exit status 75)."
    ]


def test_a_train_that_raises_gives_the_signals_back(tiny_model_dir, tmp_path):
    class Fail(SignalAt):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("a failure inside training")

    with pytest.raises(RuntimeError, match="a failure inside training"):
        trainer_for(tiny_model_dir, tmp_path, Fail(0), max_steps=2).train()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_training_loop_started_again_gives_back_the_handlers_from_before_it():
    """auto_find_batch_size starts the loop again after an out-of-memory error: on_train_begin twice, one end."""
    from hf_ext.preemption import PreemptionCallback

    callback = PreemptionCallback()
    args = SimpleNamespace(save_on_preemption=True, save_on_preemption_signals=["SIGTERM"])
    callback.on_train_begin(args, None, None)
    callback.on_train_begin(args, None, None)
    assert signal.getsignal(signal.SIGTERM) == callback._handle
    callback.release()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from types import SimpleNamespace
    from hf_ext.preemption import PreemptionCallback
    callback = PreemptionCallback()
    args = SimpleNamespace(save_on_preemption=True, save_on_preemption_signals=["SIGUSR1", "SIGTERM"])
    callback.on_train_begin(args, None, None)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # within the window: the same preemption
    print("after the repeat:", callback.received, flush=True)
    time.sleep(float(sys.argv[1]))
    os.kill(os.getpid(), signal.SIGTERM)  # after it: exit at once
    print("not reached", flush=True)
""")


def test_a_repeated_signal_is_one_preemption_and_a_later_one_exits_at_once():
    from hf_ext.preemption import REPEAT_WINDOW_S

    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPEAT_WINDOW_S + 0.5)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert f"after the repeat: {int(signal.SIGUSR1)}" in proc.stdout, proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "SIGTERM again: exiting now" in proc.stderr
