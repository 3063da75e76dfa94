"""Fine-tune a dialogue model (BlenderBot or a decoder-only chat model) on multi-domain dialogues with DeepSpeed ZeRO.

    # the blog's run: facebook/blenderbot-400M-distill on smangrul/MuDoConv, ZeRO-2
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/blenderbot_400m.yaml
    # offline: a random-init tiny BlenderBot on the chatterbot corpus (see the YAML headers for every launcher)
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/tiny.yaml --output_dir runs/tiny
    # Ray Train as the launcher (a local cluster, or the one RAY_ADDRESS names): 2 workers, or 1:2 elastic
    python recipes/blenderbot.py --config recipes/configs/tiny.yaml --deepspeed zero2 --launcher ray --num_workers 2
    # offline, a real chat model: SmolLM2-135M-Instruct (built from its GGUF file), LoRA, on chitchat + chatterbot
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/demo.yaml --output_dir runs/demo
    # the same, installed (no clone needed): chat-e train --method sft --launcher deepspeed --nproc 2 -- FLAGS
    chat-e train --method sft --nproc 2 -- --config recipes/configs/tiny.yaml --output_dir runs/tiny

One recipe for both model families; the family comes from the model's config. An encoder-decoder (BlenderBot) reads
the MuDoConv string and learns the reply as its target; a decoder-only chat model reads the same dialogue through its
tokenizer's chat template (the header as the system message) and learns the reply with the loss on the reply tokens
only (chat_e.data.dialogue has both renderings, which Chat-E uses again at serving time).

Reads top to bottom: parse args -> load data -> build model -> build trainer -> train -> evaluate -> save -> report.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import transformers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    set_seed,
)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

# absolute imports: Ray Train's workers load this file by its path (hf_ext.ray.run_script), outside its package
from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from chat_e.data.dialogue import family_of, parse_header, parse_texts
from chat_e.data.limits import Request
from chat_e.data.models import BUILDERS, build_model
from chat_e.data.samples import SAMPLE_CHATS
from chat_e.training.lora import LoraArguments
from chat_e.training.plotting import plot_training_curves
from chat_e.training.progress import join_run_niceness, progress_callbacks
from hf_ext import Seq2SeqTrainer, Seq2SeqTrainingArguments
from hf_ext.atomic import write_text_atomically
from hf_ext.config_args import parse_args_with_config, split_launcher_args
from hf_ext.model_info import model_class
from hf_ext.runtime import end_distributed, prepare_run, run_summary
from hf_ext.saving.export import export

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments(LoraArguments):
    """Which model to fine-tune, and how (full weights or LoRA)."""

    model_name_or_path: str = field(
        default="facebook/blenderbot-400M-distill",
        metadata={
            "help": "Hub id or local directory of a BlenderBot or a decoder-only chat model (with a chat template)."
        },
    )
    build_model: str | None = field(
        default=None,
        metadata={
            "aliases": ["--build_tiny_model"],
            "help": f"If model_name_or_path does not exist yet, build it there first ({', '.join(BUILDERS)}): a "
            "random-init model of that size, or smollm2 (SmolLM2-135M-Instruct from the GGUF file installed by "
            "`make setup`).",
        },
    )
    samples_to_print: int = field(
        default=5,
        metadata={"help": "Validation contexts replied to at the end (after one opening message per Chat-E mode)."},
    )


@dataclass
class DialogueTrainingArguments(Seq2SeqTrainingArguments):
    """hf-ext's Seq2SeqTrainingArguments with the recipe's defaults: padding-free batches for a decoder-only model,
    micro-batches rebalanced by length, and the real tokens counted (reported as train_tokens_per_second)."""

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Concatenate each micro-batch's rows without padding, each keeping its own positions and "
            "attention (default: on for a decoder-only model; an encoder-decoder cannot)."
        },
    )
    train_sampling_strategy: str = field(
        default="batch_rebalance",
        metadata={
            "help": "Training sampler: batch_rebalance (default) gives every rank and accumulation step the same cost "
            "(packed: tokens; padded: rows x longest row); random, sequential or group_by_length as in transformers.",
            "choices": ["random", "sequential", "group_by_length", "batch_rebalance"],
        },
    )
    include_num_input_tokens_seen: str = field(
        default="non_padding",
        metadata={
            "help": "Count the tokens trained on: non_padding (default), all or no.",
            "choices": ["non_padding", "all", "no"],
        },
    )


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


def sample_chats(eval_raw: datasets.Dataset, n: int) -> list[dict]:
    """What the replies are printed for: Chat-E's opening message of each mode, then ``n`` validation contexts."""
    chats = [
        {"mode": mode, "context": context, "turns": [message], "reference": None}
        for mode, context, message in SAMPLE_CHATS
    ]
    for example in eval_raw.select(range(min(n, len(eval_raw)))):
        header, turns = parse_texts(example["texts"])
        mode, context = parse_header(header)
        chats.append({"mode": mode, "context": context, "turns": turns, "reference": example["labels"]})
    return chats


