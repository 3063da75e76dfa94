"""Chat-E served for real: ``python -m chat_e`` in a subprocess, driven through gradio_client."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import urllib.request

import gradio as gr
import httpx
import pytest
from gradio_client.exceptions import AppError

from chat_e.__main__ import resolve_quantize
from chat_e.data.limits import ChatLimits
from chat_e.data.messages import message_text
from chat_e.web.ui import APOLOGY, Handlers, from_display, to_display

from ..conftest import BIN, ROOT, free_port, launch_env, run_side_by_side
from .support import (
    UI_SETTINGS,
    ChatEServer,
    chat_e_cmd,
    make_broken_model,
    make_sensitive_model,
    mudoconv_prompt,
    served_engine,
    serving,
    stock_seq2seq_reply,
)

PERSONA = "My name is Chat-E. I'm helpful, creative, clever, sarcastic and very friendly."
LIMITS = ChatLimits()  # the servers here run with the default limits


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_sensitive_model(tiny_model_dir, tmp_path_factory.mktemp("chat-e-model"))


@pytest.fixture(scope="module")
def servers(model_dir, tiny_model_dir, tmp_path_factory):
    """Two servers started side by side (start-up is mostly single-threaded imports): one on the model, one on a
    model whose every generation fails."""
    logs = tmp_path_factory.mktemp("chat-e-logs")
    broken = make_broken_model(tiny_model_dir, logs / "broken-model")
    started = [
        ChatEServer(model_dir, logs / "server.log", "--concurrency", "2"),
        ChatEServer(broken, logs / "broken-server.log"),
    ]
    with serving(*started) as ready:
        yield ready


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def broken_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in this process, with the server's settings and thread count, to predict every reply."""
    with served_engine(model_dir) as chat:
        yield chat


def client(server):
    return server.client()


def alternating(turns: list[str]) -> list[dict]:
    """``turns`` as messages whose roles alternate and end with the bot's, so that a new message is the user's."""
    roles = ["assistant" if (len(turns) - i) % 2 else "user" for i in range(len(turns))]
    return [{"role": role, "content": turn} for role, turn in zip(roles, turns)]


def window(messages: list[dict]) -> list[dict]:
    """Messages as the chat window holds them (what /add_message and /respond take): display text in parts."""
    return [{**m, "content": [{"type": "text", "text": to_display(m["content"])}]} for m in messages]


def test_chat_endpoint_is_named_and_typed(server):
    api = client(server).view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert [p["parameter_name"] for p in api["/chat"]["parameters"]] == ["message", "history", "mode", "context"]
    assert api["/chat"]["returns"][0]["type"] == {"type": "string"}


def test_multi_turn_conversation(server, reference):
    c = client(server)
    history: list[dict] = []
    replies = []
    for message, mode, context in [
        ("Hi! What's your name?", "persona", PERSONA),
        ("I'm going somewhere warm next month.", "domain", "vacation ideas"),
        ("Any advice?", "free", ""),
    ]:
        reply = c.predict(message, history, mode, context, api_name="/chat")
        assert reply == reference(message, history, mode, context)
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
        replies.append(reply)
    assert all(replies)
    # the history is used: the last message alone gets another reply
    assert c.predict("Any advice?", [], "free", "", api_name="/chat") != replies[-1]


def test_concurrent_sessions_do_not_share_history(server, reference):
    n_clients, n_turns = 20, 3
    transcripts: dict[int, list[dict]] = {}
    errors: list[BaseException] = []

    def session(i: int):
        try:
            c = client(server)
            history: list[dict] = []
            for turn in range(n_turns):
                message = f"client {i} turn {turn}: I have {i * 7 + turn} cats and {i} dogs"
                reply = c.predict(message, history, "emotion", f"mood {i}", api_name="/chat")
                history += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
            transcripts[i] = history
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert sorted(transcripts) == list(range(n_clients))
    distinct = set()
    for i, history in transcripts.items():
        for turn in range(n_turns):
            message, reply = history[2 * turn]["content"], history[2 * turn + 1]["content"]
            assert reply == reference(message, history[: 2 * turn], "emotion", f"mood {i}"), (i, turn)
            distinct.add(reply)
    assert len(distinct) > n_clients  # replies depend on each session's own history, so a mix-up would show


