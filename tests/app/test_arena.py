"""Chat-E's blind arena (chat_e.web.arena) served in this process and driven by gradio_client: votes recorded once each
with what training on them needs, the reveal, refusals, the leaderboard against choix, and the pairing's balance."""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import re
import threading
from collections import Counter
from dataclasses import asdict

import pytest
from gradio_client.exceptions import AppError
from scipy import stats

from chat_e.data.dialogue import normalize_mode
from chat_e.data.limits import ChatLimits
from chat_e.data.messages import message_text, plain_turn
from chat_e.engines.local import LocalEngine
from chat_e.feedback.leaderboard import BT_ALPHA
from chat_e.feedback.store import FeedbackStore
from chat_e.web.arena import VOTE_KEYS, Arena, build_arena, draw_pair
from chat_e.web.ui import APOLOGY, from_display

from ..conftest import free_port
from .support import TEST_SETTINGS, gradio_client, make_sensitive_model, request

REVEAL = re.compile(r"\*\*Model A\*\* was `(?P<a>[^`]+)`, \*\*Model B\*\* was `(?P<b>[^`]+)`")


@pytest.fixture(scope="module")
def engines(tiny_chat_model_dir, tmp_path_factory):
    """Three distinct tiny chat models (weights redrawn from seeds 1-3, so that their replies differ and depend on
    the input), by name."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("arena-models")
    found = {}
    for k in (1, 2, 3):
        path = make_sensitive_model(tiny_chat_model_dir, root / f"m{k}", seed=k)
        found[f"m{k}"] = LocalEngine.from_pretrained(path)
    yield found
    torch.set_num_threads(threads)


def settings_of(engine):
    return engine.default_settings().replace(**TEST_SETTINGS)


class Votes:
    """The arena's votes in a real feedback store (SQLite in ``tmp_path``); ``list(votes)`` reads them back."""

    def __init__(self, tmp_path):
        self.store = FeedbackStore(f"sqlite:///{tmp_path}/feedback.db")

    def record(self, vote):
        self.store.add_vote(**vote)

    def __iter__(self):
        return iter(self.store.votes())

    def __len__(self):
        return len(self.store.votes())


@contextlib.contextmanager
def arena_server(engines, tmp_path, seed=0, votes=None):
    """``build_arena`` on ``engines`` launched here, its votes in a feedback store: yields ``(url, votes)``."""
    votes = votes or Votes(tmp_path)
    settings = settings_of(next(iter(engines.values())))
    demo = build_arena(
        engines,
        record_vote=votes.record,
        load_votes=votes.store.votes,
        settings=settings,
        seed=seed,
        plot_dir=tmp_path,
    )
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", votes
    finally:
        demo.close()
        votes.store.close()


def client(url):
    return gradio_client(url)


def texts(chat):
    """A chat window's messages as ``(role, typed text)``."""
    return [(m["role"], from_display(message_text(m["content"]))) for m in chat]


def reference_reply(engine, message, history, mode, context):
    """What the engine says to these plain turns with the arena's settings (as the arena shows it)."""
    return engine.reply(request(engine, message, history, mode, context, settings_of(engine))).text or "…"


def play(url, script, results, errors):
    """One scripted client: for each battle, its exchanges ``(message, mode, context)`` then its vote; records what
    it saw (session, replies per exchange, reveal) and what each refusal said."""
    try:
        c = client(url)
        with pytest.raises(AppError, match="nothing to vote on"):
            c.predict("tie", api_name="/vote")  # before any message
        for exchanges, winner in script:
            c.predict(api_name="/new_battle")
            seen = []
            for message, mode, context in exchanges:
                box, chat_a, chat_b = c.predict(message, mode, context, api_name="/battle")
                assert box == ""
                seen.append((message, mode, context, texts(chat_a)[-1][1], texts(chat_b)[-1][1]))
            reveal = c.predict(winner, api_name="/vote")
            with pytest.raises(AppError, match="voted on already"):
                c.predict("model_b", api_name="/vote")
            with pytest.raises(AppError, match="This battle is over"):
                c.predict("more?", "free", "", api_name="/battle")
            match = REVEAL.search(reveal)
            results.append(dict(session=c.session_hash, seen=seen, winner=winner, a=match["a"], b=match["b"]))
        c.close()
    except BaseException as err:  # reported by the test's thread
        errors.append(err)


SCRIPTS = [
    [
        ([("Hi! What's your name?", "persona", "I love cats and jazz.")], "model_a"),
        ([("Any plans?", "domain", "vacation ideas"), ("Somewhere warm", "domain", "vacation ideas")], "tie"),
    ],
    [([("Hello there", "free", "")], "model_b"), ([("Guess what", "topic", "music")], "bothbad")],
    [([("How are you?", "emotion", "joyful"), ("Really?", "emotion", "joyful")], "model_b")],
]


