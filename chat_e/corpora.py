"""Dialogue data in MuDoConv's (``texts`` -> ``labels``) format, from the hub, local files, or offline.

* ``dataset_name="smangrul/MuDoConv"`` (or any hub dataset with the two columns) goes through
  :func:`datasets.load_dataset`.
* ``train_file`` / ``validation_file`` / ``test_file``: local ``.json``, ``.jsonl`` or ``.csv``.
* ``dataset_name="chatterbot"``: the English ``chatterbot-corpus`` (a PyPI package, so it works offline) converted
  to MuDoConv pairs, split by conversation with a fixed seed.

Bad rows (missing, empty or non-string ``texts``/``labels``, unparsable lines) are counted, skipped and reported in
one log line per split; they never crash a run.
"""

from __future__ import annotations

import csv
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from .dialogue import encode_texts, format_context

logger = logging.getLogger(__name__)

CHATTERBOT = "chatterbot"
SPLITS = ("train", "validation", "test")

#: chatterbot-corpus category -> (dialogue mode, header context). Everything else is ``domain: <category>``.
CHATTERBOT_HEADERS: dict[str, tuple[str, str]] = {
    "emotion": ("emotion", "emotional"),
    "profile": ("persona", "I am a chatbot. I like robots, computers and talking to people."),
}


