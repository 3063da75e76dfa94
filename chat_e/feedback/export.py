"""Feedback and arena votes made into rows the recipes train on: ``chat-e feedback export --format dpo|kto|sft``.

The rules, each applied once (a row dropped says why, and the counts are printed):

* A reply's **newest** rating is its rating (a thumb taken back is none); ratings give KTO rows: thumb up -> label
  true, thumb down -> false.
* A **correction** makes the corrected text chosen over the original reply.
* A reply **preferred over its regeneration** (or the other way round) is chosen over the other.
* A **first-turn arena vote** for one side makes its reply chosen over the other's (ties and both-bad make no pair; a
  later turn's sides saw different histories, so they make none either).
* **DPO** rows are those pairs; **KTO** rows are the ratings plus every pair unpaired (chosen true, rejected false, as
  TRL unpairs them), a both-bad first-turn vote two false rows; **SFT** rows are the replies people endorsed: thumbs
  up, corrections, preferred replies and first-turn arena winners. A thumbed-down reply is never an SFT target, and
  neither is a reply that lost a choice or a vote.
* A row identical to an earlier one (same prompt and replies) is a duplicate and dropped; so is a pair or a rating
  with an empty reply (a model can end its turn at once), which no recipe takes.

DPO and KTO rows are TRL's conversational rows (``prompt``/``chosen``/``rejected``, ``prompt``/``completion``/``label``,
with the chat's ``session_id``, so that the training holds out whole sessions),
the prompt rendered by :func:`chat_e.data.dialogue.chat_messages` -- the system message and turns Chat-E's decoder-only
engine puts through the chat template -- so ``recipes/preference.py --data_file rows.jsonl`` trains on exactly what
the model saw. SFT rows are the dialogue recipe's ``texts``/``labels`` (MuDoConv's format,
:func:`chat_e.data.dialogue.format_context`): ``recipes/blenderbot.py --train_file rows.jsonl``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hf_ext.atomic import write_text_atomically

from ..data.dialogue import chat_messages, clean_turn, format_context, make_header
from .store import CHOICE, EDIT, RATING

FORMATS = ("dpo", "kto", "sft")


def _prompt(row: Mapping[str, Any]) -> list[dict]:
    turns = [*row["history"], row["message"]]
    return chat_messages(turns, make_header(row["mode"], row["context"]))


def _texts(row: Mapping[str, Any]) -> str:
    return format_context([*row["history"], row["message"]], row["mode"], row["context"])


def _session(row: Mapping[str, Any]) -> dict:
    """The row's chat session, which the training's hold-out keeps on one side (never split by row)."""
    return {"session_id": row["session_id"]} if row.get("session_id") else {}


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": clean_turn(text)}]


class Examples:
    """The training examples in a store's rows: ratings, preference pairs and endorsed replies, with the counts of
    what was dropped and why (see the module docstring)."""

    def __init__(self, feedback: Iterable[Mapping[str, Any]], votes: Iterable[Mapping[str, Any]] = ()):
        self.dropped: Counter = Counter()
        self.ratings: list[tuple[Mapping, str, bool]] = []  # (exchange, reply, liked)
        self.pairs: list[tuple[Mapping, str, str]] = []  # (exchange, chosen, rejected)
        self.endorsed: list[tuple[Mapping, str]] = []  # (exchange, reply)
        self.undesirable: list[tuple[Mapping, str]] = []  # (exchange, reply): both-bad first-turn votes
        self.both_bad = 0
        newest: dict[tuple[str, str], Mapping] = {}
        for row in feedback:
            if row["kind"] == RATING:
                newest[(row["session_id"], row["reply_id"])] = row  # rows come oldest first
            elif row["kind"] == EDIT:
                self._pair(row, row["edited"], row["reply"], "correction equal to the reply")
            elif row["kind"] == CHOICE:
                self._pair(row, row["reply"], row["other_reply"], "choice between identical replies")
        for row in newest.values():
            if not row["rating"]:
                self.dropped["rating taken back"] += 1
                continue
            if not clean_turn(row["reply"]):
                self.dropped["empty reply"] += 1
                continue
            self.ratings.append((row, row["reply"], row["rating"] > 0))
            if row["rating"] > 0:
                self.endorsed.append((row, row["reply"]))
        for vote in votes:
            self._vote(vote)

    def _pair(self, row: Mapping, chosen: str, rejected: str, same: str) -> None:
        if not clean_turn(chosen) or not clean_turn(rejected):
            self.dropped["empty reply"] += 1
            return
        if clean_turn(chosen) == clean_turn(rejected):
            self.dropped[same] += 1
            return
        self.pairs.append((row, chosen, rejected))
        self.endorsed.append((row, chosen))

    def _vote(self, vote: Mapping) -> None:
        # each side's own history (chat_e.web.arena): on the first turn both are the battle's (empty) start
        histories = vote["history"] if isinstance(vote["history"], Mapping) else {"model_a": vote["history"]}
        vote = {**vote, "history": histories.get("model_a", [])}
        if vote["turn"] != 1 or any(h != vote["history"] for h in histories.values()):
            self.dropped["arena vote after the first turn"] += 1
        elif vote["winner"] == "tie":
            self.dropped["arena tie"] += 1
        elif vote["winner"] == "bothbad":
            self.both_bad += 1
            self.undesirable += [(vote, reply) for reply in (vote["reply_a"], vote["reply_b"]) if clean_turn(reply)]
        else:
            won, lost = ("reply_a", "reply_b") if vote["winner"] == "model_a" else ("reply_b", "reply_a")
            self._pair(vote, vote[won], vote[lost], "arena vote between identical replies")

    def unused(self, fmt: str) -> Counter:
        """What the format ``fmt`` has no row for, by the rules: ratings make no DPO pair, a thumb down or a both-bad
        vote no SFT target."""
        liked = sum(1 for _, _, ok in self.ratings if ok)
        return Counter(
            {
                "dpo": {
                    "rating (no pair)": len(self.ratings),
                    "arena both bad (KTO only)": self.both_bad,
                },
                "kto": {},
                "sft": {
                    "thumb down (never an SFT target)": len(self.ratings) - liked,
                    "arena both bad (KTO only)": self.both_bad,
                },
            }[fmt]
        )

    def rows(self, fmt: str) -> list[dict]:
        """The rows of format ``fmt`` (``dpo``, ``kto`` or ``sft``), duplicates dropped (and counted)."""
        if fmt == "dpo":
            rows = [
                {"prompt": _prompt(r), "chosen": _assistant(c), "rejected": _assistant(x), **_session(r)}
                for r, c, x in self.pairs
            ]
        elif fmt == "kto":
            labelled = [(r, reply, liked) for r, reply, liked in self.ratings]
            labelled += [(r, c, True) for r, c, _ in self.pairs] + [(r, x, False) for r, _, x in self.pairs]
            labelled += [(r, reply, False) for r, reply in self.undesirable]
            rows = [
                {"prompt": _prompt(r), "completion": _assistant(c), "label": ok, **_session(r)}
                for r, c, ok in labelled
            ]
        elif fmt == "sft":
            rows = [{"texts": _texts(r), "labels": clean_turn(reply)} for r, reply in self.endorsed]
        else:
            raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}.")
        unique, seen = [], set()
        for row in rows:
            # the same prompt and replies from another session is a duplicate too
            key = json.dumps({k: v for k, v in row.items() if k != "session_id"}, sort_keys=True)
            if key in seen:
                self.dropped["duplicate"] += 1
                continue
            seen.add(key)
            unique.append(row)
        return unique


def export(feedback, votes, fmt: str, out: str | Path) -> tuple[int, Counter]:
    """Write the ``fmt`` rows of ``feedback`` and ``votes`` to ``out`` (JSON Lines, all or nothing); the number
    written, and the counts of what made no row and why."""
    examples = Examples(feedback, votes)
    rows = examples.rows(fmt)
    write_text_atomically(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return len(rows), +(examples.dropped + examples.unused(fmt))
