"""Chat-E's feedback store (SQLAlchemy + Alembic, SQLite in WAL mode) and the export rules, on hand-made rows.

The oracles: Alembic's own comparison of the migrated database with the tables' declaration, SQLite's pragmas read
through the standard library, training rows written out by hand here, and the recipes' own row checks.
"""

from __future__ import annotations

import datetime
import json
import sqlite3

import pytest
from sqlalchemy import inspect

from chat_e.feedback.export import Examples
from chat_e.feedback.store import Base, FeedbackStore

PERSONA = "I like cats."
#: the prompt Chat-E's decoder-only engine renders for this exchange, written out by hand
PROMPT = [
    {"role": "system", "content": "your persona: I like cats."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "how are you?"},
]
#: the same exchange as the dialogue recipe's MuDoConv ``texts``
TEXTS = "your persona: I like cats. </s>  <s> hi </s> <s> hello </s> <s> how are you?"


def exchange(**fields) -> dict:
    row = dict(
        session_id="s1",
        mode="persona",
        context=PERSONA,
        history=["hi", "hello"],
        message="how are you?",
        settings={"num_beams": 1, "do_sample": False},
        model="runs/demo",
    )
    return {**row, **fields}


def vote(winner: str, turn: int = 1, a: str = "Fine, thanks.", b: str = "I am a cat.") -> dict:
    fields = dict(battle_id="b1", turn=turn, model_a="base", model_b="tuned", winner=winner, reply_a=a, reply_b=b)
    history = {"model_a": [], "model_b": []} if turn == 1 else {"model_a": ["hi", "A"], "model_b": ["hi", "B"]}
    row = exchange(mode="none", context="", history=history, message="hey", **fields)
    del row["model"]  # a vote names its two models; each side has its own history (chat_e.web.arena)
    return row


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.fixture
def store(tmp_path):
    store = FeedbackStore(f"sqlite:///{tmp_path}/run/feedback.db")
    yield store
    store.close()


def test_schema_is_versioned_and_equals_the_declared_tables(store):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection)
        assert context.get_current_revision() == "0002"
        assert compare_metadata(context, Base.metadata) == []


def test_a_database_of_the_first_schema_is_upgraded_in_place_keeping_its_rows(tmp_path):
    from chat_e.feedback.migrations import upgrade
    from chat_e.feedback.store import Feedback, make_engine, utcnow

    url = f"sqlite:///{tmp_path}/old.db"
    engine = make_engine(url)
    upgrade(engine, "0001")  # what a Chat-E before the training runs wrote
    sent = exchange(kind="rating", reply_id="r1", reply="Fine.", rating=1)
    with engine.begin() as connection:
        assert "chat_e_runs" not in inspect(connection).get_table_names()
        connection.execute(Feedback.__table__.insert().values(created_at=utcnow(), **sent))
    engine.dispose()
    store = FeedbackStore(url)  # a newer Chat-E opens it
    try:
        (kept,) = store.feedback()
        assert {k: kept[k] for k in sent} == sent
        run_id = store.add_run(method="dpo", settings={}, rows=1, rows_sha256="0" * 64, output_dir="o", log_path="l")
        assert store.run(run_id)["status"] == "queued"
    finally:
        store.close()


def test_sqlite_runs_in_wal_mode_with_synchronous_commits(store, tmp_path):
    with sqlite3.connect(tmp_path / "run" / "feedback.db") as plain:  # WAL is a property of the file
        assert plain.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    with store.engine.connect() as connection:  # FULL (2) is set on every connection of the store's
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 2


def test_rows_round_trip_and_reopening_keeps_them(store, tmp_path):
    sent = exchange(kind="rating", reply_id="r1", reply="Fine.", rating=1)
    row_id = store.add_feedback(**sent)
    store.add_vote(**vote("model_a"))
    again = FeedbackStore(store.url)  # a restarted server: the migration is a no-op, the rows are there
    try:
        (stored,) = again.feedback()
        assert stored["id"] == row_id
        assert {k: stored[k] for k in sent} == sent
        assert again.votes()[0]["winner"] == "model_a"
        assert again.counts() == {"rating": 1, "edit": 0, "choice": 0, "vote": 1}
    finally:
        again.close()


def test_unknown_kinds_and_winners_are_refused(store):
    with pytest.raises(ValueError, match="kind='flag'"):
        store.add_feedback(**exchange(kind="flag", reply_id="r", reply="x"))
    with pytest.raises(ValueError, match="winner='left'"):
        store.add_vote(**vote("left"))
    assert store.counts() == {"rating": 0, "edit": 0, "choice": 0, "vote": 0}


def test_purge_deletes_only_older_rows(store):
    old = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=100)
    store.add_feedback(**exchange(kind="rating", reply_id="old", reply="x", rating=1, created_at=old))
    store.add_feedback(**exchange(kind="rating", reply_id="new", reply="y", rating=1))
    assert store.purge(datetime.timedelta(days=90)) == 1
    assert [r["reply_id"] for r in store.feedback()] == ["new"]


# ---- export rules ---------------------------------------------------------------------------------------------