def test_two_models_votes_are_recorded_once_with_what_training_needs(engines, tmp_path):
    pair = {name: engines[name] for name in ("m1", "m2")}
    with arena_server(pair, tmp_path) as (url, votes):
        results, errors = [], []
        threads = [threading.Thread(target=play, args=(url, script, results, errors)) for script in SCRIPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        # every vote recorded exactly once, the refused ones never
        assert len(votes) == len(results) == sum(len(s) for s in SCRIPTS)
        assert len({v["battle_id"] for v in votes}) == len(votes)
        by_battle = {}
        for v in votes:
            assert set(v) == {"id", *VOTE_KEYS}  # the store keeps every key the arena records
            by_battle[(v["session_id"], v["message"], v["turn"])] = v
        for r in results:
            message, mode, context, shown_a, shown_b = r["seen"][-1]
            v = by_battle[(r["session"], message, len(r["seen"]))]
            assert (v["model_a"], v["model_b"]) == (r["a"], r["b"])  # the names revealed are the names recorded
            assert {v["model_a"], v["model_b"]} == {"m1", "m2"}
            assert v["winner"] == r["winner"] and (v["mode"], v["context"]) == (normalize_mode(mode), context)
            assert (v["reply_a"] or "…", v["reply_b"] or "…") == (shown_a, shown_b)  # an empty reply shows as "…"
            assert v["settings"] == {side: asdict(settings_of(engines["m1"])) for side in ("model_a", "model_b")}
            assert v["created_at"].tzinfo is not None  # UTC
            # each side's history is its own conversation, and each reply is its (revealed) model's
            for side, shown in (("model_a", 3), ("model_b", 4)):
                history = [plain_turn(t) for exchange in r["seen"][:-1] for t in (exchange[0], exchange[shown])]
                assert v["history"][side] == history
                assert r["seen"][-1][shown] == reference_reply(engines[v[side]], message, history, mode, context)
        # the sides' replies differ (distinct models), so the check above tells the sides apart
        assert any(v["reply_a"] != v["reply_b"] for v in votes)

        c = client(url)
        with pytest.raises(AppError, match="A vote is one of"):
            c.predict("left", api_name="/vote")
        with pytest.raises(AppError, match="empty"):
            c.predict("   ", "free", "", api_name="/battle")
        with pytest.raises(AppError, match="characters long"):
            c.predict("x" * (ChatLimits().max_message_chars + 1), "free", "", api_name="/battle")
        assert len(votes) == len(results)

        table, text, image = c.predict(api_name="/leaderboard")
        wins = Counter(
            v["model_a"] if v["winner"] == "model_a" else v["model_b"]
            for v in votes
            if v["winner"] in ("model_a", "model_b")
        )
        rows = {row[0]: row for row in table["data"]}
        assert (rows["m1"][1], rows["m2"][1]) == (wins["m1"], wins["m2"])
        assert "decisive votes" in text and "To tell a 55% preference" in text
        with open(image, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        c.close()


def hand_encoded(votes, models):
    index = {m: i for i, m in enumerate(models)}
    data = []
    for v in votes:
        a, b = index[v["model_a"]], index[v["model_b"]]
        data += {"model_a": [(a, b)] * 2, "model_b": [(b, a)] * 2}.get(v["winner"], [(a, b), (b, a)])
    return data


def test_three_models_leaderboard_is_choixs(engines, tmp_path):
    import choix

    winners = itertools.cycle(["model_a", "model_a", "model_b", "tie", "model_a", "bothbad"])
    with arena_server(engines, tmp_path, seed=3) as (url, votes):
        clients = [client(url) for _ in range(3)]
        for i in range(12):
            c = clients[i % 3]
            c.predict(api_name="/new_battle")
            c.predict(f"Message number {i}", "free", "", api_name="/battle")
            c.predict(next(winners), api_name="/vote")
        assert len(votes) == 12 and len({v["session_id"] for v in votes}) == 3
        table, text, image = clients[0].predict(api_name="/leaderboard")
        for c in clients:
            c.close()
    assert table["headers"][:3] == ["rank", "model", "score"] and "Bradley-Terry" in text
    models = ["m1", "m2", "m3"]
    theta = choix.ilsr_pairwise(3, hand_encoded(votes, models), alpha=BT_ALPHA, max_iter=10_000)
    elo = 1000 + 400 / math.log(10) * (theta - theta.mean())
    shown = {row[1]: row[2] for row in table["data"]}
    assert shown == pytest.approx(dict(zip(models, elo)), abs=0.051)  # shown to 0.1 point
    assert [row[1] for row in table["data"]] == [models[i] for i in sorted(range(3), key=lambda i: -elo[i])]
    with open(image, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_failed_reply_shows_the_apology_and_cannot_be_voted_on(engines):
    class Broken(LocalEngine):
        def _pieces(self, request):
            raise RuntimeError("generation failed on purpose")
            yield  # a generator, like the real one

    ok = engines["m1"]
    broken = Broken(ok.model, ok.tokenizer, name="broken")
    recorded = []
    arena = Arena(
        {"ok": ok, "broken": broken}, record_vote=recorded.append, load_votes=list, settings=settings_of(ok), seed=0
    )
    *_, (box, chat_a, chat_b, battle) = arena.battle("Hello", "free", "", None)
    sides = {battle.model_a: texts(chat_a)[-1][1], battle.model_b: texts(chat_b)[-1][1]}
    assert sides["broken"] == APOLOGY and sides["ok"] != APOLOGY and "Traceback" not in sides["ok"]
    with pytest.raises(Exception, match="could not be generated"):
        arena.vote("model_a", battle)
    assert recorded == []


def test_pairs_are_drawn_uniformly_with_balanced_sides():
    rng = random.Random(0)
    names = ["m1", "m2", "m3"]
    draws = [draw_pair(names, rng) for _ in range(600)]
    assert all(a != b for a, b in draws)
    pairs = Counter(frozenset(d) for d in draws)
    assert len(pairs) == 3  # every pair is drawn
    assert stats.chisquare(list(pairs.values())).pvalue > 0.01  # ... about equally often
    lefts = Counter(a for a, _ in draws)
    for name in names:  # each model on the left about half of the battles it is in
        played = sum(name in d for d in draws)
        assert stats.binomtest(lefts[name], played, 0.5).pvalue > 0.01
    # two models: 200 battles, each on the left about half the time
    two = [draw_pair(["m1", "m2"], rng)[0] for _ in range(200)]
    assert stats.binomtest(two.count("m1"), 200, 0.5).pvalue > 0.01
    # seeded: the same seed draws the same battles
    first, again = random.Random(5), random.Random(5)
    assert [draw_pair(names, first) for _ in range(20)] == [draw_pair(names, again) for _ in range(20)]
    with pytest.raises(ValueError):
        draw_pair(["m1"], rng)


def test_the_leaderboard_says_when_the_votes_cannot_be_loaded(engines, tmp_path):
    import gradio as gr

    def load_votes():
        raise OSError("the store is down")

    arena = Arena(engines, record_vote=print, load_votes=load_votes, plot_dir=tmp_path)
    with pytest.raises(gr.Error, match="could not be loaded"):
        arena.leaderboard()
    # votes of a model no longer served still count
    retired = [{"model_a": "m1", "model_b": "old", "winner": "model_b"}]
    arena = Arena(engines, record_vote=print, load_votes=lambda: retired, plot_dir=tmp_path)
    table, _, png = arena.leaderboard()
    assert {row[1] for row in table["data"]} == {"m1", "m2", "m3", "old"} and png.endswith(".png")


def test_ten_thousand_votes_keep_the_arena_bounded(engines, tmp_path):
    """What the arena holds does not grow with its votes: the battle ids it remembers against a racing second vote
    (the newest VOTED_MEMORY), the win-matrix PNGs in its plot directory (the newest KEPT_PLOTS), and what the
    leaderboard reads from the store (three columns of each vote, not its texts)."""
    from sqlalchemy.orm import Session

    from chat_e.feedback.leaderboard import BT_HEADERS, KEPT_PLOTS
    from chat_e.feedback.store import Vote, utcnow
    from chat_e.web.arena import VOTED_MEMORY, Battle

    votes = Votes(tmp_path)
    arena = Arena(engines, record_vote=votes.record, load_votes=votes.store.vote_outcomes, plot_dir=tmp_path / "plots")
    names = list(engines)
    for i in range(25):  # voted through the arena, each followed by a leaderboard refresh (a new matrix each time)
        battle = Battle(f"b{i}", names[i % 3], names[(i + 1) % 3], turn=1, message="hi", reply_a="a", reply_b="b")
        arena.vote(("model_a", "model_b", "tie")[i % 3], battle)
        arena.leaderboard()
    assert len(list((tmp_path / "plots").glob("win-matrix-*.png"))) == KEPT_PLOTS
    # 10,000 votes in all: the rest stored in one transaction (the arena's path commits each, 25 are enough for it)
    rows = [dict(battle_id=f"x{i}", turn=1, model_a=names[i % 3], model_b=names[(i + 2) % 3], winner="model_b",
                 session_id="s", mode="none", context="", history={}, message="m", settings={}, reply_a="a",
                 reply_b="b", created_at=utcnow()) for i in range(10_000 - 25)]  # fmt: skip
    with Session(votes.store.engine) as session, session.begin():
        session.add_all(Vote(**row) for row in rows)
    outcomes = votes.store.vote_outcomes()
    assert len(outcomes) == 10_000 and all(len(o) == 3 for o in outcomes)
    table, _, png = arena.leaderboard()
    column = BT_HEADERS.index("votes")
    assert sum(row[column] for row in table["data"]) == 2 * 10_000 and png  # every vote counted, once per side
    arena.record_vote = lambda vote: None  # the store has its 10,000
    for i in range(VOTED_MEMORY + 100):  # the arena's memory of voted battles stays at its bound
        battle = Battle(f"m{i}", names[0], names[1], turn=1, message="hi", reply_a="a", reply_b="b")
        arena.vote("tie", battle)
    assert len(arena._voted) == VOTED_MEMORY
