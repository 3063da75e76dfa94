"""Dialogue data in MuDoConv's (``texts`` -> ``labels``) format, from the hub, local files, or offline.

* ``dataset_name="smangrul/MuDoConv"`` (or any hub dataset with the two columns) goes through
  :func:`datasets.load_dataset`.
* ``train_file`` / ``validation_file`` / ``test_file``: local ``.json``, ``.jsonl`` or ``.csv``.
* ``dataset_name="chatterbot"``: the English ``chatterbot-corpus`` (a PyPI package, so it works offline) converted
  to MuDoConv pairs, split by conversation with a fixed seed.
* ``dataset_name="chitchat"``: the BYU Chit-Chat Challenge corpus (``chitchat-dataset``, also offline): real
  human-to-human chats, each under its opening prompt as a ``topic:`` header, split by conversation the same way.
* ``dataset_name="chitchat+chatterbot"``: both offline corpora, each split by conversation, the splits concatenated
  and shuffled with the seed.

Bad rows (missing, empty or non-string ``texts``/``labels``, unparsable lines) are counted, skipped and reported in
one log line per split; they never crash a run.
"""

from __future__ import annotations

import csv
import json
import logging
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import datasets
import yaml

from .dialogue import clean_turn, encode_example, format_context

logger = logging.getLogger(__name__)

