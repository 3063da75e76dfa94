"""Training features on one GPU in bf16, each beside its CPU twin:

* a LoRA checkpoint (adapter-sized) and its resume, padding-free, under ZeRO-3: tests/distributed/test_peft_checkpoint.py.
  Both runs use deterministic kernels, so the resume repeats the same arithmetic: the twin's 1e-6 holds;
* FSDP2 full shard and its save: tests/distributed/test_fsdp.py. The saved weights equal torch's own full state dict;
* padding-free batches under SDPA against stock's padded batches: tests/unit/test_padding_free.py. In bf16 the packed
  and padded products round differently (matrices of other shapes, so other blockings and other rounding of each
  partial sum), so the losses agree within bf16 resolution (2**-7 relative) and each parameter's gradient within 2**-5
  of its norm (a few roundings of 2**-8 each through the layers); a row that saw another row's tokens moves by far more,
  which the positive control shows on the same GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

import hf_ext
from hf_ext import peft as peft_checkpoint
from hf_ext.packing import padding_free_collator

from ..conftest import ROOT, run
from ..unit.test_padding_free import rows
from .conftest import DEVICE, max_abs_difference, one_gpu, report

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"
CHAT_LORA = ("--lora", "--lora_targets", "all-linear", "--epochs", "1", "--save_total_limit", "3", "--padding_free",
             "--stage", "3", "--batch", "4", "--bf16", "--full_determinism")  # fmt: skip


def trainable(state: dict) -> dict:
    return {k: v for k, v in state.items() if "lora_" in k}


def test_lora_checkpoint_is_adapter_sized_and_resumes_to_the_uninterrupted_adapter(tiny_chat_model_dir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run(one_gpu("deepspeed", SCRIPT) + ["--model", str(tiny_chat_model_dir), "--out", str(first / "out"), "--dump",
                                       str(first / "trained.pt"), *CHAT_LORA])  # fmt: skip
    checkpoint = first / "out" / "checkpoint-4"
    assert not list(checkpoint.glob("global_step*")) and not list(checkpoint.glob("model*.safetensors"))
    assert peft_checkpoint.verify_adapter(checkpoint)
    state = peft_checkpoint.read_trainable_state(checkpoint)
    assert state["world_size"] == 1 and state["optimizer_step"] == 4
    info = json.loads((first / "trained.pt.json").read_text())
    assert info["run"]["zero_stage"] == 3 and info["global_step"] == 8

    run(one_gpu("deepspeed", SCRIPT) + ["--model", str(tiny_chat_model_dir), "--out", str(second / "out"), "--dump",
                                       str(second / "trained.pt"), *CHAT_LORA, "--resume", str(checkpoint)])  # fmt: skip
    expected, got = (trainable(torch.load(p / "trained.pt")) for p in (first, second))
    difference = max_abs_difference(expected, got)
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir)
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    stored = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    report("LoRA ZeRO-3 bf16 padding-free", resumed_adapter_max_abs_diff=difference, checkpoint_bytes=stored,
           base_model_bytes=base_bytes)  # fmt: skip
    assert expected and difference <= 1e-6


def test_fsdp2_full_shard_trains_in_bf16_and_saves_its_weights(tiny_model_dir, tmp_path):
    run(one_gpu("torchrun", SCRIPT) + ["--model", str(tiny_model_dir), "--out", str(tmp_path / "out"), "--dump",
                                      str(tmp_path / "trained.pt"), "--fsdp", "full_shard", "--bf16", "--epochs",
                                      "1"])  # fmt: skip
    info = json.loads((tmp_path / "trained.pt.json").read_text())
    assert info["run"]["engine"] == "FSDP2" and info["run"]["fsdp"]["sharding"] == "full_shard"
    assert info["fsdp_units"]  # the layers are FSDP modules, as on CPU
    history = [row["loss"] for row in info["log_history"] if "loss" in row]
    assert history[-1] < history[0]
    gathered = torch.load(tmp_path / "trained.pt")
    saved = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    loaded = {n: p.detach() for n, p in saved.named_parameters(remove_duplicate=False)}
    assert loaded.keys() <= gathered.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, gathered[name].to(tensor.dtype).cpu()), name
    report(
        "FSDP2 full shard bf16", losses=[history[0], history[-1]], saved_dtype=str(next(iter(loaded.values())).dtype)
    )


@pytest.fixture(scope="module")
def bf16_model(tiny_chat_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16).to(DEVICE)  # fmt: skip
    model.config.use_cache = False
    return model, AutoTokenizer.from_pretrained(tiny_chat_model_dir)


def test_padding_free_loss_and_gradients_match_stock_padded_in_bf16(bf16_model, tmp_path):
    """hf-ext's packed batch against stock ``transformers.Trainer`` on the padded batch, through ``compute_loss``."""
    model, tokenizer = bf16_model
    examples = rows(model.config.vocab_size)
    args = dict(output_dir=str(tmp_path), report_to=[], bf16=True, use_cpu=DEVICE == "cpu")
    stock = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args), processing_class=tokenizer,
                                 data_collator=DataCollatorForSeq2Seq(tokenizer))  # fmt: skip
    ours = hf_ext.Trainer(model=model, args=hf_ext.TrainingArguments(**args, padding_free=True),
                          processing_class=tokenizer, data_collator=DataCollatorForSeq2Seq(tokenizer))  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    labelled = sum(int((torch.tensor(e["labels"][1:]) != -100).sum()) for e in examples)
    losses, grads = [], []
    for trainer in (stock, ours):
        batch = {k: v.to(DEVICE) for k, v in trainer.data_collator(examples).items()}
        loss = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(labelled, device=DEVICE))
        losses.append(loss.float())
        grads.append(torch.autograd.grad(loss, params))
    relative = [((g_ours.float() - g_stock.float()).norm() / g_stock.float().norm()).item()
                for g_stock, g_ours in zip(*grads) if g_stock.float().norm() > 0]  # fmt: skip
    report("padding-free bf16 sdpa", stock_loss=losses[0].item(), hf_ext_loss=losses[1].item(),
           worst_gradient_relative_difference=max(relative))  # fmt: skip
    torch.testing.assert_close(losses[1], losses[0], rtol=2**-7, atol=0)
    assert max(relative) <= 2**-5


