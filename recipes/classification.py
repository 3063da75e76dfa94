#!/usr/bin/env python
"""Sequence classification with no DeepSpeed code in it: DeepSpeed comes from the launcher's config alone.

    # the blog's run: microsoft/deberta-v2-xlarge on GLUE MRPC (needs the Hugging Face Hub), ZeRO-2 through accelerate
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/classification.py \\
        --model_name_or_path microsoft/deberta-v2-xlarge --dataset_name glue --dataset_config_name mrpc \\
        --output_dir runs/mrpc
    # offline: a random-init small DeBERTa-v2 learns which topic a chatterbot exchange belongs to
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/classification.py \
        --config recipes/configs/topics.yaml --output_dir runs/topics

The offline task is topic classification (7 chatterbot categories, a conversation's first two turns as the text):
the corpus labels every conversation with its category, so the labels are the corpus's own, and the words of an
exchange say much of its topic, which a model trained from scratch on 669 examples can learn. Whether two turns are
consecutive (MRPC's sentence-pair shape) was the other candidate; telling a reply from a random turn needs a
pretrained model's sense of language. Accuracy is reported beside the majority-class rate of the same split.

Reads top to bottom: parse args -> load data -> build model -> train -> evaluate -> report.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, set_seed

from chat_e.data.corpora import load_chatterbot_topics
from chat_e.data.models import build
from hf_ext import Trainer, TrainingArguments
from hf_ext.atomic import write_text_atomically
from hf_ext.config_args import parse_args_with_config
from hf_ext.runtime import end_distributed, prepare_run, run_summary

logger = logging.getLogger("recipes.classification")

OFFLINE_MODEL = "deberta-tiny"  # built here: our offline tokenizer + a random-init small DeBERTa-v2
OFFLINE_DATASET = "chatterbot-topics"


@dataclass
class ClassificationArguments:
    """Model and data; the training settings are ``TrainingArguments``."""

    model_name_or_path: str = field(
        default=OFFLINE_MODEL,
        metadata={"help": f"Hub id or local directory of a model, or '{OFFLINE_MODEL}' (built offline, random init)."},
    )
    dataset_name: str = field(
        default=OFFLINE_DATASET,
        metadata={"help": f"Hub dataset (e.g. glue, with --dataset_config_name mrpc) or '{OFFLINE_DATASET}'."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    max_length: int = field(default=128, metadata={"help": "Tokens per example (pairs: both sentences together)."})


def load_data(args: ClassificationArguments) -> tuple[datasets.DatasetDict, list[str], tuple[str, ...]]:
    """The splits, the label names and the text column(s)."""
    if args.dataset_name == OFFLINE_DATASET:
        data = load_chatterbot_topics()
    else:
        data = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
    present = set(data["train"].column_names)
    columns = next((c for c in (("sentence1", "sentence2"), ("text",)) if set(c) <= present), None)
    if columns is None:
        raise SystemExit(f"{args.dataset_name}: expected a 'text' column or 'sentence1'/'sentence2' columns.")
    return data, data["train"].features["label"].names, columns


def build_offline_model(output_dir: Path, num_labels: int, seed: int) -> Path:
    """Our offline tokenizer (trained on the offline corpora) and a small random-init DeBERTa-v2 classifier."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    path = output_dir / "base-model"
    if (path / "config.json").exists():
        return path
    build(str(path / "seq2seq"), "tiny", seed=seed)  # only its tokenizer is used
    tokenizer = AutoTokenizer.from_pretrained(path / "seq2seq")
    config = DebertaV2Config(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        num_labels=num_labels,
    )  # fmt: skip
    set_seed(seed)
    DebertaV2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def accuracy(eval_pred) -> dict:
    logits, labels = eval_pred
    predictions = np.argmax(logits, axis=-1)
    return {"accuracy": float((predictions == labels).mean())}


def majority_rate(split: datasets.Dataset) -> float:
    counts = np.bincount(np.asarray(split["label"]))
    return float(counts.max() / counts.sum())


def main() -> None:
    model_args, training_args = parse_args_with_config((ClassificationArguments, TrainingArguments), sys.argv[1:])
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    prepare_run(training_args)
    set_seed(training_args.seed)

    data, names, columns = load_data(model_args)
    model_path = model_args.model_name_or_path
    if model_path == OFFLINE_MODEL:
        with training_args.main_process_first(desc="building the offline model"):
            model_path = build_offline_model(Path(training_args.output_dir), len(names), training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )

    def tokenize(batch):
        return tokenizer(*(batch[c] for c in columns), truncation=True, max_length=model_args.max_length)

    with training_args.main_process_first(desc="tokenizing"):
        keep = {"label"}
        data = data.map(
            tokenize, batched=True, remove_columns=[c for c in data["train"].column_names if c not in keep]
        )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    train_result = trainer.train()
    metrics = dict(train_result.metrics)
    test_split = (
        "test" if "test" in data and -1 not in data["test"]["label"] else "validation"
    )  # GLUE's test: no labels
    metrics.update(trainer.evaluate(data[test_split], metric_key_prefix=test_split))
    metrics[f"{test_split}_majority_rate"] = majority_rate(data[test_split])
    metrics["labels"] = names
    metrics["run"] = run_summary(trainer)
    trainer.save_model()
    if trainer.is_world_process_zero():
        write_text_atomically(Path(training_args.output_dir, "all_results.json"), json.dumps(metrics, indent=2) + "\n")
        logger.info(
            f"{test_split} accuracy {metrics[f'{test_split}_accuracy']:.3f} "
            f"(majority class {metrics[f'{test_split}_majority_rate']:.3f}) on {len(data[test_split])} examples"
        )


if __name__ == "__main__":
    main()
    end_distributed()
