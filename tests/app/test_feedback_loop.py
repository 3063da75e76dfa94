"""The feedback loop end to end, as a team would run Chat-E for many users: Chat-E servers in front of one model
server (``--backend``, the model served by another Chat-E's OpenAI API), all storing to one real PostgreSQL database
(tests/app/postgres.py).

* Four servers started at once on the fresh database all come up (the schema is migrated once, under a lock: twenty
  upgrades at once, tests/app/test_feedback_databases.py) and each answers a chat.
* Two of them stay as replicas; 20 concurrent gradio_client sessions (half on each) chat, rate, correct and
  regenerate. One replica is killed with SIGKILL in the middle of the load and restarted on the same database; its
  clients carry on there, the other replica's clients never notice. Then every piece of feedback a client got an
  answer for is in the database, once, with the exchange as the client saw it (message, history, mode, context, the
  reply shown, the model and its settings, the session); nothing is there that no client sent.
* ``chat-e feedback export`` writes rows the preference training takes whole (training on exported rows, 2 ranks
  under torchrun, from the Train page: tests/app/test_training_runs.py).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from chat_e.data.dialogue import normalize_mode
from chat_e.feedback.store import FeedbackStore
from chat_e.web.ui import NEW_REPLY, PREVIOUS_REPLY, from_display

from .support import TEST_SETTINGS, UI_SETTINGS, ChatEServer, gradio_client, make_sensitive_model, stop_all

CLIENTS = 20
ROUNDS = 2
#: servers started at once on the fresh database; the first REPLICAS of them stay for the load (client i on i % 2)
SERVERS, REPLICAS = 4, 2
#: the replica killed (and restarted) once KILL_AFTER pieces of feedback are acknowledged
KILLED, KILL_AFTER = 0, 45
#: the model's name, as the servers in front of the model server call it (and the feedback rows name it)
SERVED_NAME = "tiny-chat"
#: (mode, context) per client, round robin
CONTEXTS = [
    ("persona", "I love hiking with my dog."),
    ("emotion", "sad"),
    ("domain", "cooking"),
    ("topic", "summer holidays"),
    ("free", ""),
]
SAMPLED = (1, True, 1.0, 1.0, TEST_SETTINGS["max_new_tokens"], TEST_SETTINGS["min_new_tokens"])


def plain(text: str) -> str:
    """A turn as Chat-E stores it (whitespace collapsed: docs/chat-e.md)."""
    return " ".join(text.split())


class Load:
    """The clients' record of what they sent: every attempt, and those the server answered."""

    def __init__(self):
        self.lock = threading.Lock()
        self.attempted: list[dict] = []
        self.acked: list[dict] = []
        self.failures: list[str] = []
        self.urls: list[str] = []  # each replica's
        self.restarted = threading.Event()

    def send(self, client, event: dict, *args, api_name: str):
        with self.lock:
            self.attempted.append(event)
        result = client.predict(*args, api_name=api_name)
        with self.lock:
            self.acked.append(event)
        return result


def client_loop(i: int, load: Load, model: str) -> None:

    mode, context = CONTEXTS[i % len(CONTEXTS)]
    replica = i % REPLICAS
    rnd, chat, history, client, url = 0, [], [], None, None
    while rnd < ROUNDS:
        try:
            if client is None:  # connecting can meet the kill too (a thread may start late on a busy machine)
                url = load.urls[replica]
                client = gradio_client(url)
            message = f"client {i} round {rnd}: what do you think?"
            _, chat, *_ = client.predict(message, chat, api_name="/add_message")
            chat = client.predict(chat, mode, context, *UI_SETTINGS, api_name="/respond")
            exchange = dict(
                do_sample=False,
                session_id=client.session_hash,
                model=model,
                mode=normalize_mode(mode),
                context=context,
                history=list(history),
                message=message,
                reply=from_display(chat[-1]["content"]),
            )
            rating = "like" if (i + rnd) % 2 else "dislike"
            event = dict(kind="rating", rating=1 if rating == "like" else -1, **exchange)
            load.send(client, event, len(chat) - 1, rating, api_name="/rate")
            edited = f"a correction from client {i} in round {rnd}"
            load.send(client, dict(kind="edit", edited=edited, **exchange), edited, api_name="/correct")
            again = client.predict(chat[:-1], mode, context, *SAMPLED, api_name="/respond")  # regenerate
            new = dict(exchange, reply=from_display(again[-1]["content"]), do_sample=True)
            if new["reply"] != exchange["reply"]:  # the choice is offered between different replies only
                which = NEW_REPLY if rnd % 2 else PREVIOUS_REPLY
                chosen, other = (new, exchange) if which == NEW_REPLY else (exchange, new)
                event = dict(kind="choice", other_reply=other["reply"], **chosen)
                load.send(client, event, which, api_name="/prefer")
            chat = again
            history += [plain(message), plain(new["reply"])]
            rnd += 1
        except Exception as err:  # the replica was killed: wait for its restart, start a new session there
            if replica != KILLED or (load.restarted.is_set() and url == load.urls[replica]):  # no excuse
                with load.lock:
                    load.failures.append(f"client {i}: {type(err).__name__}: {err}")
                return
            load.restarted.wait(timeout=300)
            client, chat, history = None, [], []
    client.close()


