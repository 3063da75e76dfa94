"""The model, evaluation rows and single-process reference shared by the BLEU eval tests of the integration and
distributed tiers (fixtures in tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BlenderbotForConditionalGeneration,
    DataCollatorForSeq2Seq,
)

import hf_ext
from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from chat_e.data.dialogue import family_of
from hf_ext.evaluation.bleu import generate_in_order
from hf_ext.model_info import model_class

N_EVAL = 18  # 5 batches of 4 on 2 ranks: one rank runs an extra, discarded generate() call under ZeRO-3
GEN = dict(num_beams=1, max_length=24, min_length=1)
EOS = 2


def eval_dataset(tokenizer, n: int = N_EVAL, family: str = "seq2seq"):
    """Same rows as tests/distributed/workers/bleu_eval_worker.py's ``eval_split``."""
    data_args = DataArguments(max_target_length=32)
    rows = load_dialogue_dataset(data_args)["train"].select(range(n))
    return tokenize_dataset(rows, tokenizer, data_args, family=family)


def build_eval_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny BlenderBot trained a few dozen steps, with its ``</s>`` logit bias set so that greedy replies end at
    many different lengths (a briefly trained model otherwise ends every reply at once, or never)."""
    out = tmp_path_factory.mktemp("bleu_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data_args = DataArguments(max_source_length=48, max_target_length=16)
    train = tokenize_dataset(load_dialogue_dataset(data_args)["train"].select(range(320)), tokenizer, data_args)
    torch.manual_seed(0)
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    args = hf_ext.Seq2SeqTrainingArguments(
        str(out / "run"), max_steps=40, per_device_train_batch_size=8, learning_rate=5e-3, report_to="none",
        save_strategy="no", generation_eval=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    hf_ext.Seq2SeqTrainer(model=model, args=args, train_dataset=train, data_collator=collator).train()
    model.eval()
    rows = list(eval_dataset(tokenizer))
    base = model.final_logits_bias[0, EOS].item()
    best = (0, 0.0, 0.0)
    for shift in np.arange(-2.0, 2.01, 0.5):
        model.final_logits_bias[0, EOS] = base + shift
        _, lengths, _ = generate_in_order(model, tokenizer, rows, GEN, batch_size=4)
        best = max(best, (len(set(lengths)), -abs(shift), float(shift)))
    model.final_logits_bias[0, EOS] = base + best[2]
    shutil.rmtree(out / "run", ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def decoded_labels(tokenizer, dataset) -> list[str]:
    return [
        tokenizer.decode([t for t in ids if t >= 0], skip_special_tokens=True).strip() for ids in dataset["labels"]
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def evaluate_single_rank(eval_model_dir, tokenizer, tmp_path_factory) -> dict:
    """hf-ext's Seq2SeqTrainer, one process, no DeepSpeed: the reference of the 2-rank runs."""
    out = tmp_path_factory.mktemp("single")
    config = AutoConfig.from_pretrained(eval_model_dir)
    family = family_of(config)
    model = model_class(config).from_pretrained(eval_model_dir)
    args = hf_ext.Seq2SeqTrainingArguments(
        str(out), per_device_eval_batch_size=4, generation_batch_size=4, generation_num_beams=1,
        generation_max_length=24, generation_min_length=1, report_to="none", log_samples=3,
    )  # fmt: skip
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=eval_dataset(tokenizer, family=family),
        data_collator=DataCollatorForSeq2Seq(
            tokenizer, model=model if family == "seq2seq" else None, label_pad_token_id=-100
        ),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    rows = trainer.bleu_eval_callback.last_evaluation.rows
    return {"metrics": metrics, "generations": [r["generation"] for r in rows], "out": out, "trainer": trainer}
