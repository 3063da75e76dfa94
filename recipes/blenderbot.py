#!/usr/bin/env python
"""Fine-tune BlenderBot on multi-domain dialogues with DeepSpeed ZeRO.

    # the blog's run: facebook/blenderbot-400M-distill on smangrul/MuDoConv, ZeRO-2
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/blenderbot_400m.yaml
    # offline: a random-init tiny BlenderBot on the chatterbot corpus (see the YAML headers for every launcher)
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/tiny.yaml --output_dir runs/tiny

Reads top to bottom: parse args -> load data -> build model -> build trainer -> train -> evaluate -> save -> report.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq, set_seed
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from chat_e.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from chat_e.dialogue import encode_texts
from chat_e.models import SIZES, build
from chat_e.plotting import plot_training_curves
from hf_ext import Seq2SeqTrainer, Seq2SeqTrainingArguments
from hf_ext.config_args import parse_args_with_config
from hf_ext.runtime import end_distributed, prepare_run, run_summary

logger = logging.getLogger("recipes.blenderbot")


@dataclass
class ModelArguments:
    """Which model to fine-tune."""

    model_name_or_path: str = field(
        default="facebook/blenderbot-400M-distill",
        metadata={"help": "Hub id or local directory of a BlenderBot checkpoint."},
    )
    build_tiny_model: str | None = field(
        default=None,
        metadata={
            "help": f"If model_name_or_path does not exist yet, build a random-init BlenderBot of this size there "
            f"({', '.join(SIZES)}) with recipes/make_tiny_blenderbot.py's builder."
        },
    )
    samples_to_print: int = field(default=5, metadata={"help": "Validation replies printed at the end."})


def setup_logging(args: Seq2SeqTrainingArguments) -> None:
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler()],
    )
    level = args.get_process_log_level()
    for lib_logger in (logger, logging.getLogger("hf_ext")):
        lib_logger.setLevel(logging.INFO if args.should_log else logging.WARNING)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def generation_kwargs(args: Seq2SeqTrainingArguments) -> dict:
    """Generation settings from the arguments; unset ones fall back to the model's generation_config."""
    settings = {
        "num_beams": args.generation_num_beams,
        "max_length": args.generation_max_length,
        "min_length": args.generation_min_length,
        "no_repeat_ngram_size": args.generation_no_repeat_ngram_size,
    }
    return {k: v for k, v in settings.items() if v is not None}


def print_samples(model_dir: str, eval_raw: datasets.Dataset, data_args: DataArguments, args, n: int) -> list[dict]:
    """Reload the saved model (proving the output loads) and print replies to the first ``n`` validation contexts."""
    # rank 0 alone: a plain load, not a ZeRO-3 partitioned one that would wait for the other ranks
    unset_hf_deepspeed_config()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir).to(args.device).eval()
    rows = []
    for example in eval_raw.select(range(min(n, len(eval_raw)))):
        ids = encode_texts(tokenizer, example["texts"], data_args.max_source_length)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=args.device), **generation_kwargs(args))
        reply = tokenizer.decode(out[0], skip_special_tokens=True).strip()
        rows.append({"context": example["texts"], "reply": reply, "reference": example["labels"]})
    print("\n=== sample replies (validation) ===")
    for i, row in enumerate(rows, 1):
        print(
            f"[{i}] context:   {row['context'][-160:]}\n    reply:     {row['reply']}\n    reference: {row['reference']}"
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    # 1. arguments: dataclass defaults < --config YAML < CLI flags
    model_args, data_args, training_args = parse_args_with_config(
        (ModelArguments, DataArguments, Seq2SeqTrainingArguments), argv
    )
    setup_logging(training_args)
    logger.info(
        f"rank {training_args.process_index}/{training_args.world_size}, device {training_args.device}, "
        f"deepspeed {'on' if training_args.deepspeed_plugin else 'off'}"
    )
    prepare_run(training_args)  # threads and malloc set before the model loads (train() would do it after)
    set_seed(training_args.seed)

    # 2. model files (a random-init model is built once, by the main process, when asked)
    model_path = model_args.model_name_or_path
    if model_args.build_tiny_model:  # every rank enters: the others wait until the main process has built it
        with training_args.main_process_first(desc="building the tiny model"):
            if training_args.local_process_index == 0 and not Path(model_path).exists():
                build(model_path, model_args.build_tiny_model, seed=training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    # 3. data: texts/labels -> left-truncated input_ids + labels
    raw = load_dialogue_dataset(data_args)
    logger.info(f"Dialogue pairs: { ({split: len(ds) for split, ds in raw.items()}) }")
    with training_args.main_process_first(desc="tokenizing"):
        train_dataset = tokenize_dataset(raw["train"], tokenizer, data_args, "Tokenizing train")
        eval_dataset = tokenize_dataset(raw["validation"], tokenizer, data_args, "Tokenizing validation")

    # 4. model: created after the arguments, so ZeRO-3 partitions it while loading
    model = BlenderbotForConditionalGeneration.from_pretrained(model_path)
    # labels are shifted by the model: decoder inputs start at <s> (decoder_start_token_id=1), not at pad
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    # 5. trainer
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=tokenizer,
    )

    # 6. train, 7. evaluate, 8. save
    metrics = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics.update(result.metrics)
        metrics["train_samples"] = len(train_dataset)
        metrics["run"] = run_summary(trainer)
        logger.info(f"Ran on {metrics['run']}")
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", {**result.metrics, "run": metrics["run"]})
        trainer.save_state()
    if training_args.do_eval:
        eval_metrics = trainer.evaluate(**generation_kwargs(training_args))
        eval_metrics["eval_samples"] = len(eval_dataset)
        metrics.update(eval_metrics)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)

    # 9. report: curves, the metrics, and a few replies from the reloaded output
    if trainer.is_world_process_zero():
        out = Path(training_args.output_dir)
        plot_training_curves(trainer.state.log_history, out / "training_curves.png", title=model_path)
        if training_args.do_train and model_args.samples_to_print:
            samples = print_samples(str(out), raw["validation"], data_args, training_args, model_args.samples_to_print)
            (out / "sample_replies.json").write_text(json.dumps(samples, indent=1) + "\n")
        print("\n=== metrics ===\n" + json.dumps(metrics, indent=1, default=str))
        if "eval_bleu" in metrics:
            print(
                f"\nBLEU {metrics['eval_bleu']:.2f}  chrF {metrics['eval_chrf']:.2f}  eval loss {metrics['eval_loss']:.3f}"
            )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
    end_distributed()