CHATTERBOT = "chatterbot"
CHITCHAT = "chitchat"
#: offline ``dataset_name`` -> the corpora it combines
OFFLINE_DATASETS: dict[str, tuple[str, ...]] = {
    CHATTERBOT: (CHATTERBOT,),
    CHITCHAT: (CHITCHAT,),
    f"{CHITCHAT}+{CHATTERBOT}": (CHITCHAT, CHATTERBOT),
}
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
        metadata={
            "help": "Hub dataset (e.g. smangrul/MuDoConv) or an offline corpus: 'chatterbot', 'chitchat' or "
            "'chitchat+chatterbot'."
        },
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
    data_seed_split: int = field(
        default=42, metadata={"help": "Seed of the offline corpora's split and the sampling."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


# ---------------------------------------------------------------------------------------------- chatterbot corpus
#: libyaml's safe loader where PyYAML was built with it: the same documents as the pure-Python one on every file of the
#: corpus, parsed in a tenth of the time (docs/testing.md)
CORPUS_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def chatterbot_conversations(language: str = "english") -> list[dict]:
    """Every conversation of the installed ``chatterbot-corpus``: ``{"category", "turns"}``, in file order."""
    try:
        import chatterbot_corpus  # noqa: PLC0415 (optional extra: chat)
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ImportError("The offline corpus needs `pip install chatterbot-corpus`.") from err
    root = Path(chatterbot_corpus.__file__).parent / "data" / language
    conversations = []
    for path in sorted(root.glob("*.yml")):
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=CORPUS_LOADER) or {}  # noqa: S506 - a safe loader
        category = (doc.get("categories") or [path.stem])[0]
        for turns in doc.get("conversations") or []:
            turns = [" ".join(str(t).split()) for t in turns if t is not None and str(t).strip()]
            if len(turns) >= 2:
                conversations.append({"category": str(category), "turns": turns})
    return conversations


def conversation_pairs(
    category: str,
    turns: list[str],
    mode: str | None = None,
    context: str | None = None,
    max_context_turns: int | None = None,
) -> list[dict]:
    """MuDoConv pairs of one conversation: each turn after the first answers the turns before it.

    Both speaker directions are covered: speaker B's turns (odd positions) answer speaker A, and — the dialogue seen
    with the speakers swapped — speaker A's later turns (even positions) answer speaker B.

    The header is ``mode``/``context`` when ``mode`` is given, else the chatterbot category's
    (:data:`CHATTERBOT_HEADERS`, otherwise ``domain: <category>``). ``max_context_turns`` keeps only that many of
    the newest turns in each context (None: all of them).
    """
    if mode is None:
        mode, context = CHATTERBOT_HEADERS.get(category, ("domain", category.replace("_", " ")))
    keep = len(turns) if max_context_turns is None else max_context_turns
    return [
        {"texts": format_context(turns[max(0, i - keep) : i], mode, context), "labels": turns[i], "category": category}
        for i in range(1, len(turns))
    ]


def pair_rows(
    conversations: list[dict], to_pairs: Callable[[dict], list[dict]]
) -> tuple[datasets.Dataset, list[range]]:
    """Every conversation's pairs (``to_pairs``) in one dataset, in corpus order, and each conversation's rows."""
    rows, spans = [], []
    for conv in conversations:
        pairs = to_pairs(conv)
        spans.append(range(len(rows), len(rows) + len(pairs)))
        rows.extend(pairs)
    return datasets.Dataset.from_list(rows), spans


def split_by_conversation(
    conversations: list[dict],
    group_key: Callable[[dict], object],
    pairs: datasets.Dataset,
    spans: list[range],
    seed: int,
    val_fraction: float,
    test_fraction: float,
) -> datasets.DatasetDict:
    """A seeded train/validation/test split of ``conversations``, as the rows of their ``pairs`` (see
    :func:`pair_rows`).

    Conversations with the same ``group_key`` (each corpus keys them by how they open) stay in one split, so no
    evaluation context that opens a conversation is also a training context. The fractions count conversations.
    The split only selects rows, so a corpus's pairs can be built once and split with any seed.
    """
    groups: dict[object, list[int]] = {}
    for index, conv in enumerate(conversations):
        groups.setdefault(group_key(conv), []).append(index)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    n_total = sum(len(g) for g in groups.values())
    targets = {"validation": n_total * val_fraction, "test": n_total * test_fraction}
    parts: dict[str, list[int]] = {split: [] for split in SPLITS}
    for key in keys:
        split = next((s for s in ("validation", "test") if len(parts[s]) < targets[s]), "train")
        parts[split].extend(groups[key])
    return datasets.DatasetDict(
        {split: pairs.select([row for index in parts[split] for row in spans[index]]) for split in SPLITS}
    )


def load_chatterbot(seed: int = 42, val_fraction: float = 0.1, test_fraction: float = 0.1) -> datasets.DatasetDict:
    """The offline corpus as a seeded train/validation/test split *by conversation*.

    Conversations that open with the same turn (the corpus repeats questions with other answers) stay in one split,
    so no evaluation context is also a training context.
    """
    conversations = chatterbot_conversations()
    pairs, spans = pair_rows(conversations, lambda conv: conversation_pairs(conv["category"], conv["turns"]))
    return split_by_conversation(
        conversations,
        group_key=lambda conv: conv["turns"][0].lower(),
        pairs=pairs,
        spans=spans,
        seed=seed,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
    )


#: topics of the classification task: the chatterbot categories with at least this many conversations
TOPIC_MIN_CONVERSATIONS = 40
#: conversations kept per topic (a seeded sample), so that no topic outweighs the others several times over
TOPIC_MAX_CONVERSATIONS = 200


def load_chatterbot_topics(
    seed: int = 42, val_fraction: float = 0.1, test_fraction: float = 0.1
) -> datasets.DatasetDict:
    """Which topic a chatterbot exchange belongs to: ``text`` (a conversation's first two turns), ``label`` (its
    category, a ``ClassLabel``), split by conversation like :func:`load_chatterbot`.

    Categories with fewer than :data:`TOPIC_MIN_CONVERSATIONS` conversations are left out; larger ones are sampled
    down to :data:`TOPIC_MAX_CONVERSATIONS` (seeded).
    """
    by_topic: dict[str, list[dict]] = defaultdict(list)
    for conv in chatterbot_conversations():
        by_topic[conv["category"]].append(conv)
    topics = sorted(t for t, convs in by_topic.items() if len(convs) >= TOPIC_MIN_CONVERSATIONS)
    rng = random.Random(seed)
    conversations = []
    for topic in topics:
        convs = by_topic[topic]
        conversations += rng.sample(convs, TOPIC_MAX_CONVERSATIONS) if len(convs) > TOPIC_MAX_CONVERSATIONS else convs
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=topics)})
    rows = [{"text": " ".join(conv["turns"][:2]), "label": topics.index(conv["category"])} for conv in conversations]
    return split_by_conversation(
        conversations,
        group_key=lambda conv: conv["turns"][0].lower(),
        pairs=datasets.Dataset.from_list(rows, features=features),
        spans=[range(i, i + 1) for i in range(len(rows))],
        seed=seed,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
    )


