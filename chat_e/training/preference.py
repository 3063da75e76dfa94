"""Preference fine-tuning of a chat model: DPO (default) or KTO (``--loss kto``) with TRL's trainers on hf-ext.

    # offline, SPIN pairs from real human chit-chat on the tiny random-init chat model
    deepspeed --num_gpus 2 recipes/preference.py --config recipes/configs/preference_tiny.yaml --output_dir runs/pref
    # after `make demo`: the fine-tuned SmolLM2 in runs/demo, LoRA, ZeRO-2 (what `make demo-preference` runs)
    deepspeed --num_gpus 2 recipes/preference.py --config recipes/configs/preference_demo.yaml
    # your own pairs (prompt/chosen/rejected; for KTO prompt/completion/label), plain text or TRL's conversational rows
    deepspeed --num_gpus 2 recipes/preference.py --config recipes/configs/preference_tiny.yaml --data_file rows.jsonl
    # the same, installed (no clone needed): chat-e train --method dpo|kto --nproc 2 -- FLAGS
    chat-e train --method dpo --nproc 2 -- --config recipes/configs/preference_tiny.yaml --data_file rows.jsonl

Data, in this order of choice:

* ``--data_file`` (.jsonl/.json) or ``--dataset_name`` a hub dataset id: rows in TRL's preference format (DPO:
  ``prompt``/``chosen``/``rejected``; KTO: ``prompt``/``completion``/``label``, and DPO pairs are unpaired for KTO),
  either plain text or conversational (lists of ``{"role", "content"}``, rendered by TRL with the chat template). Bad
  rows are counted per reason, skipped, and reported in one log line.
* an offline corpus name (``chitchat``, ``chatterbot``, ``chitchat+chatterbot``; the default): Self-Play Fine-Tuning
  (SPIN, Chen et al. 2024) pairs. For each context of the corpus (chat_e.data.corpora, as recipes/blenderbot.py loads it),
  chosen is the real human reply and rejected is the model's own reply to the same context, generated once (sharded
  over the ranks) and cached as JSONL keyed by the model, the data and the generation settings. For KTO each pair
  becomes two rows: the human reply labelled True, the model's False. Prompts and replies are rendered by
  chat_e.data.dialogue, so the text trained on is the text Chat-E serves.

Held-out rows (the corpus's validation split by conversation; for a data file, whole conversations: every row of a
``session_id``, else of a conversation's opening, on one side) are scored by the model itself before and after
training (:mod:`chat_e.training.heldout`): the share of pairs whose chosen (desirable) reply it finds likelier than
the rejected (undesirable) one, summed and per token, each with its row count and 95 % interval, and the NLL per token
of the held-out preferred replies. TRL's implicit reward, 0 for every pair before training by construction, stays in
the training log. The table is printed and written to OUTPUT_DIR/preference_metrics.json.

Reads top to bottom: parse args -> model files -> data (SPIN pairs generated or read from the cache) -> trainer ->
evaluate -> train -> evaluate -> save -> report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

from hf_ext.atomic import write_text_atomically
from hf_ext.config_args import parse_args_with_config
from hf_ext.gather import gathered
from hf_ext.runtime import end_distributed, prepare_run, run_summary

from ..data.corpora import OFFLINE_DATASETS, load_offline, sample
from ..data.dialogue import (
    chat_messages,
    chat_reply_ids,
    chat_turns_that_fit,
    clean_turn,
    encode_chat_prompt,
    family_of,
    parse_texts,
)
from ..data.models import BUILDERS, build_model
from ..data.stats import share
from .heldout import heldout_metrics
from .launch import PREFERENCE_REPORT, PREFERRED_PER_TOKEN, PREFERRED_SUM, REPLY_NLL, replay_problem, stop
from .lora import LoraArguments
from .progress import (
    EVAL_AFTER,
    EVAL_BEFORE,
    PREPARING,
    SAVING,
    join_run_niceness,
    phase,
    phase_rows,
    progress_callbacks,
)

logger = logging.getLogger(__name__)

LOSSES = ("dpo", "kto")
#: the fields of a row of each loss's data (TRL's preference and unpaired-preference formats)
FIELDS = {"dpo": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion", "label")}
#: bumped when the SPIN cache rows change meaning, so that older caches are not reused
SPIN_CACHE_VERSION = 1


@dataclass
class ModelArguments(LoraArguments):
    """Which chat model to tune, and how (full weights or LoRA)."""

    model_name_or_path: str = field(
        default="runs/demo",
        metadata={"help": "Local directory (or hub id) of a decoder-only chat model with a chat template."},
    )
    build_model: str | None = field(
        default=None,
        metadata={"help": f"If model_name_or_path does not exist yet, build it there first ({', '.join(BUILDERS)})."},
    )


@dataclass
class PreferenceDataArguments:
    """Which loss, where the preference rows come from, and how the SPIN pairs are made."""

    loss: str = field(default="dpo", metadata={"help": "dpo (pairs) or kto (replies labelled good/bad)."})
    data_file: str | None = field(
        default=None,
        metadata={
            "help": "Local .jsonl/.json of TRL preference rows (DPO: prompt/chosen/rejected; KTO: "
            "prompt/completion/label), plain text or conversational."
        },
    )
    dataset_name: str | None = field(
        default="chitchat",
        metadata={
            "help": "A hub dataset id of preference rows, or an offline corpus for SPIN pairs: "
            f"{', '.join(OFFLINE_DATASETS)}."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split of the hub dataset to read."})
    n_train: int | None = field(default=None, metadata={"help": "Training pairs (a seeded sample)."})
    n_eval: int = field(
        default=64,
        metadata={"help": "Held-out rows scored before and after training (whole conversations, so about this many)."},
    )
    data_seed_split: int = field(
        default=42, metadata={"help": "Seed of the corpus split, the sampling and the hold-out."}
    )
    max_source_length: int = field(default=128, metadata={"help": "SPIN: prompt tokens kept (newest turns stay)."})
    max_target_length: int = field(default=32, metadata={"help": "SPIN: reply tokens kept (human and generated)."})
    spin_cache_dir: str = field(
        default="runs/spin_cache", metadata={"help": "Where the generated (rejected) SPIN replies are cached."}
    )
    generation_batch_size: int = field(default=16, metadata={"help": "SPIN: prompts per generate call per rank."})
    generation_do_sample: bool = field(
        default=False, metadata={"help": "SPIN: sample the model's replies (default: its greedy decoding)."}
    )
    generation_temperature: float = field(default=1.0, metadata={"help": "SPIN: sampling temperature."})
    replay: int = field(
        default=0,
        metadata={
            "help": "Rehearsal against forgetting: this many rows of replay_dataset's train split (context and "
            "human reply) added to the training rows, never to the held-out ones. DPO: pairs whose rejected "
            "reply is the chosen one, which only an sft part of loss_type learns from; KTO: desirable replies, "
            "whose likelihood only --sft_weight holds."
        },
    )
    replay_dataset: str = field(
        default="chitchat+chatterbot",
        metadata={"help": f"The offline corpus replayed ({', '.join(OFFLINE_DATASETS)}; make demo's by default)."},
    )


def setup_logging(args) -> None:
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler()],
    )
    level = args.get_process_log_level()
    for lib_logger in (logger, logging.getLogger("hf_ext"), logging.getLogger("chat_e")):
        lib_logger.setLevel(logging.INFO if args.should_log else logging.WARNING)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def loss_of(argv: list[str] | None) -> str:
    """``--loss`` from the command line, else the YAML's ``loss``, else dpo: it picks the config class to parse."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--loss", default=None)
    known, _ = pre.parse_known_args(argv)
    loss = known.loss
    if loss is None and known.config and Path(known.config).is_file():
        loss = (yaml.safe_load(Path(known.config).read_text(encoding="utf-8")) or {}).get("loss")
    loss = (loss or "dpo").lower()
    if loss not in LOSSES:
        raise SystemExit(f"--loss {loss!r}: choose one of {', '.join(LOSSES)}.")
    return loss