FEEDBACK = [
    # r1: liked, then disliked: the newest rating counts
    exchange(kind="rating", reply_id="r1", reply="Bad reply.", rating=1),
    exchange(kind="rating", reply_id="r1", reply="Bad reply.", rating=-1),
    # r2: liked, in another session
    exchange(kind="rating", reply_id="r2", reply="Good reply.", rating=1, session_id="s2"),
    # r3: liked, then taken back
    exchange(kind="rating", reply_id="r3", reply="Some reply.", rating=1),
    exchange(kind="rating", reply_id="r3", reply="Some reply.", rating=0),
    # r4: an empty reply, liked
    exchange(kind="rating", reply_id="r4", reply="", rating=1),
    # corrections: one real, one that changes nothing
    exchange(kind="edit", reply_id="r1", reply="Bad reply.", edited="I am well, and you?"),
    exchange(kind="edit", reply_id="r2", reply="Good reply.", edited="Good  reply."),
    # the previous reply preferred over its regeneration r6
    exchange(kind="choice", reply_id="r5", reply="First try.", other_reply_id="r6", other_reply="Second try."),
    # the same choice again (a duplicate row)
    exchange(kind="choice", reply_id="r5", reply="First try.", other_reply_id="r6", other_reply="Second try."),
]
VOTES = [vote("model_b"), vote("tie"), vote("bothbad"), vote("model_a", turn=2)]
VOTE_PROMPT = [{"role": "user", "content": "hey"}]


def test_dpo_rows_follow_the_rules():
    examples = Examples(FEEDBACK, VOTES)
    # each row names its chat session, which the training's hold-out keeps whole
    s1 = {"session_id": "s1"}
    assert examples.rows("dpo") == [
        {"prompt": PROMPT, "chosen": assistant("I am well, and you?"), "rejected": assistant("Bad reply."), **s1},
        {"prompt": PROMPT, "chosen": assistant("First try."), "rejected": assistant("Second try."), **s1},
        {"prompt": VOTE_PROMPT, "chosen": assistant("I am a cat."), "rejected": assistant("Fine, thanks."), **s1},
    ]
    assert examples.dropped == {
        "rating taken back": 1,
        "empty reply": 1,
        "correction equal to the reply": 1,
        "arena tie": 1,
        "arena vote after the first turn": 1,
        "duplicate": 1,
    }


def test_kto_rows_are_the_ratings_and_the_pairs_unpaired():
    rows = Examples(FEEDBACK, VOTES).rows("kto")
    labelled = [(r["completion"][0]["content"], r["label"]) for r in rows]
    assert labelled == [
        ("Bad reply.", False),  # r1's newest rating
        ("Good reply.", True),
        ("I am well, and you?", True),  # the pairs' chosen replies
        ("First try.", True),
        ("I am a cat.", True),
        # the pairs' rejected ones: "Bad reply." again is the rating's row (a duplicate), "First try." twice too
        ("Second try.", False),
        ("Fine, thanks.", False),
        ("I am a cat.", False),  # both bad: "Fine, thanks." is already there
    ]
    assert all(r["prompt"] in (PROMPT, VOTE_PROMPT) for r in rows)
    assert [r["session_id"] for r in rows] == ["s1", "s2", *["s1"] * 6]


def test_sft_rows_never_take_a_disliked_or_losing_reply():
    rows = Examples(FEEDBACK, VOTES).rows("sft")
    assert rows == [
        {"texts": TEXTS, "labels": "I am well, and you?"},
        {"texts": TEXTS, "labels": "First try."},
        {"texts": TEXTS, "labels": "Good reply."},
        {"texts": "hey", "labels": "I am a cat."},
    ]


def test_exported_rows_pass_the_recipes_own_row_checks(tmp_path, store, capsys):
    from chat_e.__main__ import main
    from chat_e.data.corpora import clean_rows
    from chat_e.training.preference import clean_preference_rows, read_jsonl

    for row in FEEDBACK:
        store.add_feedback(**row)
    for row in VOTES:
        store.add_vote(**row)
    for fmt, n in (("dpo", 3), ("kto", 8), ("sft", 4)):
        out = tmp_path / f"{fmt}.jsonl"
        assert main(["feedback", "export", "--format", fmt, "--out", str(out), "--feedback_db", store.url]) == 0
        rows, unparsable = read_jsonl(str(out))
        assert (len(rows), unparsable) == (n, 0)
        if fmt == "sft":
            assert len(clean_rows(rows, "texts", "labels", "train")) == n
        else:
            assert clean_preference_rows(rows, fmt, str(out)) == rows
        assert json.loads(out.read_text().splitlines()[0])  # JSON Lines
        if fmt == "dpo":  # what made no row, and why, in one line
            assert capsys.readouterr().out.strip() == (
                f"Wrote 3 dpo rows to {out}; no row from: 1 arena both bad (KTO only), 1 arena tie, 1 arena vote "
                "after the first turn, 1 correction equal to the reply, 1 duplicate, 1 empty reply, 2 rating (no pair), "
                "1 rating taken back."
            )
