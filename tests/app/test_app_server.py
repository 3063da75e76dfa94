"""Chat-E served for real: ``python -m chat_e`` in a subprocess, driven through gradio_client."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request

import pytest
import torch

from chat_e.__main__ import resolve_quantize
from chat_e.engine import MAX_MESSAGE_CHARS, ChatEngine, GenerationSettings, message_text
from chat_e.ui import APOLOGY, Handlers, from_display, to_display

from ..conftest import BIN, ROOT, free_port, launch_env
from .support import TEST_SETTINGS, ChatEServer, chat_e_cmd, make_broken_model, make_sensitive_model

PERSONA = "My name is Chat-E. I'm helpful, creative, clever, sarcastic and very friendly."


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
    try:
        yield [srv.wait_ready() for srv in started]
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def broken_server(servers):
    return servers[1]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in this process, with the server's settings and thread count, to predict every reply."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = ChatEngine.from_pretrained(model_dir, quantize=resolve_quantize("auto", "fp32"))  # as chat-e serves
    settings = GenerationSettings(**{**vars(engine.default_settings()), **TEST_SETTINGS})
    yield lambda message, history, mode, context: engine.chat(message, history, mode, context, settings)
    torch.set_num_threads(threads)


def client(server):
    from gradio_client import Client

    return Client(server.url, verbose=False)


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


def test_ui_events_stream_a_reply(server, reference):
    c = client(server)
    box, chat, *_ = c.predict("Hello there!", [], api_name="/add_message")
    assert box == {"__type__": "update", "value": "", "interactive": False}  # cleared and locked until the reply
    assert chat[-1]["role"] == "user"
    chat = c.predict(chat, "persona", PERSONA, 1, False, 1.0, 1.0, 8, 1, api_name="/respond")
    assert [m["role"] for m in chat] == ["user", "assistant"]
    reply = from_display(chat[-1]["content"])
    assert reply == reference("Hello there!", [], "persona", PERSONA)


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_empty_message_makes_no_model_call(server):
    c = client(server)
    before = server.generations()
    assert c.predict("", [], "free", "", api_name="/chat") == ""
    assert c.predict("  \n\t ", [{"role": "user", "content": "hi"}], "persona", PERSONA, api_name="/chat") == ""
    box, chat, *_ = c.predict("   ", [], api_name="/add_message")
    assert chat == []
    assert c.predict(chat, "free", "", 1, False, 1.0, 1.0, 8, 1, api_name="/respond") == []
    assert c.predict("hi", [], "free", "", api_name="/chat")  # a real message is answered ...
    assert server.generations() == before + 1  # ... and was the only model call


def test_huge_message_is_truncated_and_answered(server):
    c = client(server)
    message = "blah " * 20_000
    assert len(message) == 100_000
    before = server.generations()
    reply = c.predict(message, [], "domain", "vacation ideas", api_name="/chat")
    assert isinstance(reply, str) and reply != APOLOGY
    input_tokens = [int(n) for n in re.findall(r"generate: .*input_tokens=(\d+)", server.log())]
    assert len(input_tokens) == before + 1 and input_tokens[-1] <= 128
    _, chat, *_ = c.predict(message, [], api_name="/add_message")
    assert message_text(chat[-1]["content"]) == to_display(message[:MAX_MESSAGE_CHARS])
    chat = c.predict(chat, "free", "", 1, False, 1.0, 1.0, 8, 1, api_name="/respond")
    assert chat[-1]["role"] == "assistant" and from_display(chat[-1]["content"]) not in ("", APOLOGY)


def test_html_is_shown_as_text(server, reference):
    c = client(server)
    message = '<b>bold</b><img src=x onerror="alert(1)"><script>alert(2)</script> & more'
    _, chat, *_ = c.predict(message, [], api_name="/add_message")
    shown = message_text(chat[-1]["content"])
    assert "<" not in shown and "&lt;script&gt;" in shown and from_display(shown) == message
    chat = c.predict(chat, "free", "", 1, False, 1.0, 1.0, 8, 1, api_name="/respond")
    assert from_display(chat[-1]["content"]) == reference(message, [], "free", "")  # the model got the raw text
    assert c.predict(message, [], "free", "", api_name="/chat") == reference(message, [], "free", "")


def test_unknown_mode_is_a_clear_client_error(server):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Unknown context mode"):
        client(server).predict("hi", [], "pirate", "", api_name="/chat")


@pytest.mark.parametrize("case", ["missing", "file", "empty", "bad-json", "weightless"])
def test_bad_model_dir_fails_at_startup_naming_the_path(case, tmp_path):
    path = tmp_path / case
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
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
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
    for text in ["<script>alert(1)</script>", "a &amp; b", "line\nbreak", "&lt;"]:
        assert from_display(to_display(text)) == text


def test_int8_with_bf16_is_refused_with_the_fix(tiny_model_dir):
    cmd = chat_e_cmd(tiny_model_dir, free_port(), "--dtype", "bf16", "--quantize", "int8")
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "drop --dtype bf16 or --quantize int8" in proc.stderr


def test_python_dash_m_app_help():
    proc = subprocess.run([sys.executable, "-m", "chat_e", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    for flag in ("--model", "--host", "--port", "--share", "--dtype", "--quantize", "--concurrency"):
        assert flag in proc.stdout
    assert "127.0.0.1" in proc.stdout


def test_cpu_serving_defaults_to_int8_for_fp32_weights():
    assert resolve_quantize("auto", "fp32") == "int8"  # docs/benchmarks.md: ~0.25x fp32 latency, BLEU within 0.1
    assert resolve_quantize("auto", "bf16") == "none"  # int8 dynamic quantization needs fp32 weights
    assert resolve_quantize("none", "fp32") == "none" and resolve_quantize("int8", "fp32") == "int8"
