"""Chat-E's OpenAI-compatible API against its Gradio endpoint: the latency of the same reply through each.

One ``chat-e`` server (one process, one model, the generation flags below) is started in a subprocess, and the same
message, mode and context are sent over loopback, by the clients users have, through three paths:

* ``gradio``: the Gradio ``chat`` endpoint via ``gradio_client`` (``client.predict(message, history, mode, context,
  api_name="/chat")``): the total latency;
* ``api``: ``POST /v1/chat/completions`` via the ``openai`` client, not streamed (``extra_body={"mode", "context"}``):
  the total latency;
* ``api-stream``: the same with ``stream=True``: the time to the first chunk with text, and the total.

The requests carry no generation fields, so every path gets the server's defaults: greedy search, one beam, replies of
exactly ``--new_tokens`` tokens (``--min_new_tokens`` = ``--max_new_tokens``), so every reply costs the same work.
After ``--warmup`` rounds, ``--requests`` rounds follow; each round sends one request per path, one at a time, the
order of the paths rotating from round to round, so that drift and background load hit all three alike. The clients
are made once, before the first request. The reply text must be the same through every path and every request
(greedy search on the same input): the bench fails when it is not.

Reported per path: median and p90 of the total latency (and of the first text, streamed), the ratio to Gradio's
median, the geometric mean of the per-round ratios with its 95% interval, the server's own generation time (its
``generate:`` log lines, one per reply) and the overhead: each request's total less its reply's generation time, what
the serving path (client, HTTP, Gradio's queue or FastAPI, the reply's way back) adds to the model's work.

    python -m benchmarks.bench_api                      # SmolLM2-135M-Instruct, built into runs/models/smollm2
    python -m benchmarks.bench_api --model DIR --requests 20 --out runs/bench/api_latency.json
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks import harness

PATHS = ("gradio", "api", "api-stream")
LABELS = {
    "gradio": "Gradio `chat` endpoint (gradio_client)",
    "api": "/v1/chat/completions (openai)",
    "api-stream": "/v1/chat/completions, stream (openai)",
}
MESSAGE = "Hi! What's your name?"
MODE = "persona"
CONTEXT = "My name is Chat-E. I'm helpful, creative, clever and very friendly."
#: the engine's line per reply in the server's log
GENERATE_LINE = re.compile(r"chat_e\.engines\.local: generate: .* new_tokens=(\d+) seconds=([0-9.]+)")


# ---------------------------------------------------------------------------------------------- the server
class Server:
    """``python -m chat_e --model DIR`` on a free loopback port with greedy replies of exactly ``new_tokens`` tokens
    (None: the model's own generation defaults), its output in ``log_path``, its feedback in a SQLite file beside the
    log."""

    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        threads: int = 1,
        new_tokens: int | None = 32,
        extra: Sequence[str] = (),
    ):
        self.port = harness.free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        feedback_db = f"sqlite:///{log_path.with_suffix('.feedback.db')}"
        self.cmd = [
            sys.executable, "-m", "chat_e", "--model", str(model), "--port", str(self.port),
            "--threads", str(threads), "--feedback_db", feedback_db, *extra,
        ]  # fmt: skip
        if new_tokens is not None:  # None: the model's own generation defaults
            self.cmd += ["--num_beams", "1", "--no-do_sample", "--max_new_tokens", str(new_tokens),
                         "--min_new_tokens", str(new_tokens)]  # fmt: skip
        env = harness.launch_env({"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"})
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, cwd=harness.ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds until the server answered ``GET /`` with 200; an error with the log's tail when it exited or did
        not answer in ``timeout``."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chat-e exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"chat-e did not answer on {self.url} within {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generations(self) -> list[tuple[int, float]]:
        """``(new tokens, seconds)`` of every reply the server generated, in order."""
        return [(int(n), float(s)) for n, s in GENERATE_LINE.findall(self.log())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------------------------------- the paths
def requesters(url: str) -> dict:
    """One function per path: ``() -> (reply, total seconds, first-text seconds or None)``; the clients are made
    here, outside the timings."""
    import openai
    from gradio_client import Client

    gradio = Client(url, verbose=False, analytics_enabled=False)
    api = openai.OpenAI(base_url=f"{url}v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": MESSAGE}]
    extra = {"mode": MODE, "context": CONTEXT}
    model = api.models.list().data[0].id

    def via_gradio():
        start = time.perf_counter()
        reply = gradio.predict(MESSAGE, [], MODE, CONTEXT, api_name="/chat")
        return reply, time.perf_counter() - start, None

    def via_api():
        start = time.perf_counter()
        answer = api.chat.completions.create(model=model, messages=messages, extra_body=extra)
        return answer.choices[0].message.content, time.perf_counter() - start, None

    def via_stream():
        start = time.perf_counter()
        first, pieces = None, []
        for chunk in api.chat.completions.create(model=model, messages=messages, extra_body=extra, stream=True):
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                first = time.perf_counter() - start if first is None else first
                pieces.append(text)
        return "".join(pieces), time.perf_counter() - start, first

    return {"gradio": via_gradio, "api": via_api, "api-stream": via_stream}


def rounds(send: dict, n: int, offset: int = 0) -> list[dict]:
    """``n`` rounds, each one request per path in a rotated order; per request its path, round, reply and times."""
    done = []
    for i in range(n):
        k = (offset + i) % len(PATHS)
        for path in PATHS[k:] + PATHS[:k]:
            reply, total, first = send[path]()
            done.append({"path": path, "round": offset + i, "reply": reply, "total_s": total, "first_text_s": first})
    return done


# ---------------------------------------------------------------------------------------------- report
def stats(values: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(values), 4),
        "p90_s": round(harness.percentile(values, 0.9), 4),
        "min_s": round(min(values), 4),
        "max_s": round(max(values), 4),
    }


def summarize(requests: list[dict]) -> dict:
    """Per path: total (and first-text) statistics, the server's generation time, and the ratio to Gradio (of the
    medians, and the geometric mean of the per-round ratios with its 95% interval)."""
    by_path = {p: [r for r in requests if r["path"] == p] for p in PATHS}
    gradio_total = {r["round"]: r["total_s"] for r in by_path["gradio"]}
    results = {}
    for path, done in by_path.items():
        entry = {"requests": len(done), "total": stats([r["total_s"] for r in done])}
        firsts = [r["first_text_s"] for r in done if r["first_text_s"] is not None]
        entry["first_text"] = stats(firsts) if firsts else None
        timed = [r for r in done if r.get("generate_s") is not None]
        entry["server_generate"] = stats([r["generate_s"] for r in timed]) if timed else None
        entry["overhead"] = stats([r["total_s"] - r["generate_s"] for r in timed]) if timed else None
        gradio_median = (results.get("gradio") or entry)["total"]["median_s"]  # gradio comes first
        entry["median_vs_gradio"] = round(entry["total"]["median_s"] / gradio_median, 3)
        ratios = [r["total_s"] / gradio_total[r["round"]] for r in done]
        entry["per_round_ratio_vs_gradio"] = [round(x, 4) for x in harness.geometric_mean_interval(ratios)]
        results[path] = entry
    return results


def markdown(results: dict) -> str:
    rows = []
    for path, r in results.items():
        first = r["first_text"]
        gen, over = r["server_generate"], r["overhead"]
        geo, lo, hi = r["per_round_ratio_vs_gradio"]
        rows.append(
            [
                LABELS[path],
                f"{r['total']['median_s']:.3f}",
                f"{r['total']['p90_s']:.3f}",
                f"{r['median_vs_gradio']:.2f}",
                "1.00" if path == "gradio" else f"{geo:.2f} ({lo:.2f}–{hi:.2f})",
                f"{first['median_s']:.3f}" if first else "(whole reply)",
                f"{first['p90_s']:.3f}" if first else "(whole reply)",
                f"{gen['median_s']:.3f}" if gen else "n/a",
                f"{over['median_s']:.3f}" if over else "n/a",
            ]
        )
    header = [
        "path", "median (s)", "p90 (s)", "median vs Gradio", "per-round ratio (95% CI)", "first text median (s)",
        "first text p90 (s)", "server generate median (s)", "overhead median (s)",
    ]  # fmt: skip
    return harness.markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="A model directory; default: SmolLM2-135M-Instruct, built into runs/models/smollm2 if missing."
    )
    parser.add_argument("--requests", type=int, default=20, help="Measured requests per path (default 20).")
    parser.add_argument("--warmup", type=int, default=2, help="Rounds before measuring, not counted (default 2).")
    parser.add_argument("--new_tokens", type=int, default=32, help="Every reply is exactly this long (default 32).")
    parser.add_argument("--threads", type=int, default=1, help="The server's torch threads (default 1).")
    parser.add_argument("--out", default="runs/bench/api_latency.json", help="Where to write the JSON results.")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        parser.error("--requests must be at least 1 and --warmup at least 0.")
    model = Path(args.model) if args.model else harness.ensure_model("smollm2")

    load = {"start": harness.load_average()}
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        server = Server(model, Path(tmp) / "chat-e.log", threads=args.threads, new_tokens=args.new_tokens)
        try:
            startup = server.wait_ready()
            send = requesters(server.url)
            warm = rounds(send, args.warmup)
            load["measure_start"] = harness.load_average()
            started = time.perf_counter()
            measured = rounds(send, args.requests, offset=args.warmup)
            seconds = time.perf_counter() - started
            load["measure_end"] = harness.load_average()
            generations = server.generations()
            server_log_tail = server.log()[-2000:]
        finally:
            server.stop()

    # one generate line per request, in order (the requests never overlap): each request gets its server time
    everything = warm + measured
    if len(generations) == len(everything):
        for request, (tokens, gen_seconds) in zip(everything, generations, strict=True):
            request["new_tokens"], request["generate_s"] = tokens, gen_seconds
    replies = sorted({r["reply"] for r in everything})
    same_reply = len(replies) == 1
    results = summarize(measured)
    report = {
        "command": harness.command("benchmarks.bench_api", argv),
        "model": str(args.model or "SmolLM2-135M-Instruct (runs/models/smollm2, chat_e.data.models.build_smollm2)"),
        "parameters": harness.parameter_count(model),
        "server": {
            "command": shlex.join(server.cmd),
            "startup_s": round(startup, 1),
            "generations_logged": len(generations),
        },
        "message": MESSAGE,
        "mode": MODE,
        "context": CONTEXT,
        "new_tokens": args.new_tokens,
        "new_tokens_logged": sorted({n for n, _ in generations}),
        "warmup_rounds": args.warmup,
        "requests_per_path": args.requests,
        "measure_seconds": round(seconds, 1),
        "host": harness.host_info(),
        "load_average_1_5_15min": load,
        "same_reply": same_reply,
        "replies": replies,
        "results": results,
        "requests": [{k: v for k, v in r.items() if k != "reply"} for r in measured],
    }
    if not same_reply:
        report["server_log_tail"] = server_log_tail
    harness.write_json(args.out, report)

    print(f"model: {report['model']}, {report['parameters'] / 1e6:.1f}M parameters; {args.requests} requests per path")
    print(f"load average (1/5/15 min): {load}")
    print(markdown(results))
    print(f"same reply through every path and request: {'yes' if same_reply else 'NO'}: {replies!r}")
    if not same_reply:
        raise SystemExit(f"the replies differ between paths or requests ({len(replies)} distinct); see {args.out}")
    return report


if __name__ == "__main__":
    main()
