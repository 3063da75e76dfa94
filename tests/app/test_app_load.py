"""Chat-E under load: 50 concurrent clients against one real server on the tiny BlenderBot, on loopback, bounded in
count and time. Well-formed chats (plain, unicode, the UI's streamed events) mixed with 1 MB messages, 4 MB contexts,
empty and non-string fields, and clients that drop the connection mid-stream.

It asserts that the server stays up, that every well-formed chat gets its non-empty reply (the one the same engine
gives in this process), that every malformed request gets its clear refusal, and that the server's resident memory
comes back to within 10 % of its level before the load (the server keeps the state of its
``SESSIONS`` newest sessions, as ``--max_sessions`` bounds it in production). It prints a table (and writes it as JSON under the test's
tmp dir); docs/benchmarks.md, "Chat-E under load", has one such run::

    .venv/bin/python -m pytest tests/app/test_app_load.py -s -q
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gradio_client.exceptions import AppError

from chat_e.data.limits import ChatLimits
from chat_e.data.messages import message_text
from chat_e.web.ui import from_display, to_display

from .support import UI_SETTINGS, ChatEServer, served_engine, serving

CLIENTS = 50
REQUESTS_PER_CLIENT = 2
#: the whole load stops by itself after this many seconds (requests not sent by then fail the test)
DEADLINE_S = 300
RSS_BAND = 0.10
#: sessions whose state the server keeps (each client is one): the oldest are dropped beyond it, as in production
SESSIONS = 10
LIMITS = ChatLimits()
#: a reply long enough to drop the connection in the middle of: the tiny model's whole window, streamed
LONG_STREAM = ("free", "", 1, False, 1.0, 1.0, 127, 127)
UNICODE = [
    "Hello 👋🏽 how are you? 🎉🐈‍⬛",
    "مرحبا! كيف حالك اليوم؟",  # Arabic, right to left
    "שלום, מה שלומך?",  # Hebrew, right to left
    "Cafe\u0301 na\u0308ive Z\u0351\u0334a\u0315\u0327l\u0353g\u0360o",  # combining marks
    "mixed: abc אבג 123 🙂 e\u0301",
]
WELL_FORMED = ("chat", "unicode", "stream")
#: the refusal each malformed kind gets (an AppError's message, or the 413 body's ``detail``)
REFUSALS = {
    "message-1MB": "The message is 1,000,000 characters long; Chat-E takes up to 2,000.",
    "context-4MB": f"The request body is over {LIMITS.max_body_bytes:,} bytes, the most Chat-E takes",
    "empty": "The message is empty: type something to send.",
    "non-string": "should be text (a string), not",
}
KINDS = ("chat", "unicode", "stream", "message-1MB", "context-4MB", "empty", "non-string", "disconnect", "chat")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("chat-e-load") / "server.log"
    with serving(ChatEServer(tiny_model_dir, log, "--max_sessions", str(SESSIONS))) as (srv,):
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The served model in this process, with the server's settings and thread count: every well-formed reply."""
    with served_engine(tiny_model_dir) as chat:
        yield chat


def request_for(kind: str, i: int) -> tuple:
    """``(endpoint, args)`` of client ``i``'s request of ``kind``."""
    history = [{"role": "user", "content": f"hi, I am client {i}"}, {"role": "assistant", "content": "hello there!"}]
    if kind == "chat":
        return "/chat", (f"client {i}: any plans for the weekend?", history, "domain", "vacation ideas")
    if kind == "unicode":
        return "/chat", (UNICODE[i % len(UNICODE)], history, "persona", "J'aime les chats 🐈 et le café ☕")
    if kind == "stream":
        return "/respond", (f"client {i} says hello 👋", "emotion", "happy")
    if kind == "message-1MB":
        return "/chat", ("m" * 1_000_000, [], "free", "")
    if kind == "context-4MB":
        return "/chat", ("hi", [], "persona", "c" * 4_000_000)
    if kind == "empty":
        return "/chat", ("   ", history, "free", "")
    if kind == "non-string":
        return "/chat", ((42, history, "free", ""), ("hi", history, "topic", ["not", "text"]))[i % 2]
    if kind == "disconnect":
        return "/respond", LONG_STREAM
    raise ValueError(kind)


def send(server, client, kind: str, i: int) -> dict:
    """One request; what came back, as data (classified later, against the reference)."""
    endpoint, args = request_for(kind, i)
    started = time.perf_counter()
    outcome: dict = {"kind": kind, "i": i}
    try:
        if kind == "stream":
            message, mode, context = args
            _, chat, *_ = client.predict(message, [], api_name="/add_message")
            chat = client.predict(chat, mode, context, *UI_SETTINGS, api_name="/respond")
            outcome["reply"] = from_display(message_text(chat[-1]["content"]))
        elif kind == "disconnect":
            outcome["pieces"] = drop_mid_stream(server, i)
        else:
            outcome["reply"] = client.predict(*args, api_name=endpoint)
    except AppError as err:
        outcome["refusal"] = str(err)
    except httpx.HTTPStatusError as err:
        outcome["refusal"] = f"{err.response.status_code}: {err.response.json().get('detail')}"
    except Exception as err:  # classified as "other", and shown
        outcome["error"] = f"{type(err).__name__}: {err}"[:300]
    outcome["seconds"] = time.perf_counter() - started
    return outcome


