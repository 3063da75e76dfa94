"""BLEU eval under a real 2-rank DeepSpeed launch; leaves metrics and per-rank generation stats to check.

    deepspeed --num_gpus 2 tests/distributed/workers/bleu_eval_worker.py --model DIR --out DIR --stage 3 --n_eval 18
        [--train_steps 8 --eval_steps 4] [--gather auto|true|false] [--final_beams 4]

Eval-only first (no engine exists yet: ZeRO-1/2 must not raise), then, with ``--train_steps``, a short training with
``metric_for_best_model="bleu"`` (lowest best) and ``load_best_model_at_end``, then a final evaluation of the loaded best model
(with ``--final_beams`` beams when given); the weights after training go to ``OUT/after_train.pt``. ``--gather`` is ``generation_gather_weights`` (ZeRO-3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, DataCollatorForSeq2Seq

import hf_ext
from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from chat_e.data.dialogue import family_of
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.model_info import model_class
from tests.saving_support import gathered_state_dict

GEN = dict(generation_num_beams=1, generation_max_length=24, generation_min_length=1, generation_batch_size=4)


def eval_split(tokenizer, n: int, split: str = "train", family: str = "seq2seq"):
    """The first ``n`` rows of a split of the offline corpus, tokenized (the tests build the same set)."""
    data_args = DataArguments(max_target_length=32)
    rows = load_dialogue_dataset(data_args)[split].select(range(n))
    return tokenize_dataset(rows, tokenizer, data_args, family=family)


def ds_config(stage: int) -> dict:
    config = load_deepspeed_config(f"zero{stage}")
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter is gathered
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--n_eval", type=int, default=18)
    parser.add_argument("--train_steps", type=int, default=0)
    parser.add_argument("--eval_steps", type=int, default=4)
    parser.add_argument("--n_train", type=int, default=64)
    parser.add_argument("--gather", default="auto", choices=["auto", "true", "false"])
    parser.add_argument("--final_beams", type=int, default=None)
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    cli = parser.parse_args()
    out = Path(cli.out)

    args = hf_ext.Seq2SeqTrainingArguments(
        output_dir=str(out),
        deepspeed=ds_config(cli.stage),
        per_device_eval_batch_size=4,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        max_steps=max(cli.train_steps, 1),
        eval_strategy="steps",
        eval_steps=cli.eval_steps,
        save_strategy="steps",
        save_steps=cli.eval_steps,
        metric_for_best_model="bleu",
        # BLEU rises as this model trains: the lowest is best here, so the best checkpoint is not the last one and
        # loading it at the end is seen to change the weights
        greater_is_better=False,
        load_best_model_at_end=True,
        logging_steps=cli.eval_steps,
        report_to="none",
        log_samples=3,
        seed=0,
        generation_gather_weights=cli.gather,
        **GEN,
    )
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    config = AutoConfig.from_pretrained(cli.model)
    family = family_of(config)
    model = model_class(config).from_pretrained(cli.model)  # after the args: ZeRO-3 partitions it
    eval_dataset = eval_split(tokenizer, cli.n_eval, family=family)
    train_dataset = eval_split(tokenizer, cli.n_train, family=family) if cli.train_steps else None
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorForSeq2Seq(
            tokenizer, model=model if family == "seq2seq" else None, label_pad_token_id=-100
        ),
        processing_class=tokenizer,
    )
    callback = trainer.bleu_eval_callback
    result = {"rank": args.process_index, "world_size": args.world_size, "stage": cli.stage}
    result["eval_only"] = trainer.evaluate()
    result["eval_only_stats"] = callback.last_evaluation.stats
    result["eval_only_generations"] = [r["generation"] for r in callback.last_evaluation.rows]
    result["engine_after_eval_only"] = trainer.deepspeed is not None
    if cli.train_steps:
        trainer.train()
        result["log_history"] = [dict(entry) for entry in trainer.state.log_history]
        result["best_metric"] = trainer.state.best_metric
        result["best_model_checkpoint"] = trainer.state.best_model_checkpoint
        weights = gathered_state_dict(trainer.model)  # the model load_best_model_at_end left in the trainer
        if args.process_index == 0:
            torch.save(weights, out / "after_train.pt")
        result["final"] = trainer.evaluate(**({"num_beams": cli.final_beams} if cli.final_beams else {}))
        result["final_generations"] = [r["generation"] for r in callback.last_evaluation.rows]
        result["final_stats"] = callback.last_evaluation.stats
    (out / f"result-rank{args.process_index}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
