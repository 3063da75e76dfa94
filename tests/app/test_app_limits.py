"""Chat-E's request rules as plain functions (no server): :func:`chat_e.data.limits.check_request`, the limits' own
checks, the exposure warning, and the UI handlers refusing before the engine is touched."""

from __future__ import annotations

import pytest

from chat_e.data.limits import ChatLimits, Refused, check_request
from chat_e.data.settings import GenerationSettings
from chat_e.http.guard import exposure_warning, is_loopback, parse_auth
from chat_e.web.ui import Handlers, from_display, to_display

LIMITS = ChatLimits(max_message_chars=10, max_context_chars=8, max_history_turns=4, max_history_chars=20)


def test_defaults_and_impossible_combinations():
    limits = ChatLimits()
    assert (limits.max_message_chars, limits.max_context_chars, limits.max_history_turns) == (2000, 4000, 50)
    assert limits.max_body_bytes >= limits.largest_request_bytes()  # a request within the limits fits the body
    with pytest.raises(ValueError, match=r"--max_history_turns must be at least 1 \(got 0\)"):
        ChatLimits(max_history_turns=0)
    with pytest.raises(ValueError, match="raise it, or lower --max_history_chars"):
        ChatLimits(max_body_bytes=limits.largest_request_bytes() - 1)


@pytest.mark.parametrize(
    "fields, refusal",
    [
        (dict(message=""), "The message is empty"),
        (dict(message=" \n\t"), "The message is empty"),
        (dict(message=None), "The message should be text (a string), not null."),
        (dict(message=b"hi"), "not bytes"),
        (dict(message="x" * 11), "The message is 11 characters long; Chat-E takes up to 10."),
        (dict(context="x" * 9), "The context is 9 characters long; Chat-E takes up to 8."),
        (dict(context=1.5), "The context should be text (a string), not a number."),
        (dict(mode=None), "The mode should be a string"),
        (dict(mode="x" * 10_000), "Unknown context mode"),
        (dict(history={"role": "user"}), "The history should be a list"),
        (dict(history=["a"] * 5), "The chat has 5 earlier messages; Chat-E takes up to 4."),
        (dict(history=[["a", "b"]] * 3), "The chat has 6 earlier messages"),
        (dict(history=["x" * 15, "y" * 6]), "over 20 characters together"),
        (dict(history=[["a", "b", "c"]]), "history[0] should be a [user, bot] pair, not a list of 3."),
        (dict(history=[{"role": "tool", "content": "x"}]), "history[0]['role'] should be 'user' or 'assistant'"),
        (dict(history=["ok", {"role": "user", "content": 3}]), "history[1] should hold text, not a number."),
        (dict(chat=["plain string"]), "chat[0] should be a {'role', 'content'} message, not 'plain string'."),
        (dict(settings={"num_beams": 11}, ranges={"num_beams": (1, 10)}), "from 1 to 10, not 11."),
        (dict(settings={"num_beams": 2.5}, ranges={"num_beams": (1, 10)}), "num_beams should be a whole number"),
        (dict(settings={"num_beams": True}, ranges={"num_beams": (1, 10)}), "not a boolean"),
        (dict(settings={"top_p": float("nan")}, ranges={"top_p": (0.05, 1.0)}), "top_p should be a number"),
        (dict(settings={"do_sample": 1}), "do_sample should be true or false, not a number."),
        (dict(settings={"beams": 3}), "'beams' is not a generation setting; they are num_beams, do_sample,"),
    ],
)
def test_each_field_is_refused_with_what_to_change(fields, refusal):
    with pytest.raises(Refused) as err:
        check_request(LIMITS, **fields)
    assert refusal in str(err.value)
    assert len(str(err.value)) < 300  # a refusal never echoes the (maybe huge) value


