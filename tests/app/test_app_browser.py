"""Chat-E in a real browser: Debian's headless Chromium (``make browser``) driven by playwright, no browser download."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from chat_e.data.samples import EXAMPLES
from chat_e.feedback.store import FeedbackStore
from chat_e.web.ui import APOLOGY

from .browser import BOT, USER, keep_screenshot, needs_chromium, texts, wait_for_bot, wait_for_reply
from .support import ChatEServer, served_engine, serving

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serving(ChatEServer(tiny_model_dir, tmp_path_factory.mktemp("chat-e-browser") / "server.log")) as (srv,):
        yield srv


@pytest.fixture(scope="module")
def expected_reply(tiny_model_dir):
    with served_engine(tiny_model_dir) as chat:
        yield lambda message, mode, context: " ".join(chat(message, [], mode, context).split())


def test_pick_a_persona_chat_and_see_replies(server, page, expected_reply, tmp_path, tiny_model_dir):
    page.goto(server.url)
    page.wait_for_selector("#chatbot")
    assert page.title() == "Chat-E"
    assert str(tiny_model_dir) in page.locator("#model-line").inner_text()

    # pick a persona: switching modes fills the context box with that mode's example
    page.get_by_test_id("emotion-radio-label").click()
    page.wait_for_function("document.querySelector('#context textarea').value === 'happy'")
    page.get_by_test_id("persona-radio-label").click()
    page.wait_for_function(
        "want => document.querySelector('#context textarea').value === want", arg=EXAMPLES["persona"]
    )

    message = "Hi! Who are you?"
    reply = expected_reply(message, "persona", EXAMPLES["persona"])
    assert reply and reply != APOLOGY
    page.locator("#message textarea").fill(message)
    page.locator("#send").click()
    wait_for_bot(page, 1, reply)
    assert texts(page, USER) == [message]
    shot = tmp_path / "chat-e.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000

    # markup typed by the user is shown as text and never runs
    markup = '<b>bold</b><img src=x onerror="window.__chat_e_pwned=1"><script>window.__chat_e_pwned=2</script>'
    page.locator("#message textarea").fill(markup)
    page.locator("#message textarea").press("Enter")
    wait_for_bot(page, 2, expected_reply(markup, "persona", EXAMPLES["persona"]))
    assert texts(page, USER) == [message, markup]
    assert page.evaluate("window.__chat_e_pwned") is None
    assert page.locator("#chatbot b, #chatbot img[src='x'], #chatbot script").count() == 0

    # undo puts the last message back in the box; regenerate answers the last message again (sampled: the greedy
    # settings would give the same reply, tests/app/test_app_engine.py); clear empties the chat
    page.locator("#undo").click()
    page.wait_for_function("sel => document.querySelectorAll(sel).length === 1", arg=BOT)
    assert page.locator("#message textarea").input_value() == markup
    generated = server.generations()
    page.locator("#regenerate").click()
    deadline = time.monotonic() + 120
    while server.generations() == generated and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.generations() == generated + 1
    page.wait_for_function(
        "sel => { const bots = document.querySelectorAll(sel); return bots.length === 1 && bots[0].innerText.trim() }",
        arg=BOT,
        timeout=120_000,
    )
    assert texts(page, USER) == [message]
    page.locator("#clear").click()
    page.wait_for_function("sel => document.querySelectorAll(sel).length === 0", arg=USER)


# ---- feedback, clicked in the browser (the arena: tests/app/test_training_runs.py, the operator's loop) ------------------------------------------------------------


def stored(url: str, what: str, count: int, timeout: float = 60) -> list[dict]:
    """The database's ``what`` rows (feedback or votes) once there are ``count`` of them."""
    store = FeedbackStore(url)
    try:
        deadline = time.monotonic() + timeout
        while len(rows := getattr(store, what)()) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        return rows
    finally:
        store.close()


@pytest.fixture(scope="module")
def rated(server, expected_reply, tmp_path_factory):
    """The server the thumb is clicked on and its reply oracle: the tiny BlenderBot's, or ``CHAT_E_TEST_MODEL``
    served with its own generation defaults (a real model, for README's screenshot:
    ``CHAT_E_TEST_MODEL=runs/demo CHAT_E_SCREENSHOTS=docs``)."""
    chosen = os.environ.get("CHAT_E_TEST_MODEL")
    if not chosen:
        yield server, expected_reply
        return
    log = tmp_path_factory.mktemp("chat-e-rated") / "server.log"
    with serving(ChatEServer(Path(chosen), log, model_defaults=True)) as (srv,), served_engine(chosen, True) as chat:
        yield srv, lambda message, mode, context: " ".join(chat(message, [], mode, context).split())


def test_a_thumb_clicked_on_a_reply_is_stored_with_its_exchange(rated, page, tmp_path):
    server, expected_reply = rated
    page.goto(server.url)
    page.wait_for_selector("#chatbot")
    before = len(stored(server.feedback_db, "feedback", 0))
    message = "Do you like dogs?"
    reply = expected_reply(message, "persona", EXAMPLES["persona"])
    page.locator("#message textarea").fill(message)
    page.locator("#send").click()
    wait_for_bot(page, 1, reply)
    page.locator(BOT).first.hover()
    page.locator("#chatbot").get_by_label("Like", exact=True).first.click()
    rows = stored(server.feedback_db, "feedback", before + 1)
    assert len(rows) == before + 1
    row = rows[-1]
    assert (row["kind"], row["rating"], row["message"], row["mode"]) == ("rating", 1, message, "persona")
    assert (row["context"], row["history"]) == (EXAMPLES["persona"], [])
    assert " ".join(row["reply"].split()) == reply
    # the user sees it stored, and the thumb stays shown on that reply after the next turn (the window would forget it)
    page.wait_for_selector(".toast-body:has-text('your thumbs-up is saved')", timeout=30_000)
    page.locator("#message textarea").fill("And cats?")
    page.locator("#send").click()
    wait_for_reply(page, 2)
    page.locator(BOT).first.hover()
    page.wait_for_function("() => document.querySelectorAll(\"#chatbot [aria-label='Liked']\").length === 1")
    assert page.locator("#chatbot").get_by_label("Like", exact=True).count() == 1  # the new reply: not rated
    # one set of controls: Chat-E's Regenerate and Undo buttons, not Gradio's icons beside them
    assert not page.locator("#chatbot [aria-label='Retry'], #chatbot [aria-label='Undo']").count()
    shot = tmp_path / "feedback.png"
    page.screenshot(path=str(shot), full_page=True)
    keep_screenshot(shot, "chat-e-feedback.png")
    # a message over the limit is refused with the reason in a toast and stays in the box to be shortened; the chat
    # stays as it was (not covered by an "Error" mark)
    page.locator("#message textarea").fill("x" * 5000)
    page.locator("#send").click()
    page.wait_for_selector(".toast-body:has-text('Shorten it and send again')", timeout=30_000)
    assert page.locator("#message textarea").input_value() == "x" * 5000
    assert len(stored(server.feedback_db, "feedback", before + 1)) == before + 1 and page.locator(BOT).count() == 2
    assert page.locator("#chatbot").get_by_text("Error", exact=True).count() == 0