def print_samples(model_dirs: dict[str, str], chats: list[dict], args) -> list[dict]:
    """Replies of each model in ``model_dirs`` (name -> directory, loaded as Chat-E serves it, proving the output
    loads) to the ``chats``, printed side by side."""
    from chat_e.engines.local import LocalEngine  # noqa: PLC0415 (the samples at the end only)

    # rank 0 alone: a plain load, not a ZeRO-3 partitioned one that would wait for the other ranks
    unset_hf_deepspeed_config()
    rows = [dict(chat) for chat in chats]
    for name, model_dir in model_dirs.items():
        engine = LocalEngine.from_pretrained(model_dir, device=str(args.device))
        settings = engine.default_settings().replace(num_beams=args.generation_num_beams)
        for row in rows:
            chat = Request(row["turns"][-1], row["turns"][:-1], row["mode"], row["context"], settings)
            row[name] = engine.reply(chat).text
        del engine
    print("\n=== sample replies ===")
    for i, row in enumerate(rows, 1):
        header = f"{row['mode']}: {row['context']}" if row["context"] else row["mode"]
        print(f"[{i}] {header[:100]}\n    {'user:':<10} {row['turns'][-1][-160:]}")
        for name in model_dirs:
            print(f"    {name + ':':<10} {row[name]}")
        if row["reference"]:
            print(f"    {'human:':<10} {row['reference']}")
    return rows


def bleu_before_after(log_history: list[dict]) -> tuple[dict, dict] | None:
    """The first and the last evaluation with BLEU (with eval_on_start: the base model, then the fine-tuned one)."""
    evals = [entry for entry in log_history if "eval_bleu" in entry]
    return (evals[0], evals[-1]) if len(evals) >= 2 else None