def test_what_passes_comes_back_as_the_engine_takes_it():
    emoji, rtl, combining = "👩‍👩‍👧", "שלום", "e\u0301"  # characters are code points, counted as Python counts them
    checked = check_request(
        LIMITS,
        message=f"{emoji} {rtl}",
        history=[{"role": "user", "content": [{"type": "text", "text": combining}]}, ["a", None], "b"],
        mode="Free",
        context=None,
    )
    assert (checked.message, checked.mode, checked.context) == (f"{emoji} {rtl}", "none", "")
    # plain turns: the user's two messages are one turn, the empty bot turn is dropped
    assert checked.history == [f"{combining} a", "b"]
    checked = check_request(LIMITS, message=" a\n  b ", history=[" x\t y ", [" ", "z "]])
    assert (checked.message, checked.history) == ("a b", ["x y", "z"])
    assert check_request(LIMITS, message="x" * 10, context="y" * 8, history=["z" * 20]).message == "x" * 10
    defaults = GenerationSettings(num_beams=1, do_sample=True, max_new_tokens=7)
    checked = check_request(LIMITS, settings={"num_beams": 3.0, "do_sample": False}, defaults=defaults,
                            ranges={"num_beams": (1, 10)})  # fmt: skip
    # the request's settings: the defaults with what it sent, whole numbers as int
    assert checked.settings == GenerationSettings(num_beams=3, do_sample=False, max_new_tokens=7)
    assert type(checked.settings.num_beams) is int
    # the chat window's text is counted as typed: escaping for display costs nothing
    shown = [{"role": "user", "content": to_display("<&>" * 6)}]
    assert check_request(LIMITS, chat=shown, text=from_display).history == ["<&>" * 6]


def test_raised_limits_reach_the_engine_uncut():
    """Flags above the built-in defaults (2,000 characters a turn, 128 turns) are honoured end to end: what passes
    the check reaches the engine whole."""
    raised = ChatLimits(
        max_message_chars=5000, max_history_turns=200, max_history_chars=10_000, max_body_bytes=1 << 22
    )
    words = " ".join(["word"] * 800)  # 3,999 characters, whitespace already plain
    history = [f"turn {i}" for i in range(180)] + ["y" * 4000]
    checked = check_request(raised, message=words, history=history)
    assert checked.message == words and checked.history == history


class NoModel:
    """An engine whose every model-facing method fails the test: a refusal must come before any of them."""

    max_positions = 128

    def default_settings(self):
        from chat_e.engines.local import GenerationSettings

        return GenerationSettings(num_beams=1)

    def __getattr__(self, name):
        raise AssertionError(f"the engine's {name} was used before the request was checked")


def test_handlers_refuse_before_the_engine_is_touched():
    import gradio as gr

    handlers = Handlers(NoModel(), limits=LIMITS)
    huge = "c" * 4_000_000  # seconds of tokenizing, were the context unbounded
    with pytest.raises(gr.Error, match="The context is 4,000,000 characters long"):
        handlers.api_chat("hi", [], "persona", huge)
    with pytest.raises(gr.Error, match="The message is 4,000,000 characters long"):
        handlers.add_message(huge, [])
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(gr.Error, match="The context is 4,000,000 characters long"):
        next(handlers.respond(chat, "persona", huge, 1, False, 1.0, 1.0, 8, 1))


@pytest.mark.parametrize(
    "host, auth, key, warned",
    [
        ("127.0.0.1", False, False, None),
        ("localhost", False, False, None),
        ("::1", False, False, None),
        ("0.0.0.0", False, False, "--host 0.0.0.0 serves beyond this machine"),
        ("192.168.1.20", False, False, "--host 192.168.1.20 serves beyond this machine"),
        ("myhost.example", False, False, "--host myhost.example serves beyond this machine"),
        ("0.0.0.0", True, False, None),
        ("0.0.0.0", False, True, None),
    ],
)
def test_exposure_warning(host, auth, key, warned):
    warning = exposure_warning(host, auth, key)
    assert (warning is None) == (warned is None)
    if warned:
        assert warning.startswith(warned) and "--auth USER:PASSWORD" in warning and "CHAT_E_API_KEY" in warning
    assert is_loopback(host) == (host in ("127.0.0.1", "localhost", "::1"))


def test_parse_auth():
    assert parse_auth("alice:wonder:land") == ("alice", "wonder:land")
    for bad in ("alice", ":pw", "alice:", ""):
        with pytest.raises(ValueError, match="--auth takes USER:PASSWORD"):
            parse_auth(bad)