# ---------------------------------------------------------------------------------------------- chitchat corpus
#: Newest turns kept in the context of each chitchat pair. Chitchat conversations are long (median 17 turns after
#: merging, up to 564) and a turn averages ~17 words, so 8 turns already fill the default 128-token source budget
#: (older turns would be cut by the left truncation anyway); without a cap the ``texts`` column would grow
#: quadratically with the conversation length.
CHITCHAT_CONTEXT_TURNS = 8

#: A message that is only one or more links (a shared video or page) gives no text to learn an answer from.
_URL_ONLY_RE = re.compile(r"(?:(?:https?://|www\.)\S+\s*)+", re.IGNORECASE)


@lru_cache(maxsize=1)
def chitchat_corpus() -> Mapping:
    """The installed BYU Chit-Chat Challenge corpus, read once per process (a 40 MB JSON file)."""
    try:
        import chitchat_dataset  # noqa: PLC0415 (optional extra: chat)
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ImportError("The chitchat corpus needs `pip install chitchat-dataset`.") from err
    return chitchat_dataset.Dataset()


def chitchat_conversations(dataset: Mapping | None = None) -> tuple[list[dict], Counter]:
    """Conversations of the chitchat corpus (default: the installed one) as ``{"category", "topic", "turns"}``, and
    what was dropped, counted per reason.

    ``dataset`` maps conversation ids to ``{"prompt", "messages": [[{"text", "sender", ...}, ...], ...]}``. A turn
    is the consecutive messages of one sender, whitespace collapsed and joined by a space; the topic is the prompt
    (missing or non-string: no header). Skipped and counted: empty and URL-only messages, malformed records (no
    message list, a group that is not a list, a message that is not a dict or has no sender or non-string text), and
    conversations left with fewer than 2 turns (never answered). Nothing in ``dataset`` makes this raise.
    """
    dataset = chitchat_corpus() if dataset is None else dataset
    conversations, drops = [], Counter()
    for record in dataset.values():
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list):
            drops["conversation without a message list"] += 1
            continue
        turns, speaker = [], None
        for group in messages:
            if not isinstance(group, list):
                drops["message group not a list"] += 1
                continue
            for message in group:
                if not isinstance(message, dict):
                    drops["message not a dict"] += 1
                elif not isinstance(message.get("text"), str):
                    drops["message text not a string"] += 1
                elif message.get("sender") is None:
                    drops["message without sender"] += 1
                elif not (text := clean_turn(message["text"])):
                    drops["empty message"] += 1
                elif _URL_ONLY_RE.fullmatch(text):
                    drops["URL-only message"] += 1
                elif turns and message["sender"] == speaker:
                    turns[-1] += " " + text
                else:
                    turns.append(text)
                    speaker = message["sender"]
        if len(turns) < 2:
            drops["conversation with fewer than 2 turns"] += 1
            continue
        prompt = record.get("prompt")
        topic = clean_turn(prompt) if isinstance(prompt, str) else ""
        conversations.append({"category": CHITCHAT, "topic": topic, "turns": turns})
    detail = ", ".join(f"{n} {what}" for what, n in drops.most_common())
    logger.info(
        f"Chitchat corpus: kept {len(conversations)} of {len(dataset)} conversations ({detail or 'no drops'})."
    )
    return conversations, drops


def chitchat_pairs(conversation: dict) -> list[dict]:
    """MuDoConv pairs of one chitchat conversation: ``topic: <prompt>`` header, newest
    :data:`CHITCHAT_CONTEXT_TURNS` turns of context."""
    return conversation_pairs(
        conversation["category"], conversation["turns"], "topic", conversation["topic"], CHITCHAT_CONTEXT_TURNS
    )