@pytest.mark.parametrize(
    "message, turns, mode, context",
    [
        ("Hi! What's your name?", [], "persona", PERSONA),
        ("Any advice?", ["I'm going somewhere warm next month.", "Sounds lovely!"], "domain", "vacation ideas"),
        ("and you?", ["hello", "hi there, I like cats", "I have two dogs"], "free", ""),
        ("What should we eat?", ["I'm starving."], "topic", "favorite foods"),
    ],
    ids=["persona", "domain-history", "free-history", "topic"],
)
def test_served_replies_equal_stock_generate(server, model_dir, message, turns, mode, context):
    """The oracle shares no code with Chat-E: the prompt as MuDoConv writes it, stock ``generate`` on the model as
    the server serves it (int8 dynamic quantization of the Linear layers), greedy with the server's lengths."""
    greedy = dict(num_beams=1, do_sample=False, max_new_tokens=8, min_new_tokens=1)
    stock = stock_seq2seq_reply(
        model_dir, mudoconv_prompt(message, turns, mode, context), int8=True, threads=1, **greedy
    )
    assert stock  # a reply to compare with
    assert client(server).predict(message, alternating(turns), mode, context, api_name="/chat") == stock
    _, chat, *_ = client(server).predict(message, window(alternating(turns)), api_name="/add_message")
    chat = client(server).predict(chat, mode, context, *UI_SETTINGS, api_name="/respond")
    assert from_display(chat[-1]["content"]) == stock  # the streamed reply, joined


def test_ui_events_stream_a_reply(server, reference):
    c = client(server)
    box, chat, *_ = c.predict("Hello there!", [], api_name="/add_message")
    assert box == {"__type__": "update", "value": "", "interactive": False}  # cleared and locked until the reply
    assert chat[-1]["role"] == "user"
    chat = c.predict(chat, "persona", PERSONA, *UI_SETTINGS, api_name="/respond")
    assert [m["role"] for m in chat] == ["user", "assistant"]
    reply = from_display(chat[-1]["content"])
    assert reply and reply == reference("Hello there!", [], "persona", PERSONA)


# ---- bad input ---------------------------------------------------------------------------------------------------


def refusals(server, c, endpoint: str, cases) -> None:
    """Every ``(args, text)`` of ``cases`` sent to ``endpoint`` is refused with ``text``, with no model call and no
    traceback in the server's log."""
    generated, tracebacks = server.generations(), server.log().count("Traceback")
    for args, text in cases:
        with pytest.raises(AppError, match=re.escape(text)):
            c.predict(*args, api_name=endpoint)
    assert server.generations() == generated
    assert server.log().count("Traceback") == tracebacks


def test_empty_and_non_string_fields_are_refused_clearly(server):
    c = client(server)
    refusals(
        server,
        c,
        "/chat",
        [
            (("", [], "free", ""), "The message is empty: type something to send."),
            (("  \n\t ", [{"role": "user", "content": "hi"}], "persona", PERSONA), "The message is empty"),
            ((None, [], "free", ""), "The message should be text (a string), not null."),
            ((42, [], "free", ""), "The message should be text (a string), not a number."),
            (("hi", "not a list", "free", ""), "The history should be a list of {'role', 'content'} messages"),
            (("hi", [{"role": "user", "content": 7}], "free", ""), "history[0] should hold text, not a number."),
            (("hi", [{"role": "bot", "content": "x"}], "free", ""), "history[0]['role'] should be 'user' or"),
            (("hi", [3], "free", ""), "history[0] should be a {'role', 'content'} message, a [user, bot] pair or"),
            (("hi", [], 3, ""), "The mode should be a string (persona, emotion, domain, topic or free), not a"),
            (("hi", [], "pirate", ""), "Unknown context mode 'pirate'"),
            (("hi", [], "persona", ["not", "text"]), "The context should be text (a string), not a list."),
        ],
    )
    refusals(server, c, "/add_message", [(("   ", []), "The message is empty"), ((7, []), "not a number")])
    chat = window([{"role": "user", "content": "hi"}])
    refusals(
        server,
        c,
        "/respond",
        [
            (("not a chat", "free", "", *UI_SETTINGS), "The chat should be the chat window's value: a list of"),
            ((chat, "free", 5, *UI_SETTINGS), "The context should be text (a string), not a number."),
            ((chat, None, "", *UI_SETTINGS), "The mode should be a string"),
            ((chat, "free", "", 0, False, 1.0, 1.0, 8, 1), "num_beams should be a whole number from 1 to 10, not 0."),
            ((chat, "free", "", 1, "yes", 1.0, 1.0, 8, 1), "do_sample should be true or false, not 'yes'."),
            ((chat, "free", "", 1, False, "hot", 1.0, 8, 1), "temperature should be a number from 0.05 to 2.0"),
            ((chat, "free", "", 1, False, 1.0, 1.0, 10**6, 1), "max_new_tokens should be a whole number from 1 to"),
            ((chat, "free", "", 1, False, 1.0, 1.0, 8.5, 1), "max_new_tokens should be a whole number"),
        ],
    )
    assert c.predict([], "free", "", *UI_SETTINGS, api_name="/respond") == []  # nothing to answer, no error
    before = server.generations()
    assert c.predict("hi", [], "free", "", api_name="/chat")  # a real message is answered
    assert server.generations() == before + 1


