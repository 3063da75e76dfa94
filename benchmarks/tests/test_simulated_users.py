"""The loop benchmark's instruments (benchmarks/simulated_users.py, benchmarks/bench_loop.py): the scripted users'
preference and corrections, and their feedback landing in the database through a real Chat-E server."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest

from benchmarks.bench_api import Server
from benchmarks.simulated_users import (
    FEEDBACK_MESSAGES,
    HELD_OUT_MESSAGES,
    HOBBY,
    NAME,
    Message,
    User,
    give_feedback,
    population,
    satisfies,
)
from chat_e.feedback.store import FeedbackStore
from tests.app.support import make_sensitive_model

AVA = User(0, "Ava", "hiking")


@pytest.mark.parametrize("message, reply, met", [
    (Message("What's your name?", NAME), "I'm Ava. And you?", True),
    (Message("What's your name?", NAME), "I'm Bob. And you?", False),  # the wrong name
    (Message("What's your name?", NAME), "I'm Ava.", False),  # no question
    (Message("What do you do for fun?", HOBBY), "I go hiking a lot. You?", True),
    (Message("What do you do for fun?", HOBBY), "I read books. You?", False),
    (Message("How was your day?"), "Fine. " + "Very " * 20 + "good. And yours?", False),  # too long
    (Message("How was your day?"), "Fine, and yours?", True),
    (Message("How was your day?"), "", False),
])  # fmt: skip
def test_the_preference_is_checked_by_rule(message, reply, met):
    assert satisfies(AVA, message, reply) is met


def test_every_correction_meets_its_users_preference_and_the_vote_messages_are_never_feedback_messages():
    rng = random.Random(0)
    users = population(30, seed=1)
    assert len({u.name for u in users[:24]}) == 24 and population(30, seed=1) == users
    for user in users:
        for message in FEEDBACK_MESSAGES:
            assert satisfies(user, message, user.correction(message, rng))
    assert not {m.text for m in FEEDBACK_MESSAGES} & {m.text for m in HELD_OUT_MESSAGES}


@pytest.mark.slow
def test_simulated_feedback_lands_in_the_database_as_each_user_saw_it(tiny_chat_model_dir):
    """What the scripted users send through a real server is stored once each, in order. (A Train-page run on such
    rows and its held-out before/after: tests/app/test_training_runs.py, which bench_loop's run is.)"""
    users = population(4, seed=0)
    with tempfile.TemporaryDirectory(prefix="sim-users-") as tmp:
        tmp = Path(tmp)
        # larger weights than a random init's: replies that differ with the message, and are not empty
        model = make_sensitive_model(tiny_chat_model_dir, tmp / "model", std=0.5)
        server = Server(model, tmp / "chat-e.log", new_tokens=None)
        store = FeedbackStore(f"sqlite:///{(tmp / 'chat-e.log').with_suffix('.feedback.db')}")
        try:
            server.wait_ready()
            sent = give_feedback(server.url, users, messages_per_user=2, seed=0)
            stored = store.feedback()
            # what every user sent, in order, is in the database once, with the exchange as that user saw it
            assert [(r["kind"], r["session_id"], r["message"], r["reply"]) for r in stored] == [
                (s["kind"], s["session_id"], s["message"], s["reply"]) for s in sent
            ]
            assert [r["edited"] for r in stored if r["kind"] == "edit"] == [s["edited"] for s in sent
                                                                            if s["kind"] == "edit"]  # fmt: skip
            assert len({r["session_id"] for r in stored}) == len(users)
            assert {r["mode"] for r in stored} == {"persona"}
            assert {r["context"] for r in stored} == {u.persona for u in users}
        finally:
            server.stop()
            store.close()