def drop_mid_stream(server, i: int) -> int:
    """Ask for a long streamed reply over HTTP, read its first pieces, then close the connection."""
    chat = [{"role": "user", "content": [{"type": "text", "text": to_display(f"client {i}: tell me a story")}]}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        event = http.post("gradio_api/call/respond", json={"data": [chat, *LONG_STREAM]}).json()["event_id"]
        pieces = 0
        with http.stream("GET", f"gradio_api/call/respond/{event}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event: complete"):
                    return -1  # finished before we could leave
                if line.startswith("event: generating"):
                    pieces += 1
                    if pieces == 2:
                        return pieces  # leaving: the connection closes here
    return pieces


def classify(outcome: dict, reference) -> str:
    kind = outcome["kind"]
    if kind in WELL_FORMED and "reply" in outcome:
        endpoint, args = request_for(kind, outcome["i"])
        message, history, mode, context = (args[0], [], args[1], args[2]) if kind == "stream" else args
        return "ok" if outcome["reply"] and outcome["reply"] == reference(message, history, mode, context) else "other"
    if kind in REFUSALS and REFUSALS[kind] in outcome.get("refusal", ""):
        return "refused"
    if kind == "disconnect" and outcome.get("pieces", 0) > 0:
        return "ok"
    return "other"


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def settle(server, target_kib: int | None = None, seconds: float = 30) -> int:
    """The server's RSS once it is steady (two readings 0.5 s apart within 1 %) and, with ``target_kib``, back within
    the band of it; or its RSS after ``seconds``."""
    deadline = time.monotonic() + seconds
    rss = server.rss_kib()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        previous, rss = rss, server.rss_kib()
        if abs(rss - previous) <= 0.01 * previous and (target_kib is None or rss <= target_kib * (1 + RSS_BAND)):
            break
    return rss


def test_fifty_clients_mixed_abuse(server, reference, tmp_path):
    # warm-up: one request of each kind, so that first-use costs (imports, caches, arenas) are in the baseline
    warm = server.client()
    for kind in dict.fromkeys(KINDS):
        send(server, warm, kind, 0)
    warm.close()
    before = settle(server)

    with ThreadPoolExecutor(max_workers=8) as pool:  # each client fetches the app's config as it connects
        clients = list(pool.map(lambda _: server.client(), range(CLIENTS)))
    outcomes: list[dict] = []
    lock = threading.Lock()
    deadline = time.monotonic() + DEADLINE_S
    start = threading.Barrier(CLIENTS)

    def run(i: int):
        start.wait()
        for j in range(REQUESTS_PER_CLIENT):
            if time.monotonic() > deadline:
                return
            outcome = send(server, clients[i], KINDS[(i * REQUESTS_PER_CLIENT + j) % len(KINDS)], i)
            with lock:
                outcomes.append(outcome)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    wall = time.perf_counter() - started
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:  # close() waits up to 1 s for the heartbeat thread
        list(pool.map(lambda c: c.close(), clients))
    peak = int(
        next(
            ln.split()[1]
            for ln in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
            if ln.startswith("VmHWM:")
        )
    )
    after = settle(server, before)

    rows = {}
    for kind in dict.fromkeys(KINDS):
        mine = [o for o in outcomes if o["kind"] == kind]
        verdicts = [classify(o, reference) for o in mine]
        seconds = [o["seconds"] for o in mine]
        rows[kind] = {
            "count": len(mine),
            "ok": verdicts.count("ok"),
            "refused": verdicts.count("refused"),
            "other": verdicts.count("other"),
            "p50_s": round(percentile(seconds, 50), 3),
            "p95_s": round(percentile(seconds, 95), 3),
        }
    result = {
        "clients": CLIENTS,
        "requests": len(outcomes),
        "wall_s": round(wall, 1),
        "rss_mib": {"before": round(before / 1024, 1), "peak": round(peak / 1024, 1), "after": round(after / 1024, 1)},
        "kinds": rows,
    }
    table = render(result)
    print("\n" + table)
    (tmp_path / "chat-e-load.json").write_text(json.dumps(result, indent=2))
    (tmp_path / "chat-e-load.md").write_text(table + "\n")

    others = [o for o in outcomes if classify(o, reference) == "other"]
    assert len(outcomes) == CLIENTS * REQUESTS_PER_CLIENT, f"only {len(outcomes)} requests in {DEADLINE_S} s"
    assert not others, others[:5]
    assert all(rows[k]["ok"] == rows[k]["count"] for k in (*WELL_FORMED, "disconnect"))
    assert all(rows[k]["refused"] == rows[k]["count"] for k in REFUSALS)
    assert server.alive() and server.client().predict("still there?", [], "free", "", api_name="/chat")
    assert after <= before * (1 + RSS_BAND), f"RSS {before / 1024:.1f} MiB before, {after / 1024:.1f} MiB after"


def render(result: dict) -> str:
    lines = [
        "| requests | count | ok | refused | other | p50 s | p95 s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, row in result["kinds"].items():
        lines.append(
            f"| {kind} | {row['count']} | {row['ok']} | {row['refused']} | {row['other']} | {row['p50_s']:.3f} "
            f"| {row['p95_s']:.3f} |"
        )
    rss = result["rss_mib"]
    lines.append("")
    lines.append(
        f"{result['clients']} clients, {result['requests']} requests in {result['wall_s']} s; server RSS "
        f"{rss['before']} MiB before, {rss['peak']} MiB at its peak, {rss['after']} MiB after."
    )
    return "\n".join(lines)