# ---------------------------------------------------------------------------------------------- rows from files
def _is_text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_conversation(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and _is_text(m.get("role")) and _is_text(m.get("content")) for m in value)
    )


def row_problem(row, loss: str) -> str | None:
    """Why ``row`` cannot be a training row of ``loss`` (None when it can): the reasons counted in the log line."""
    if not isinstance(row, dict):
        return "not a record"
    for name in FIELDS[loss]:
        value = row.get(name)
        if value is None:
            return f"missing '{name}'"
        if name == "label":
            if not isinstance(value, bool):
                return "label not a boolean"
        elif isinstance(value, list):
            if not _is_conversation(value):
                return f"malformed conversation in '{name}'"
        elif not isinstance(value, str):
            return f"'{name}' neither text nor a conversation"
        elif not value.strip():
            return f"empty '{name}'"
    texts = [row[name] for name in FIELDS[loss] if name != "label"]
    if len({isinstance(t, list) for t in texts}) > 1:
        return "text and conversation mixed"
    return None


def clean_preference_rows(rows, loss: str, source: str, unparsable: int = 0) -> list[dict]:
    """The rows of ``rows`` usable for ``loss`` (only its fields kept); the rest counted per reason and reported in
    one log line."""
    kept, problems = [], Counter()
    if unparsable:
        problems["unparsable line"] += unparsable
    for row in rows:
        problem = row_problem(row, loss)
        if problem:
            problems[problem] += 1
        else:
            kept.append({name: row[name] for name in (*FIELDS[loss], "session_id") if name in row})
    if problems:
        skipped = sum(problems.values())
        detail = ", ".join(f"{n} {what}" for what, n in problems.most_common())
        logger.warning(f"Skipped {skipped} of {skipped + len(kept)} rows of {source} ({detail}).")
    return kept


