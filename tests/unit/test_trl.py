"""hf_ext.trl's classes built on TRL's own (no training: the 2-rank runs are tests/distributed/test_trl.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_ext
import hf_ext.trl


@pytest.fixture(scope="module")
def chat(tiny_chat_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir), AutoTokenizer.from_pretrained(
        tiny_chat_model_dir
    )


def preference_rows() -> Dataset:
    return Dataset.from_list([{"prompt": "Hi", "chosen": " Hello!", "rejected": " No."}] * 4)


def test_configs_default_to_the_hardwares_precision_and_checkpointing_without_a_deprecation(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stock TRL's configs warn about their own `gradient_checkpointing` default
        ours = hf_ext.trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    stock = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    # TRL's default is bf16 unless fp16, on a CPU too, where bf16 autocast trains far slower: hf-ext's is fp32 there
    assert stock.bf16 is True and ours.bf16 is False
    assert hf_ext.trl.DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=True, use_cpu=True).bf16 is True
    assert ours.activation_checkpointing == stock.activation_checkpointing is True
    assert hf_ext.trl.DPOConfig(output_dir=str(tmp_path), report_to=[], fp16=True, use_cpu=True).bf16 is False
    # the TRL fields and the hf-ext fields, on one class
    assert ours.beta == stock.beta and ours.save_gather_size == "256MiB"
    assert isinstance(ours, trl.DPOConfig) and isinstance(ours, hf_ext.TrainingArgumentsMixin)


def test_sft_config_carries_the_generation_eval_settings(tmp_path):
    config = hf_ext.trl.SFTConfig(output_dir=str(tmp_path), report_to=[], generation_batch_size=3)
    assert config.generation_eval is True and config.generation_batch_size == 3
    with pytest.raises(ValueError, match="generation_batch_size"):
        hf_ext.trl.SFTConfig(output_dir=str(tmp_path), report_to=[], generation_batch_size=0)


def test_stock_config_passed_in_the_position_of_args_becomes_hf_exts(chat, tmp_path):
    # DPOTrainer(model, ref_model, args, ...): args is third, found by name in TRL's signature
    model, tokenizer = chat
    stock = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, beta=0.3, max_steps=1)
    trainer = hf_ext.trl.DPOTrainer(model, None, stock, train_dataset=preference_rows(), processing_class=tokenizer)
    assert type(trainer.args) is hf_ext.trl.DPOConfig
    assert trainer.args.beta == 0.3 and trainer.args.max_steps == 1
    assert any(isinstance(cb, hf_ext.MemoryPlanCallback) for cb in trainer.callback_handler.callbacks)


def test_an_encoder_decoder_model_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    # the model itself, and its path, as docs/trl.md passes it (TRL then loads it)
    for model in (AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir), str(tiny_model_dir)):
        with pytest.raises(ValueError, match=r"decoder-only models only .* hf_ext\.Seq2SeqTrainer") as err:
            hf_ext.trl.SFTTrainer(model, args=hf_ext.trl.SFTConfig(output_dir=str(tmp_path), report_to=[]),
                                  train_dataset=Dataset.from_list([{"text": "hi"}]))  # fmt: skip
        assert "\n" not in str(err.value)


def test_a_subclass_whose_base_adds_to_a_replaced_method_is_refused():
    class Base(transformers.Trainer):
        def save_model(self, *args, **kwargs):
            return super().save_model(*args, **kwargs)

    with pytest.raises(TypeError, match=r"Base\.save_model would be skipped"):

        class Mine(hf_ext.TrainerMixin, Base):
            pass

    class Merged(hf_ext.TrainerMixin, Base):  # merging it itself is fine
        def save_model(self, *args, **kwargs):
            return super().save_model(*args, **kwargs)


def test_own_subclass_with_the_public_mixins(chat, tmp_path):
    """What docs/trl.md shows for any other Trainer subclass: the two mixins, nothing else."""

    @dataclass
    class MyConfig(hf_ext.TrainingArgumentsMixin, trl.KTOConfig):
        pass

    class MyKTO(hf_ext.TrainerMixin, trl.KTOTrainer):
        args_class = MyConfig

        def _save_checkpoint(self, model, trial):  # KTOTrainer's own adds a model card first
            self.create_model_card(model_name="mine")
            super()._save_checkpoint(model, trial)

    model, tokenizer = chat
    rows = Dataset.from_list([{"prompt": "Hi", "completion": " Hello!", "label": bool(i % 2)} for i in range(4)])
    trainer = MyKTO(model, args=trl.KTOConfig(output_dir=str(tmp_path), report_to=[], bf16=False),
                    train_dataset=rows, processing_class=tokenizer)  # fmt: skip
    assert type(trainer.args) is MyConfig and trainer.args.save_max_shard_size == "5GB"


@pytest.mark.parametrize("given", ["zero3", "file", "auto"])
def test_trl_configs_resolve_every_deepspeed_form(given, tiny_chat_model_dir, tmp_path, no_global_deepspeed_config):
    """A preset, a JSON file full of "auto", and "auto" itself (the memory planner picks the stage and the micro-batch):
    DeepSpeed's own parser takes the result, with the batch arithmetic of this world."""
    import json

    from ..conftest import walk
    from ..ds_support import deepspeed_accepts

    extra = {}
    if given == "file":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({
            "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
        }))  # fmt: skip
        given = str(path)
    elif given == "auto":
        extra = dict(per_device_train_batch_size="auto", plan_model=str(tiny_chat_model_dir), plan_seq_len=16,
                     memory_per_device="4GB")  # fmt: skip
    config = hf_ext.trl.DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, deepspeed=given, **extra)
    resolved = config.deepspeed
    deepspeed_accepts(resolved, world_size=1)
    assert resolved["train_micro_batch_size_per_gpu"] == config.per_device_train_batch_size >= 1
    deferred = {c.key for c in config.deepspeed_resolution.changes if c.action == "deferred"}
    assert {key for key, value in walk(resolved) if value == "auto"} <= deferred  # the model's keys, at the trainer
    if extra:
        assert config.memory_plan is not None