@dataclass
class DataArguments:
    """Where the dialogues come from and how they are cut."""

    dataset_name: str | None = field(
        default=CHATTERBOT,
        metadata={"help": "Hub dataset (e.g. smangrul/MuDoConv) or 'chatterbot' for the offline corpus."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "Local .json/.jsonl/.csv with texts/labels."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file."})
    test_file: str | None = field(default=None, metadata={"help": "Local test file."})
    text_column: str = field(default="texts", metadata={"help": "Column holding the dialogue context."})
    label_column: str = field(default="labels", metadata={"help": "Column holding the response."})
    max_source_length: int = field(
        default=128, metadata={"help": "Context tokens kept (left-truncated: newest turns stay)."}
    )
    max_target_length: int = field(default=64, metadata={"help": "Response tokens kept for training labels."})
    n_train: int | None = field(default=None, metadata={"help": "Random sample (seeded) of training rows."})
    n_val: int | None = field(default=None, metadata={"help": "Random sample (seeded) of validation rows."})
    n_test: int | None = field(default=None, metadata={"help": "Random sample (seeded) of test rows."})
    data_seed_split: int = field(default=42, metadata={"help": "Seed of the chatterbot split and the sampling."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


# ---------------------------------------------------------------------------------------------- chatterbot corpus
def chatterbot_conversations(language: str = "english") -> list[dict]:
    """Every conversation of the installed ``chatterbot-corpus``: ``{"category", "turns"}``, in file order."""
    import yaml

    try:
        import chatterbot_corpus
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ImportError("The offline corpus needs `pip install chatterbot-corpus`.") from err
    root = Path(chatterbot_corpus.__file__).parent / "data" / language
    conversations = []
    for path in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        category = (doc.get("categories") or [path.stem])[0]
        for turns in doc.get("conversations") or []:
            turns = [" ".join(str(t).split()) for t in turns if t is not None and str(t).strip()]
            if len(turns) >= 2:
                conversations.append({"category": str(category), "turns": turns})
    return conversations


def conversation_pairs(category: str, turns: list[str]) -> list[dict]:
    """MuDoConv pairs of one conversation: each turn after the first answers the turns before it.

    Both speaker directions are covered: speaker B's turns (odd positions) answer speaker A, and — the dialogue seen
    with the speakers swapped — speaker A's later turns (even positions) answer speaker B.
    """
    mode, context = CHATTERBOT_HEADERS.get(category, ("domain", category.replace("_", " ")))
    return [
        {"texts": format_context(turns[:i], mode, context), "labels": turns[i], "category": category}
        for i in range(1, len(turns))
    ]


def load_chatterbot(seed: int = 42, val_fraction: float = 0.1, test_fraction: float = 0.1) -> datasets.DatasetDict:
    """The offline corpus as a seeded train/validation/test split *by conversation*.

    Conversations that open with the same turn (the corpus repeats questions with other answers) stay in one split,
    so no evaluation context is also a training context.
    """
    groups: dict[str, list[dict]] = {}
    for conv in chatterbot_conversations():
        groups.setdefault(conv["turns"][0].lower(), []).append(conv)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    n_total = sum(len(g) for g in groups.values())
    targets = {"validation": n_total * val_fraction, "test": n_total * test_fraction}
    parts: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for key in keys:
        split = next((s for s in ("validation", "test") if len(parts[s]) < targets[s]), "train")
        parts[split].extend(groups[key])
    out = {}
    for split in SPLITS:
        rows = [pair for conv in parts[split] for pair in conversation_pairs(conv["category"], conv["turns"])]
        out[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(out)


# ---------------------------------------------------------------------------------------------- local files
def _read_rows(path: str) -> tuple[list, int]:
    """Rows of a local json/jsonl/csv file and the number of unparsable lines (for jsonl)."""
    suffix = Path(path).suffix.lower()
    text = Path(path).read_text(encoding="utf-8")
    if suffix == ".csv":
        return list(csv.DictReader(text.splitlines())), 0
    if suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None  # JSON Lines saved as .json
        if doc is not None:
            if isinstance(doc, dict) and "data" in doc:
                doc = doc["data"]
            if isinstance(doc, dict):  # column-oriented {"texts": [...], "labels": [...]}
                doc = [dict(zip(doc, values)) for values in zip(*doc.values())]
            return list(doc), 0
    if suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: unsupported extension {suffix!r}; use .json, .jsonl or .csv.")
    rows, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return rows, bad


def clean_rows(rows, text_column: str, label_column: str, split: str, unparsable: int = 0) -> list[dict]:
    """Keep rows whose two columns are non-empty strings; report the rest in one log line."""
    kept, problems = [], Counter()
    problems["unparsable line"] += unparsable
    for row in rows:
        if not isinstance(row, dict):
            problems["not a record"] += 1
            continue
        problem = None
        for column in (text_column, label_column):
            value = row.get(column)
            if value is None:
                problem = f"missing '{column}'"
            elif not isinstance(value, str):
                problem = f"non-string '{column}'"
            elif not value.strip():
                problem = f"empty '{column}'"
            if problem:
                break
        if problem:
            problems[problem] += 1
        else:
            kept.append({"texts": row[text_column], "labels": row[label_column]})
    skipped = sum(problems.values())
    if skipped:
        detail = ", ".join(f"{n} {what}" for what, n in problems.most_common() if n)
        logger.warning(f"Skipped {skipped} of {skipped + len(kept)} rows in the {split} split ({detail}).")
    return kept


def _clean_dataset(ds: datasets.Dataset, args: DataArguments, split: str) -> datasets.Dataset:
    """Hub path: same checks as for local files, done with ``Dataset.filter``."""
    missing = [c for c in (args.text_column, args.label_column) if c not in ds.column_names]
    if missing:
        raise ValueError(f"The {split} split has no column {missing[0]!r} (columns: {ds.column_names}).")

    def ok(value):
        return isinstance(value, str) and bool(value.strip())

    before = len(ds)
    ds = ds.filter(lambda r: ok(r[args.text_column]) and ok(r[args.label_column]), desc=f"Checking {split} rows")
    if before - len(ds):
        logger.warning(f"Skipped {before - len(ds)} of {before} rows in the {split} split (missing/empty/non-string).")
    ds = ds.rename_columns({c: n for c, n in ((args.text_column, "texts"), (args.label_column, "labels")) if c != n})
    return ds.select_columns(["texts", "labels"])


# ---------------------------------------------------------------------------------------------- entry points
def sample(ds: datasets.Dataset, n: int | None, seed: int) -> datasets.Dataset:
    """``n`` rows chosen at random with ``seed`` (not the first ``n``: MuDoConv's first rows are one source)."""
    if n is None or n >= len(ds):
        return ds
    return ds.shuffle(seed=seed).select(range(n))


def load_dialogue_dataset(args: DataArguments) -> datasets.DatasetDict:
    """Train/validation/test splits with ``texts``/``labels`` columns, sampled per ``n_train``/``n_val``/``n_test``."""
    files = {s: f for s, f in zip(SPLITS, (args.train_file, args.validation_file, args.test_file)) if f}
    if files:
        out = {}
        for split, path in files.items():
            rows, unparsable = _read_rows(path)
            out[split] = datasets.Dataset.from_list(
                clean_rows(rows, args.text_column, args.label_column, split, unparsable),
                features=datasets.Features({"texts": datasets.Value("string"), "labels": datasets.Value("string")}),
            )
        raw = datasets.DatasetDict(out)
    elif args.dataset_name == CHATTERBOT:
        raw = load_chatterbot(seed=args.data_seed_split).select_columns(["texts", "labels"])
    elif args.dataset_name:
        hub = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        raw = datasets.DatasetDict({split: _clean_dataset(ds, args, split) for split, ds in hub.items()})
    else:
        raise ValueError("No data: pass --dataset_name (e.g. smangrul/MuDoConv or chatterbot) or --train_file.")
    limits = {"train": args.n_train, "validation": args.n_val, "test": args.n_test}
    return datasets.DatasetDict(
        {split: sample(ds, limits.get(split), args.data_seed_split) for split, ds in raw.items()}
    )


def tokenize_dataset(ds: datasets.Dataset, tokenizer, args: DataArguments, desc: str = "Tokenizing"):
    """``input_ids``/``attention_mask`` (left-truncated contexts) and ``labels`` (response ids ending in ``</s>``)."""

    def encode(batch):
        input_ids = [encode_texts(tokenizer, t, args.max_source_length) for t in batch["texts"]]
        labels = tokenizer(text_target=batch["labels"], max_length=args.max_target_length, truncation=True)
        return {
            "input_ids": input_ids,
            "attention_mask": [[1] * len(ids) for ids in input_ids],
            "labels": labels["input_ids"],
        }

    return ds.map(
        encode,
        batched=True,
        remove_columns=ds.column_names,
        num_proc=args.preprocessing_num_workers,
        desc=desc,
    )