@lru_cache(maxsize=1)
def _chitchat_pairs() -> tuple[list[dict], datasets.Dataset, list[range]]:
    """The installed corpus's conversations and their pairs (see :func:`pair_rows`), built once per process: the
    ~130k contexts take seconds, and every split (any seed) only selects rows of them."""
    conversations = chitchat_conversations()[0]
    return (conversations, *pair_rows(conversations, chitchat_pairs))


def load_chitchat(seed: int = 42, val_fraction: float = 0.1, test_fraction: float = 0.1) -> datasets.DatasetDict:
    """The chitchat corpus as a seeded train/validation/test split *by conversation*.

    Conversations that open with the same context (same prompt, same first turn: many just say "hello?") stay in
    one split, like chatterbot's; each conversation's pairs all go to its split.
    """
    conversations, pairs, spans = _chitchat_pairs()
    return split_by_conversation(
        conversations,
        group_key=lambda conv: format_context(conv["turns"][:1], "topic", conv["topic"]).lower(),
        pairs=pairs,
        spans=spans,
        seed=seed,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
    )


def load_offline(name: str, seed: int = 42) -> datasets.DatasetDict:
    """An offline ``dataset_name`` (:data:`OFFLINE_DATASETS`) with ``texts``/``labels`` columns; a combination is
    each corpus split by conversation, then concatenated per split and shuffled with ``seed``."""
    loaders = {CHATTERBOT: load_chatterbot, CHITCHAT: load_chitchat}
    parts = [loaders[corpus](seed=seed).select_columns(["texts", "labels"]) for corpus in OFFLINE_DATASETS[name]]
    if len(parts) == 1:
        return parts[0]
    return datasets.DatasetDict(
        {split: datasets.concatenate_datasets([p[split] for p in parts]).shuffle(seed=seed) for split in SPLITS}
    )


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
    elif args.dataset_name in OFFLINE_DATASETS:
        raw = load_offline(args.dataset_name, seed=args.data_seed_split)
    elif args.dataset_name:
        hub = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        raw = datasets.DatasetDict({split: _clean_dataset(ds, args, split) for split, ds in hub.items()})
    else:
        raise ValueError(
            "No data: pass --dataset_name (e.g. smangrul/MuDoConv, chatterbot or chitchat) or --train_file."
        )
    limits = {"train": args.n_train, "validation": args.n_val, "test": args.n_test}
    return datasets.DatasetDict(
        {split: sample(ds, limits.get(split), args.data_seed_split) for split, ds in raw.items()}
    )


class _EncodeBatch:
    """``Dataset.map``'s function for :func:`tokenize_dataset`: an instance of a module-level class, which ``datasets``
    fingerprints by its settings (the tokenizer, the lengths, the family). A closure would be fingerprinted by value:
    dill disassembles its code (``dill.detect.nestedglobals`` prints ``dis.dis`` into a captured stdout), and under Ray
    Train, whose print patch logs captured prints too, every worker's log would get thousands of bytecode lines."""

    def __init__(self, tokenizer, max_source_length: int, max_target_length: int, family: str):
        self.tokenizer, self.family = tokenizer, family
        self.max_source_length, self.max_target_length = max_source_length, max_target_length

    def __call__(self, batch: dict) -> dict:
        rows = [
            encode_example(self.tokenizer, t, r, self.max_source_length, self.max_target_length, self.family)
            for t, r in zip(batch["texts"], batch["labels"])
        ]
        return {key: [row[key] for row in rows] for key in ("input_ids", "attention_mask", "labels")}


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer, args: DataArguments, desc: str = "Tokenizing", family: str = "seq2seq"
):
    """``input_ids``/``attention_mask`` (left-truncated contexts) and ``labels``, in ``family``'s rendering
    (:func:`chat_e.data.dialogue.encode_example`): the response ids for an encoder-decoder; for a decoder-only model the
    chat-template prompt followed by the reply, with the loss on the reply only."""
    return ds.map(
        _EncodeBatch(tokenizer, args.max_source_length, args.max_target_length, family),
        batched=True,
        remove_columns=ds.column_names,
        num_proc=args.preprocessing_num_workers,
        desc=desc,
    )