def packed_logits(model, examples, position_ids=None) -> tuple[torch.Tensor, int]:
    """Logits of hf-ext's packed batch of ``examples`` on the model's device, and the first row's length."""
    batch = padding_free_collator(model, DataCollatorForSeq2Seq(None, label_pad_token_id=-100))(examples)
    positions = batch["position_ids"] if position_ids is None else position_ids
    logits = model(input_ids=batch["input_ids"].to(DEVICE), position_ids=positions.to(DEVICE)).logits
    return logits, len(examples[0]["input_ids"])


@torch.no_grad()
def test_no_token_attends_across_rows_under_sdpa_in_bf16(bf16_model):
    model, _ = bf16_model
    examples = rows(model.config.vocab_size)
    changed = [dict(e) for e in examples]
    changed[0] = dict(changed[0], input_ids=[4 + (t + 7) % 500 for t in examples[0]["input_ids"]])
    logits, first = packed_logits(model, examples)
    after, _ = packed_logits(model, changed)
    assert not torch.equal(after[0, :first], logits[0, :first])  # row 0 itself did change
    torch.testing.assert_close(after[0, first:], logits[0, first:], rtol=0, atol=0)  # no other row moved at all
    # positive control: positions running on across the rows make one sequence; then the later rows move
    joined_positions = torch.arange(logits.shape[1])[None]
    joined, _ = packed_logits(model, examples, joined_positions)
    joined_after, _ = packed_logits(model, changed, joined_positions)
    assert not torch.allclose(joined_after[0, first:], joined[0, first:])