def test_kto_sft_weight_adds_the_desirable_completions_nll(tiny_chat_model_dir, tmp_path):
    """KTO's loss plus sft_weight times the NLL per token of the desirable completions, the NLL recomputed here from
    the model's plain logits (not TRL's fused head); a batch without a desirable row adds 0, and a negative weight
    is refused in one line."""
    import torch

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    rows = [{"prompt": f"Hi {i}", "completion": [" Hello there!", " No.", " Fine, and you?", " Go."][i],
             "label": i % 2 == 0} for i in range(4)]  # fmt: skip
    args = hf_ext.trl.KTOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4,
                                sft_weight=0.5, use_cpu=True)  # fmt: skip
    trainer = hf_ext.trl.KTOTrainer(
        model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.eval()
    with torch.no_grad():
        with_term = trainer.compute_loss(trainer.model, batch)
        trainer.args.sft_weight = 0.0
        kto_alone = trainer.compute_loss(trainer.model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logps = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    counted = (batch["completion_mask"][:, 1:] != 0) & torch.as_tensor(batch["label"], dtype=torch.bool)[:, None]
    assert 2 <= counted.any(-1).sum() < len(rows)  # desirable rows and undesirable ones in the batch
    nll = -(logps * counted).sum() / counted.sum()
    # the two paths differ only by summation order (float32 log-softmax over the vocabulary: ~1e-6)
    assert (with_term - kto_alone).item() == pytest.approx(0.5 * nll.item(), abs=1e-5)

    trainer.args.sft_weight = 0.5
    only_bad = {**batch, "label": torch.zeros_like(torch.as_tensor(batch["label"]))}
    assert trainer._desirable_nll(trainer.model, only_bad).item() == 0.0
    assert trainer._metrics["eval"]["sft_loss"]  # the term's value is logged beside KTO's metrics

    with pytest.raises(ValueError, match=r"^sft_weight=-1\.0: give 0"):
        hf_ext.trl.KTOConfig(output_dir=str(tmp_path), report_to=[], sft_weight=-1.0)