def read_jsonl(path: str) -> tuple[list, int]:
    """Rows of a .jsonl file (or a .json list) and the number of unparsable lines."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix.lower() == ".json":
        try:
            doc = json.loads(text)
            return (doc if isinstance(doc, list) else [doc]), 0
        except json.JSONDecodeError:
            pass  # JSON Lines saved as .json
    rows, bad = [], 0
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    return rows, bad


def to_unpaired(rows: list[dict]) -> list[dict]:
    """DPO pairs as KTO rows: the chosen reply labelled True, the rejected one False (TRL's unpairing)."""
    out = []
    for row in rows:
        out.append({"prompt": row["prompt"], "completion": row["chosen"], "label": True})
        out.append({"prompt": row["prompt"], "completion": row["rejected"], "label": False})
    return out


def without_groups(rows: list[dict]) -> list[dict]:
    """``rows`` without the conversation key the hold-out used (TRL's rows carry only their format's fields)."""
    return [{k: v for k, v in row.items() if k != "session_id"} for row in rows]


def conversation_of(row: dict) -> str:
    """The conversation a row belongs to, which the hold-out keeps whole: its ``session_id`` (``chat-e feedback
    export`` writes it), else its prompt's system message and first user turn (a plain-text prompt: the prompt)."""
    if row.get("session_id"):
        return f"session {row['session_id']}"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    system = [m["content"] for m in prompt if m["role"] == "system"][:1]
    first = [m["content"] for m in prompt if m["role"] == "user"][:1]
    return json.dumps([system, first])


def split_by_conversation(rows: list, groups: list[str], n_eval: int, seed: int) -> tuple[list, list]:
    """``(train, held_out)``: whole conversations, drawn in a seeded order, held out until they hold at least
    ``n_eval`` rows (at most half of the rows; at least one conversation stays for training)."""
    order = list(dict.fromkeys(groups))
    random.Random(seed).shuffle(order)
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    target, held = min(n_eval, len(rows) // 2), []
    for group in order[:-1]:
        if len(held) >= target:
            break
        held += members[group]
    held_set = set(held)
    return [r for i, r in enumerate(rows) if i not in held_set], [rows[i] for i in sorted(held)]


def load_rows(data_args: PreferenceDataArguments) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of a data file or a hub dataset (a seeded hold-out of ``n_eval`` rows)."""
    if data_args.data_file:
        rows, unparsable = read_jsonl(data_args.data_file)
        source = data_args.data_file
    else:
        hub = datasets.load_dataset(
            data_args.dataset_name, data_args.dataset_config_name, split=data_args.dataset_split
        )
        rows, unparsable, source = list(hub), 0, data_args.dataset_name
    # pairs are kept as pairs until the hold-out is drawn, so that a pair's two KTO rows stay on one side
    paired = data_args.loss == "dpo" or all(isinstance(r, dict) and "chosen" in r for r in rows[:1])
    rows = clean_preference_rows(rows, "dpo" if paired else "kto", source, unparsable)
    if not rows:
        raise ValueError(f"{source}: no usable rows (see the log line above).")
    groups = [conversation_of(r) for r in rows]
    train, held_out = split_by_conversation(rows, groups, data_args.n_eval, data_args.data_seed_split)
    if not held_out:
        logger.warning(f"{source}: every row is from one conversation, so none can be held out: no before/after.")
    train = sample(datasets.Dataset.from_list(train), data_args.n_train, data_args.data_seed_split).to_list()
    if paired and data_args.loss == "kto":
        train, held_out = to_unpaired(train), to_unpaired(held_out)
    return train, held_out


def replay_rows(data_args, tokenizer, conversational: bool) -> list[dict]:
    """``data_args.replay`` rows of the offline corpus's train split (a seeded sample) in the loss's format, the
    human reply as the chosen (desirable) one: conversational (:func:`chat_turns_that_fit` ``max_source_length``
    tokens) or plain text (:func:`spin_row`), as the rows they join are. A DPO row's rejected
    reply is its chosen one: the preference terms of its loss are constant, so only an SFT term learns from it."""
    raw = load_offline(data_args.replay_dataset, seed=data_args.data_seed_split)["train"]
    out = []
    for row in sample(raw, data_args.replay, data_args.data_seed_split).to_list():
        header, turns = parse_texts(row["texts"])
        if conversational:
            kept = chat_turns_that_fit(tokenizer, turns, header, data_args.max_source_length)
            prompt, reply = chat_messages(kept, header), [{"role": "assistant", "content": clean_turn(row["labels"])}]
        else:
            text = spin_row(
                tokenizer, row["texts"], row["labels"], data_args.max_source_length, data_args.max_target_length
            )
            prompt, reply = text["prompt"], text["reply"]
        if data_args.loss == "kto":
            out.append({"prompt": prompt, "completion": reply, "label": True})
        else:
            out.append({"prompt": prompt, "chosen": reply, "rejected": reply})
    return out


# ---------------------------------------------------------------------------------------------- SPIN pairs
def spin_row(tokenizer, texts: str, reply: str, max_source_length: int | None, max_target_length: int | None) -> dict:
    """A context and a reply as the text Chat-E serves: ``prompt`` is the chat-template prompt (left-truncated, ending
    with the generation prompt) and ``reply`` the assistant message up to its end-of-turn token, both rendered by
    chat_e.data.dialogue and decoded back to text for TRL (which tokenizes them again)."""
    header, turns = parse_texts(texts)
    prompt_ids = encode_chat_prompt(tokenizer, turns, header, max_source_length)
    reply_ids = chat_reply_ids(tokenizer, reply, max_target_length)
    return {"prompt": tokenizer.decode(prompt_ids), "reply": tokenizer.decode(reply_ids)}


def spin_pairs(rows: list[dict], replies: list[str], tokenizer, data_args) -> tuple[list[dict], Counter]:
    """DPO rows ``prompt``/``chosen`` (the human reply)/``rejected`` (the model's) of corpus ``rows`` (``texts``,
    ``labels``) and the model's ``replies`` to them; pairs whose model reply is empty or equals the human one are
    dropped and counted."""
    pairs, drops = [], Counter()
    for row, generated in zip(rows, replies, strict=True):
        if not generated.strip():
            drops["empty model reply"] += 1
            continue
        if " ".join(generated.split()) == " ".join(row["labels"].split()):
            drops["model reply equals the human one"] += 1
            continue
        human = spin_row(
            tokenizer, row["texts"], row["labels"], data_args.max_source_length, data_args.max_target_length
        )
        model = spin_row(tokenizer, row["texts"], generated, data_args.max_source_length, data_args.max_target_length)
        pairs.append({"prompt": human["prompt"], "chosen": human["reply"], "rejected": model["reply"]})
    return pairs, drops


def model_fingerprint(model_path: str) -> str:
    """What identifies the weights: each weight and config file's name, size and modification time (a rebuilt or
    retrained model gets a new key without hashing hundreds of MB)."""
    path = Path(model_path)
    if not path.is_dir():
        return model_path  # a hub id: its revision is the name
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".json"))
    return json.dumps([str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


def spin_cache_path(data_args, model_path: str, rows: list[dict], gen_kwargs: dict) -> Path:
    """The cache file of the model's replies to ``rows``: keyed by the model, the contexts and the generation."""
    key = json.dumps(
        {
            "version": SPIN_CACHE_VERSION,
            "model": model_fingerprint(model_path),
            "contexts": hashlib.sha256(json.dumps([r["texts"] for r in rows]).encode()).hexdigest(),
            "max_source_length": data_args.max_source_length,
            "generation": gen_kwargs,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(data_args.spin_cache_dir) / f"spin-{Path(model_path).name}-{digest}.jsonl"


def _broadcast(value):
    """Rank 0's ``value`` on every rank (so that every rank takes the same branch around a collective)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def model_replies(rows: list[dict], model_path: str, tokenizer, data_args, training_args) -> list[str]:
    """The model's own reply to every row's context, read from the cache or generated once (sharded over the ranks
    by hf-ext's batched generation, back in row order) and cached."""
    gen_kwargs = {"max_new_tokens": data_args.max_target_length, "do_sample": data_args.generation_do_sample}
    if data_args.generation_do_sample:
        gen_kwargs["temperature"] = data_args.generation_temperature
    cache = spin_cache_path(data_args, model_path, rows, gen_kwargs)
    cached = _broadcast(cache.is_file())
    if cached:
        replies = [json.loads(line)["rejected_raw"] for line in cache.read_text(encoding="utf-8").splitlines()]
        if len(replies) == len(rows):
            logger.info(f"SPIN: reusing {len(replies)} cached model replies from {cache}")
            return replies
        logger.warning(f"SPIN: {cache} holds {len(replies)} replies for {len(rows)} contexts; generating again.")
    from hf_ext.evaluation.bleu import generate_in_order  # noqa: PLC0415 (SPIN pairs generated only)

    logger.info(f"SPIN: generating the model's replies to {len(rows)} contexts ({gen_kwargs}) -> {cache}")
    model = AutoModelForCausalLM.from_pretrained(model_path).to(training_args.device).eval()
    encoded = []
    for row in rows:
        header, turns = parse_texts(row["texts"])
        encoded.append({"input_ids": encode_chat_prompt(tokenizer, turns, header, data_args.max_source_length)})
    set_seed(training_args.seed)  # the same samples on a rerun when sampling
    replies, _, stats = generate_in_order(model, tokenizer, encoded, gen_kwargs, data_args.generation_batch_size)
    logger.info(f"SPIN: generated in {stats['calls']} calls on rank {stats['rank']}")
    del model
    if training_args.process_index == 0:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"texts": r["texts"], "human": r["labels"], "rejected_raw": g}) for r, g in zip(rows, replies)
        ]
        write_text_atomically(cache, "\n".join(lines) + "\n")
    return replies


def load_spin(data_args, model_path: str, tokenizer, training_args) -> tuple[list[dict], list[dict]]:
    """SPIN training and held-out rows from an offline corpus (train and validation splits, by conversation)."""
    raw = load_offline(data_args.dataset_name, seed=data_args.data_seed_split)
    splits = {
        "train": sample(raw["train"], data_args.n_train, data_args.data_seed_split).to_list(),
        "eval": sample(raw["validation"], data_args.n_eval, data_args.data_seed_split).to_list(),
    }
    rows = splits["train"] + splits["eval"]
    replies = model_replies(rows, model_path, tokenizer, data_args, training_args)
    out = {}
    for name, part, start in (("train", splits["train"], 0), ("eval", splits["eval"], len(splits["train"]))):
        pairs, drops = spin_pairs(part, replies[start : start + len(part)], tokenizer, data_args)
        if drops:
            logger.warning(f"SPIN: dropped {sum(drops.values())} of {len(part)} {name} pairs ({dict(drops)}).")
        out[name] = to_unpaired(pairs) if data_args.loss == "kto" else pairs
    return out["train"], out["eval"]


# ---------------------------------------------------------------------------------------------- held-out scores
#: the report's before/after rows: (key, label); the shares come with their interval and row count
REPORTED = [
    (PREFERRED_SUM, "prefers chosen (summed)"),
    (PREFERRED_PER_TOKEN, "prefers chosen (per token)"),
    (REPLY_NLL, "preferred reply NLL/token"),
]


def evaluate(trainer, loss: str, batch_size: int, name: str) -> dict:
    """The model's own scores of the held-out rows (:func:`chat_e.training.heldout.heldout_metrics`), its
    parameters gathered where ZeRO-3 partitioned them; the rows scored so far go to the progress file as phase
    ``name``'s."""
    if trainer.eval_dataset is None:
        return {"rows": 0}
    model = trainer.model
    is_main = trainer.is_world_process_zero()
    with gathered(list(model.parameters())):
        return heldout_metrics(
            model,
            trainer.eval_dataset,
            loss,
            batch_size,
            trainer.processing_class.pad_token_id,
            trainer.args.device,
            progress=lambda done, total: phase_rows(name, is_main, done, total),
        )


def _cell(value) -> str:
    if isinstance(value, dict):
        return share(value["k"], value["n"]).text()
    return "—" if value is None else f"{value:.4f}"


def format_table(before: dict, after: dict, loss: str) -> str:
    """The before/after table (a share: its percentage, 95 % interval and counts)."""
    label = {"dpo": "", "kto": " (desirable)"}[loss]
    lines = [f"{'held-out':<34} {'before':>32} {'after':>32}"]
    for key, name in REPORTED:
        name = name.replace("chosen", "chosen" + label) if label else name
        lines.append(f"{name:<34} {_cell(before.get(key)):>32} {_cell(after.get(key)):>32}")
    lines.append(f"pairs: {before.get('pairing', '')}")
    return "\n".join(lines)


def check_rows_left(trainer, train_rows: int, eval_rows: int, max_length: int | None) -> None:
    """``SystemExit`` naming the fix when TRL's tokenization left no training row, or no held-out row of the
    ``eval_rows`` given (it drops a row whose prompt alone fills ``max_length`` tokens)."""
    fix = f"every prompt is at least max_length={max_length} tokens long: raise --max_length"
    if len(trainer.train_dataset) == 0:
        raise stop(f"no training row left of {train_rows}: {fix}.")
    if eval_rows and (trainer.eval_dataset is None or len(trainer.eval_dataset) == 0):
        raise stop(f"no held-out row left of {eval_rows}, so nothing can be measured: {fix}.")


def main(argv: list[str] | None = None) -> dict:  # long: the run's numbered steps in order, read top to bottom
    # TRL and the exporter are imported here: the row functions above are imported by the unit tests
    from hf_ext.saving.export import export  # noqa: PLC0415 (see above)
    from hf_ext.trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer  # noqa: PLC0415 (see above)

    join_run_niceness()  # a run the app started: this rank's session niced as the run is
    # 1. arguments: dataclass defaults < --config YAML < CLI flags; the loss picks TRL's config class
    loss = loss_of(argv)
    config_class, trainer_class = (DPOConfig, DPOTrainer) if loss == "dpo" else (KTOConfig, KTOTrainer)
    model_args, data_args, training_args = parse_args_with_config(
        (ModelArguments, PreferenceDataArguments, config_class), argv
    )
    data_args.loss = loss
    setup_logging(training_args)
    # DPO's loss_type may be TRL's sft (the chosen replies' NLL: the Train page's SFT) or a mix (sigmoid + sft)
    loss_types = training_args.loss_type  # DPO: a list; KTO: one name
    loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    if problem := replay_problem(loss, loss_types, data_args.replay):
        raise stop(problem)
    logger.info(
        f"{loss.upper()} on rank {training_args.process_index}/{training_args.world_size}, device "
        f"{training_args.device}, deepspeed {'on' if training_args.deepspeed_plugin else 'off'}"
    )
    prepare_run(training_args)
    set_seed(training_args.seed)
    is_main = training_args.process_index == 0
    phase(PREPARING, is_main)

    # 2. model files (a model is built once, by the main process, when asked and missing)
    model_path = model_args.model_name_or_path
    if model_args.build_model:
        with training_args.main_process_first(desc="building the model"):
            if training_args.local_process_index == 0 and not Path(model_path).exists():
                build_model(model_path, model_args.build_model, seed=training_args.seed)
    config = AutoConfig.from_pretrained(model_path)
    if family_of(config) != "causal":
        raise stop(f"{model_path} is an encoder-decoder model; preference tuning here needs a chat model.")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # 3. data: preference rows from a file or the hub, else SPIN pairs from an offline corpus
    if data_args.data_file or (data_args.dataset_name and data_args.dataset_name not in OFFLINE_DATASETS):
        train_rows, eval_rows = load_rows(data_args)
        source = data_args.data_file or data_args.dataset_name
    else:
        train_rows, eval_rows = load_spin(data_args, model_path, tokenizer, training_args)
        source = f"SPIN pairs of {data_args.dataset_name}"
    if data_args.replay:
        replayed = replay_rows(data_args, tokenizer, conversational=not isinstance(train_rows[0]["prompt"], str))
        train_rows = train_rows + replayed
        source += f" + {len(replayed)} replayed rows of {data_args.replay_dataset}"
    logger.info(f"{source}: {len(train_rows)} training rows, {len(eval_rows)} held-out rows ({loss.upper()})")
    train_dataset = datasets.Dataset.from_list(without_groups(train_rows))
    eval_dataset = datasets.Dataset.from_list(without_groups(eval_rows)) if eval_rows else None

    # 4. model: loaded after the arguments, so ZeRO-3 partitions it while loading; TRL adds the adapter
    model = AutoModelForCausalLM.from_pretrained(model_path)
    peft_config = model_args.lora_config("CAUSAL_LM")

    # 5. trainer (the reference model: the adapter disabled with LoRA, else a frozen copy TRL loads itself)
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=progress_callbacks(),
    )

    # TRL drops rows whose prompt alone fills max_length: a run left with nothing to train or to measure stops here,
    # in one line, rather than ending "done" with nothing measured
    check_rows_left(trainer, len(train_rows), len(eval_rows), training_args.max_length)

    # 6. evaluate, train, evaluate, 7. save
    out = Path(training_args.output_dir)
    batch = training_args.per_device_eval_batch_size
    # the rows as TRL kept them (the page shows the split while the evaluation runs)
    phase(
        EVAL_BEFORE,
        is_main,
        training_rows=len(trainer.train_dataset),
        held_out_rows=len(trainer.eval_dataset) if trainer.eval_dataset is not None else 0,
    )
    before = evaluate(trainer, loss, batch, EVAL_BEFORE)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    phase(EVAL_AFTER, is_main)
    after = evaluate(trainer, loss, batch, EVAL_AFTER)
    phase(SAVING, is_main)
    merge = model_args.use_peft and model_args.merge_adapter
    trainer.save_model(str(out / "adapter") if merge else None)
    if merge and trainer.is_world_process_zero():
        export(out / "adapter", out, merge=True)  # the merged model is what Chat-E serves
        logger.info(f"Saved the adapter in {out / 'adapter'} and the merged model in {out}")
    metrics = {**result.metrics, "run": run_summary(trainer)}
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    # 8. report: before/after on the held-out rows
    report = {
        "loss": loss,
        "loss_type": loss_types,
        "data": source,
        "model": model_path,
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "beta": training_args.beta,
        "sft_weight": getattr(training_args, "sft_weight", None),  # KTO's SFT term (hf_ext.trl.KTOConfig)
        "steps": trainer.state.global_step,
        "train_runtime_s": result.metrics.get("train_runtime"),
        "before": before,
        "after": after,
        "data_args": asdict(data_args),
    }
    if trainer.is_world_process_zero():
        write_text_atomically(out / PREFERENCE_REPORT, json.dumps(report, indent=1, default=str) + "\n")
        trained = loss.upper() + (
            f" (loss {' + '.join(loss_types)})" if loss_types != ["sigmoid"] and loss == "dpo" else ""
        )
        if report["sft_weight"]:
            trained += f" + {report['sft_weight']:g} x SFT on the desirable replies"
        print(f"\n=== {trained} on {source}: {len(eval_rows)} held-out rows ===")
        print(format_table(before, after, loss))
        print(f"\nChat with it: chat-e --model {out}")
    return report


def run(argv: list[str]) -> None:
    """The recipe's command line: :func:`main` in this process (one rank of whatever launched it)."""
    main(argv)
    end_distributed()


if __name__ == "__main__":
    run(sys.argv[1:])