def main(argv: list[str] | None = None) -> dict:  # long: the run's numbered steps in order, read top to bottom
    join_run_niceness()  # a run the app started: this rank's session niced as the run is
    # 1. arguments: dataclass defaults < --config YAML < CLI flags
    model_args, data_args, training_args = parse_args_with_config(
        (ModelArguments, DataArguments, DialogueTrainingArguments), argv
    )
    setup_logging(training_args)
    logger.info(
        f"rank {training_args.process_index}/{training_args.world_size}, device {training_args.device}, "
        f"deepspeed {'on' if training_args.deepspeed_plugin else 'off'}"
    )
    prepare_run(training_args)  # threads and malloc set before the model loads (train() would do it after)
    set_seed(training_args.seed)

    # 2. model files (a model is built once, by the main process, when asked and missing)
    model_path = model_args.model_name_or_path
    if model_args.build_model:  # every rank enters: the others wait until the main process has built it
        with training_args.main_process_first(desc="building the model"):
            if training_args.local_process_index == 0 and not Path(model_path).exists():
                build_model(model_path, model_args.build_model, seed=training_args.seed)
    config = AutoConfig.from_pretrained(model_path)
    family = family_of(config)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    logger.info(f"Model family: {family} ({'MuDoConv string' if family == 'seq2seq' else 'chat template'} inputs)")
    if training_args.padding_free is None:  # the default: packed rows wherever the model can take them
        training_args.padding_free = family != "seq2seq"
    logger.info(
        f"Batches: {'padding-free' if training_args.padding_free else 'padded'}, "
        f"sampler {training_args.train_sampling_strategy}"
    )

    # 3. data: texts/labels -> left-truncated inputs + labels, in the family's rendering
    raw = load_dialogue_dataset(data_args)
    logger.info(f"Dialogue pairs: { ({split: len(ds) for split, ds in raw.items()}) }")
    with training_args.main_process_first(desc="tokenizing"):
        train_dataset = tokenize_dataset(raw["train"], tokenizer, data_args, "Tokenizing train", family)
        eval_dataset = tokenize_dataset(raw["validation"], tokenizer, data_args, "Tokenizing validation", family)

    # 4. model: created after the arguments, so ZeRO-3 partitions it while loading
    model = model_class(config).from_pretrained(model_path)
    if model_args.use_peft:
        from peft import get_peft_model  # noqa: PLC0415 (LoRA only; peft's import is slow)

        model = get_peft_model(model, model_args.lora_config("SEQ_2_SEQ_LM" if family == "seq2seq" else "CAUSAL_LM"))
        trainable, total = model.get_nb_trainable_parameters()
        logger.info(f"LoRA: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)")
    # pads inputs and labels (-100); an encoder-decoder also gets decoder inputs starting at decoder_start_token_id.
    # With padding_free the trainer flattens the rows instead (hf_ext.packing).
    collator = DataCollatorForSeq2Seq(tokenizer, model=model if family == "seq2seq" else None, label_pad_token_id=-100)

    # 5. trainer
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=progress_callbacks(),
    )

    # 6. train, 7. evaluate, 8. save
    out = Path(training_args.output_dir)
    metrics = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        merge = model_args.use_peft and model_args.merge_adapter
        trainer.save_model(str(out / "adapter") if merge else None)
        if merge and trainer.is_world_process_zero():
            export(out / "adapter", out, merge=True)  # the merged model is what Chat-E serves
            logger.info(f"Saved the adapter in {out / 'adapter'} and the merged model in {out}")
        if trainer.state.num_input_tokens_seen:  # real tokens (no padding) per second, beside samples per second
            tokens = trainer.state.num_input_tokens_seen
            result.metrics["train_tokens_per_second"] = round(tokens / result.metrics["train_runtime"], 3)
        metrics.update(result.metrics)
        metrics["train_samples"] = len(train_dataset)
        metrics["run"] = run_summary(trainer)
        logger.info(f"Ran on {metrics['run']}")
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", {**result.metrics, "run": metrics["run"]})
        trainer.save_state()
    if training_args.do_eval:
        final = [e for e in trainer.state.log_history if "eval_loss" in e and e["step"] == trainer.state.global_step]
        if (
            training_args.do_train and final
        ):  # the run ended with an evaluation: do not evaluate the same weights again
            eval_metrics = {k: v for k, v in final[-1].items() if k.startswith("eval_")}
        else:
            eval_metrics = trainer.evaluate()
        eval_metrics["eval_samples"] = len(eval_dataset)
        metrics.update(eval_metrics)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)

    # 9. report: curves, the metrics, BLEU before -> after, and replies of the reloaded output (beside the base's)
    if trainer.is_world_process_zero():
        plot_training_curves(trainer.state.log_history, out / "training_curves.png", title=model_path)
        if training_args.do_train and model_args.samples_to_print:
            chats = sample_chats(raw["validation"], model_args.samples_to_print)
            dirs = {"base": model_path, "tuned": str(out)} if Path(model_path).is_dir() else {"reply": str(out)}
            samples = print_samples(dirs, chats, training_args)
            write_text_atomically(out / "sample_replies.json", json.dumps(samples, indent=1) + "\n")
        print("\n=== metrics ===\n" + json.dumps(metrics, indent=1, default=str))
        before_after = bleu_before_after(trainer.state.log_history)
        if before_after:
            (before, after), fmt = before_after, "BLEU {:.2f}  chrF {:.2f}  (step {})"
            metrics["bleu_before_after"] = {"before": before, "after": after}
            print(f"\nbefore fine-tuning: {fmt.format(before['eval_bleu'], before['eval_chrf'], before['step'])}")
            print(f"after fine-tuning:  {fmt.format(after['eval_bleu'], after['eval_chrf'], after['step'])}")
        elif "eval_bleu" in metrics:
            print(
                f"\nBLEU {metrics['eval_bleu']:.2f}  chrF {metrics['eval_chrf']:.2f}  eval loss {metrics['eval_loss']:.3f}"
            )
        if training_args.do_train:
            print(f"\nChat with it: chat-e --model {out}")
    return metrics


def run(argv: list[str]) -> None:
    """The recipe's command line: :func:`main` in this process (one rank of whatever launched it), or with
    ``--launcher ray`` as Ray's driver, each Ray Train worker running :func:`main` as a rank."""
    launch, argv = split_launcher_args(argv)
    if launch is not None:
        from hf_ext.ray import run_script  # noqa: PLC0415 (optional extra: ray)

        run_script(__file__, argv, launch)
    else:
        main(argv)
        end_distributed()


if __name__ == "__main__":
    run(sys.argv[1:])