def test_over_the_limits_is_refused_at_every_entry_point(server, reference):
    c = client(server)
    turns = [f"turn {i}" for i in range(LIMITS.max_history_turns + 1)]
    too_many, too_long = alternating(turns), alternating(["x" * 1500] * 14)  # 51 messages; 21,000 characters
    assert sum(len(m["content"]) for m in too_long) > LIMITS.max_history_chars
    long_message, long_context = "m" * (LIMITS.max_message_chars + 1), "c" * (LIMITS.max_context_chars + 1)
    message_text_ = "The message is 2,001 characters long; Chat-E takes up to 2,000. Shorten it and send again."
    context_text = "The context is 4,001 characters long; Chat-E takes up to 4,000. Shorten it and send again."
    turns_text = "The chat has 51 earlier messages; Chat-E takes up to 50. Start a new chat (Clear) or send fewer."
    chars_text = "The chat's earlier messages are over 20,000 characters together"
    refusals(
        server,
        c,
        "/chat",
        [
            ((long_message, [], "free", ""), message_text_),
            (("m" * 1_000_000, [], "free", ""), "The message is 1,000,000 characters long"),
            (("hi", [], "persona", long_context), context_text),
            (("hi", [], "persona", "c" * 1_000_000), "The context is 1,000,000 characters long"),
            (("hi", too_many, "free", ""), turns_text),
            (("hi", [["u", "b"]] * 26, "free", ""), "The chat has 52 earlier messages"),  # a pair is two
            (("hi", too_long, "free", ""), chars_text),
        ],
    )
    refusals(server, c, "/add_message", [((long_message, []), message_text_), (("hi", window(too_many)), turns_text)])
    pending = [{"role": "user", "content": "hi"}]
    refusals(
        server,
        c,
        "/respond",
        [
            ((window([{"role": "user", "content": long_message}]), "free", "", *UI_SETTINGS), message_text_),
            ((window(pending), "persona", long_context, *UI_SETTINGS), context_text),
            ((window(too_many + pending), "free", "", *UI_SETTINGS), turns_text),
            ((window(too_long + pending), "free", "", *UI_SETTINGS), chars_text),
        ],
    )
    # at the limits exactly: answered, as the engine answers
    at = ("m " * (LIMITS.max_message_chars // 2), too_many[1:], "persona", "c" * LIMITS.max_context_chars)
    assert len(at[0]) == LIMITS.max_message_chars and len(at[1]) == LIMITS.max_history_turns
    reply = c.predict(*at, api_name="/chat")
    assert reply and reply == reference(*at)


def test_request_bodies_over_the_limit_get_413_unread(server):
    limit = LIMITS.max_body_bytes
    url = f"{server.url}gradio_api/call/chat"
    answer = f"The request body is over {limit:,} bytes, the most Chat-E takes; it was not read."
    r = httpx.post(url, json={"data": ["hi", [], "persona", "c" * limit]}, timeout=60)  # by its Content-Length
    assert (r.status_code, r.json()["detail"][: len(answer)]) == (413, answer)

    def chunks():  # no Content-Length: refused once the bytes received pass the limit
        yield b'{"data": ["hi", [], "persona", "'
        for _ in range(limit // 65536 + 1):
            yield b"c" * 65536
        yield b'"]}'

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert (r.status_code, r.json()["detail"][: len(answer)]) == (413, answer)
    files = {"files": ("big.txt", b"x" * (limit + 1), "text/plain")}
    r = httpx.post(f"{server.url}gradio_api/upload", files=files, timeout=60)  # uploads too
    assert r.status_code == 413
    with pytest.raises(httpx.HTTPStatusError, match="413"):  # what gradio_client raises
        client(server).predict("hi", [], "persona", "c" * limit, api_name="/chat")
    assert server.alive() and client(server).predict("hi", [], "free", "", api_name="/chat")


def test_html_is_shown_as_text(server, reference):
    c = client(server)
    message = '<b>bold</b><img src=x onerror="alert(1)"><script>alert(2)</script> & more'
    _, chat, *_ = c.predict(message, [], api_name="/add_message")
    shown = message_text(chat[-1]["content"])
    assert "<" not in shown and "&lt;script&gt;" in shown and from_display(shown) == message
    chat = c.predict(chat, "free", "", *UI_SETTINGS, api_name="/respond")
    assert from_display(chat[-1]["content"]) == reference(message, [], "free", "")  # the model got the raw text
    assert c.predict(message, [], "free", "", api_name="/chat") == reference(message, [], "free", "")


BAD_MODEL_DIRS = ["missing", "file", "empty", "bad-json", "weightless"]


@pytest.fixture(scope="module")
def refused_starts(tiny_model_dir, tmp_path_factory):
    """``chat-e`` started where it must refuse to serve, each run once, side by side (each spends its seconds
    importing): ``(folder or path, port, its result)`` by case. A bad model directory of each kind (the missing one
    through the console script, as users type it); a port in use, with the feedback database (the default, in the run
    directory: each runs in a folder of its own) and without (``--no_feedback``)."""
    root = tmp_path_factory.mktemp("refusals")
    cases, cmds, cwds = [], [], []
    for case in BAD_MODEL_DIRS:
        path = root / case
        if case == "file":
            path.write_text("not a directory")
        elif case != "missing":
            path.mkdir()
        if case == "bad-json":
            (path / "config.json").write_text("{not json")
        if case == "weightless":
            (path / "config.json").write_text(json.dumps({"model_type": "blenderbot"}))
        cmd = chat_e_cmd(path, free_port())
        if case == "missing":  # the console script, as users type it
            cmd = [str(BIN / "chat-e"), *cmd[3:]]
        cases.append((case, path, None))
        cmds.append(cmd)
        cwds.append(ROOT)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for case, flags in (("port-feedback", []), ("port-no_feedback", ["--no_feedback"])):
            folder = root / case
            folder.mkdir()
            cases.append((case, folder, port))
            cmds.append([*chat_e_cmd(tiny_model_dir, port), *flags])
            cwds.append(folder)
        results = run_side_by_side(cmds, cwd=cwds)
    return {case: (path, port, result) for (case, path, port), result in zip(cases, results)}


@pytest.mark.parametrize("case", BAD_MODEL_DIRS)
def test_bad_model_dir_fails_at_startup_naming_the_path(case, refused_starts):
    path, _, proc = refused_starts[case]
    assert proc.returncode != 0
    assert str(path) in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("chat-e: error:")


def test_generation_error_apologises_and_the_server_stays_up(broken_server):
    srv = broken_server
    c = client(srv)
    assert c.predict("hi", [], "free", "", api_name="/chat") == APOLOGY
    _, chat, *_ = c.predict("hello", [], api_name="/add_message")
    chat = c.predict(chat, "emotion", "happy", 1, False, 1.0, 1.0, 8, 1, api_name="/respond")
    assert chat[-1]["role"] == "assistant" and from_display(chat[-1]["content"]) == APOLOGY
    log = srv.log()
    assert log.count("Traceback (most recent call last)") >= 2 and "IndexError" in log
    # still serving: another request is answered, the page loads, the process runs
    assert c.predict("again", [], "persona", PERSONA, api_name="/chat") == APOLOGY
    with urllib.request.urlopen(srv.url, timeout=30) as resp:
        assert resp.status == 200
    assert srv.alive()


# ---- UI handlers (no server needed) ------------------------------------------------------------------------------


def test_the_choice_after_regenerate_shows_both_replies_and_the_chat_goes_on_from_the_one_chosen(server):
    """Regenerate (sampled) until the reply differs, then choose the previous reply: the choice is stored, and the
    chat shown goes on from the reply chosen, not from the one the user called worse."""
    c = client(server)
    sampled = (1, True, 1.0, 1.0, *UI_SETTINGS[4:])
    _, chat, *_ = c.predict("Tell me about your day.", [], api_name="/add_message")
    shown = c.predict(chat, "none", "", *sampled, api_name="/respond")
    for _ in range(10):  # a sampled reply of the sensitive model differs almost always at once
        again = c.predict(shown[:-1], "none", "", *sampled, api_name="/respond")
        if again[-1]["content"] != shown[-1]["content"]:
            break
        shown = again
    assert again[-1]["content"] != shown[-1]["content"]
    _, chat = c.predict("previous reply", again, api_name="/prefer")  # the chat as the window shows it
    assert [m["role"] for m in chat] == ["user", "assistant"] and chat[-1]["content"] == shown[-1]["content"]


def test_the_choice_offers_both_replies_text():
    from chat_e.web.ui import NEW_REPLY, PREVIOUS_REPLY, FeedbackControls

    records = {1: {"reply": "the new one", "previous": {"reply": "the  first\none " + "x" * 400}}}
    offered = FeedbackControls.offer_choice(records)
    assert offered["visible"] is True and offered["value"] is None
    (label_a, value_a), (label_b, value_b) = offered["choices"]
    assert (value_a, value_b) == (PREVIOUS_REPLY, NEW_REPLY) and label_b == f"{NEW_REPLY}: the new one"
    assert label_a.startswith(f"{PREVIOUS_REPLY}: the first one xxx") and label_a.endswith("…")
    assert len(label_a) == len(PREVIOUS_REPLY) + 2 + 300
    assert FeedbackControls.offer_choice({1: {"reply": "only"}})["visible"] is False


def test_regenerate_undo_and_display_helpers():
    chat = [
        {"role": "user", "content": [{"type": "text", "text": to_display("a <b>")}]},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": to_display("second\nline & <i>")},
        {"role": "assistant", "content": "y"},
    ]
    assert Handlers.regenerate(chat) == [{"role": "user", "content": to_display("a <b>")}, *chat[1:3]]
    rest, message = Handlers.undo(chat)
    assert message == "second\nline & <i>" and rest == Handlers.regenerate(chat)[:2]
    assert Handlers.undo([]) == ([], "")
    assert Handlers.clear() == ([], "")
    chatbot = gr.Chatbot()  # what the browser and gradio_client receive: the Chatbot's own postprocessing
    for text in ["<script>alert(1)</script>", "a &amp; b", "line\nbreak", "&lt;", "a reply\twith\t tabs\n\tand more"]:
        assert from_display(to_display(text)) == text
        shown = chatbot.postprocess([{"role": "assistant", "content": to_display(text)}]).root[0].content
        assert [from_display(m.text) for m in shown] == [text]


def test_int8_with_bf16_is_refused_with_the_fix(tiny_model_dir):
    cmd = chat_e_cmd(tiny_model_dir, free_port(), "--dtype", "bf16", "--quantize", "int8")
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "drop --dtype bf16 or --quantize int8" in proc.stderr


def test_python_dash_m_app_help():
    """``chat-e --help`` lists the subcommands; ``chat-e serve --help`` the server's flags."""
    top, serve = (
        subprocess.run([sys.executable, "-m", "chat_e", *args, "--help"], capture_output=True, text=True, cwd=ROOT)
        for args in ([], ["serve"])
    )
    assert top.returncode == 0 and serve.returncode == 0
    assert "{serve,arena,feedback,train,eval}" in top.stdout and "usage: chat-e serve" in serve.stdout
    for flag in ("--model", "--host", "--port", "--share", "--dtype", "--quantize", "--concurrency"):
        assert flag in serve.stdout
    assert "127.0.0.1" in serve.stdout


def test_cpu_serving_defaults_to_int8_for_fp32_weights():
    assert resolve_quantize("auto", "fp32") == "int8"  # docs/benchmarks.md: ~0.25x fp32 latency, BLEU within 0.1
    assert resolve_quantize("auto", "bf16") == "none"  # int8 dynamic quantization needs fp32 weights
    assert resolve_quantize("none", "fp32") == "none" and resolve_quantize("int8", "fp32") == "int8"


@pytest.mark.parametrize("feedback", [True, False], ids=["feedback", "no_feedback"])
def test_a_port_in_use_is_one_line_and_exit_code_2(refused_starts, feedback):
    """...before the model is loaded, and after the feedback database is opened, in the run directory by default,
    unless --no_feedback (run from a folder of its own, so the default run directory is there)."""
    folder, port, proc = refused_starts["port-feedback" if feedback else "port-no_feedback"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"chat-e: error: cannot serve on 127.0.0.1:{port}: ")
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "INFO chat-e: loaded" not in proc.stderr  # said before loading the model (its log line when loaded)
    assert (folder / "runs" / "chat-e" / "feedback.db").is_file() is feedback
    assert ("feedback: stored in sqlite:///runs/chat-e/feedback.db" in proc.stderr) is feedback