def chat_once(server: ChatEServer) -> str:
    """One reply through the server's OpenAI API (the server asks the model server for it)."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello, who is there?"}]}
    answer = httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=120).raise_for_status().json()
    return answer["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def loop(tiny_chat_model_dir, postgres, tmp_path_factory):
    """The servers, the load, the kill and the restart: (load record, database URL, model dir, killed at, logs)."""
    tmp = tmp_path_factory.mktemp("feedback_loop")
    model = make_sensitive_model(tiny_chat_model_dir, tmp / "model", std=0.5)
    url = postgres.fresh_database("feedback_loop")
    backend = ChatEServer(model, tmp / "model-server.log", "--no_feedback", "--concurrency", "2")
    front = ("--backend", f"{backend.url}v1", "--max_new_tokens", str(TEST_SETTINGS["max_new_tokens"]))
    servers = [ChatEServer(SERVED_NAME, tmp / f"server-{n}.log", *front, feedback_db=url) for n in range(SERVERS)]
    restarted = None
    try:
        for server in (backend, *servers):
            server.wait_ready()
        replies = [chat_once(server) for server in servers]  # every one serves
        assert all(reply.strip() for reply in replies), replies
        stop_all(servers[REPLICAS:])
        replicas = servers[:REPLICAS]
        load = Load()
        load.urls = [server.url for server in replicas]
        threads = [threading.Thread(target=client_loop, args=(i, load, SERVED_NAME)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while len(load.acked) < KILL_AFTER and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = replicas[KILLED]
        killed.proc.kill()  # SIGKILL: no shutdown handler runs
        killed.proc.wait()
        killed_with = (len(load.attempted), len(load.acked))
        restarted = ChatEServer(SERVED_NAME, tmp / "restarted.log", *front, feedback_db=url).wait_ready()
        load.urls[KILLED] = restarted.url
        load.restarted.set()
        for t in threads:
            t.join(timeout=600)
    finally:
        stop_all([backend, *servers, *([restarted] if restarted else [])])
    return load, url, model, killed_with, [server.log() for server in (*servers, restarted)]


def stored(url: str) -> list[dict]:
    store = FeedbackStore(url)
    try:
        return store.feedback()
    finally:
        store.close()


FIELDS = ("kind", "session_id", "model", "mode", "context", "history", "message", "reply", "rating", "edited")


def key(row: dict) -> str:
    """A stored row or a sent event by its content (a stored row's settings say whether its reply was sampled)."""
    fields = {k: row.get(k) for k in (*FIELDS, "other_reply")}
    fields["do_sample"] = row["settings"]["do_sample"] if "settings" in row else row["do_sample"]
    return json.dumps(fields, sort_keys=True)


def test_the_database_holds_exactly_the_feedback_sent_across_a_sigkill(loop):
    load, url, _, (attempted_at_kill, acked_at_kill), logs = loop
    assert not load.failures, load.failures
    assert 0 < acked_at_kill < CLIENTS * ROUNDS * 3, "the kill came in the middle of the load"
    rows = stored(url)
    keys = [key(r) for r in rows]
    acked, attempted = [key(e) for e in load.acked], {key(e) for e in load.attempted}
    assert len(set(keys)) == len(keys), "a piece of feedback was stored twice"
    assert set(acked) <= set(keys), "feedback the server acknowledged is missing"
    assert set(keys) <= attempted, "the database holds feedback no client sent"
    # what was sent but not acknowledged: only what was in flight when the server died
    assert len(keys) - len(acked) <= attempted_at_kill - acked_at_kill <= CLIENTS
    # every client finished its rounds (the killed replica's started over on the restarted one): a rating and a
    # correction each round, and a choice where the regenerated reply differed
    assert len(load.acked) >= CLIENTS * ROUNDS * 2
    assert all("feedback: stored in postgresql" in log for log in logs)
    # stopped with their clients' sessions open (gradio_client leaves its heartbeat stream open after close()):
    # the heartbeats ended at once, nothing was left for the grace period to cancel
    assert not [log for log in logs if "graceful shutdown exceeded" in log or "Traceback" in log]
    assert {row["model"] for row in rows} == {SERVED_NAME}
    assert all(row["settings"]["max_new_tokens"] == TEST_SETTINGS["max_new_tokens"] for row in rows)


def test_exported_rows_are_what_the_preference_training_takes(loop, tmp_path):
    """The PostgreSQL database's export is a DPO file the preference training takes whole. (Training on exported
    rows, through the Train page and ``chat-e train``'s launch command: tests/app/test_training_runs.py.)"""
    from chat_e.__main__ import main
    from chat_e.training.preference import clean_preference_rows, read_jsonl

    _, url, _, _, _ = loop
    rows_file = tmp_path / "dpo.jsonl"
    assert main(["feedback", "export", "--format", "dpo", "--out", str(rows_file), "--feedback_db", url]) == 0
    rows, bad = read_jsonl(str(rows_file))
    assert bad == 0 and len(rows) >= CLIENTS * ROUNDS  # a correction per round, and most choices
    assert clean_preference_rows(rows, "dpo", str(rows_file)) == rows  # the training takes every row


def test_the_feedback_controls_come_with_a_store_only(tiny_chat_model_dir, tmp_path):
    """``--no_feedback`` builds the UI without a store: no thumbs, no correction box, no feedback endpoints."""
    from chat_e.engines.local import LocalEngine
    from chat_e.web.ui import build_app

    engine = LocalEngine.from_pretrained(tiny_chat_model_dir)
    store = FeedbackStore(f"sqlite:///{tmp_path}/feedback.db")
    try:
        for demo, offered in ((build_app(engine, store=store), True), (build_app(engine), False)):
            endpoints = {fn.api_name for fn in demo.fns.values()}
            assert ({"rate", "correct", "prefer"} <= endpoints) is offered
            ids = {getattr(block, "elem_id", None): block for block in demo.blocks.values()}
            assert ("correction" in ids) is offered
            assert bool(ids["chatbot"].feedback_options) is offered
    finally:
        store.close()
