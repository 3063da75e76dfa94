"""Chat while the app trains: a user's reply latency from a ``chat-e`` server while a training run from the Train
page uses the same machine, against the same server idle.

One ``chat-e`` server (SmolLM2-135M-Instruct by default, greedy replies of exactly ``--new_tokens`` tokens, its
default thread count for this machine) answers one user at a time through the OpenAI API (``POST
/v1/chat/completions``), ``--requests`` requests per phase after ``--warmup``:

* ``idle``: nothing else runs;
* ``training (as the app runs it)``: a DPO run of the served model started by :class:`chat_e.studio.runs.RunManager`,
  exactly as the Train page's Start does (torchrun, ``--nproc`` ranks, each rank as many threads as torch gives
  it), on DPO rows exported from a feedback database of ``--rows`` choices;
* ``training, not niced`` (the control): the same run with the app's lowering of its priority turned off.

A training phase measures once the run logged its first step (its model loaded and its first batch done), and the
run is stopped after it. Reported per phase: median (p50) and p95 latency, and the ratio of each to idle's.

    python -m benchmarks.bench_chat_training --out runs/bench/chat_training.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.bench_api import Server
from chat_e.data.progress import read_progress
from chat_e.feedback.store import FeedbackStore
from chat_e.studio import runs as studio_runs
from chat_e.studio.runs import RunForm, RunManager, run_processes, signal_run
from hf_ext.runtime import usable_cores

MESSAGE = "I finally got the job! What should I do to celebrate?"
PHASES = ("idle", "training (as the app runs it)", "training, not niced")


def choice(i: int) -> dict:
    """A stored choice of a reply over its regeneration, as a chat user makes one (a DPO pair)."""
    return dict(kind="choice", reply_id=f"r{i}", model="served", reply=f"Congratulations! Let us go for dinner, {i}.",
                other_reply_id=f"o{i}", other_reply=f"ok {i}", session_id=f"s{i}", mode="none", context="",
                history=["hello", "hi there, how are you?"], message=f"I got the job, number {i}!", settings={})  # fmt: skip


def latencies(url: str, model: str, n: int) -> list[float]:
    """``n`` replies one after another, as one user chatting: the seconds of each."""
    body = {"model": model, "messages": [{"role": "user", "content": MESSAGE}]}
    seconds = []
    with httpx.Client(timeout=600) as client:
        for _ in range(n):
            start = time.perf_counter()
            client.post(f"{url}v1/chat/completions", json=body).raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds


def training_running(manager: RunManager, run_id: int, timeout: float) -> float:
    """Wait until run ``run_id`` logged a step; the seconds that took. An error with the log's tail if it ended."""
    run = manager.store.run(run_id)
    progress = Path(run["log_path"]).parent / "progress.jsonl"
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if any(r.get("event") == "log" for r in read_progress(progress)):
            return time.monotonic() - started
        if manager.refresh()[0]["status"] != "running":
            raise RuntimeError(f"the training ended early:\n{Path(run['log_path']).read_text()[-3000:]}")
        time.sleep(1)
    raise TimeoutError(f"the training logged no step in {timeout:.0f}s")


def stop(manager: RunManager, run_id: int) -> None:
    """Stop the run at once (SIGKILL to every process of it): the measurement is over."""
    pid = manager.store.run(run_id)["pid"]
    processes = run_processes(pid)
    signal_run(pid, signal.SIGKILL)
    for process in processes:
        try:
            process.wait(timeout=60)
        except Exception:  # gone already
            pass
    manager.refresh()


def summary(values: list[float], idle: list[float] | None) -> dict:
    row = {"p50_s": round(statistics.median(values), 3), "p95_s": round(harness.percentile(values, 0.95), 3),
           "requests": len(values)}  # fmt: skip
    if idle:
        row["p50_ratio"] = round(row["p50_s"] / statistics.median(idle), 2)
        row["p95_ratio"] = round(row["p95_s"] / harness.percentile(idle, 0.95), 2)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="The served model; default SmolLM2-135M-Instruct (runs/models/smollm2).")
    parser.add_argument("--requests", type=int, default=20, help="Measured replies per phase (default 20).")
    parser.add_argument("--warmup", type=int, default=2, help="Replies before each phase's, not counted.")
    parser.add_argument("--new_tokens", type=int, default=32, help="Every reply is exactly this long (default 32).")
    parser.add_argument("--rows", type=int, default=48, help="Choices in the feedback database (default 48).")
    parser.add_argument("--nproc", type=int, default=2, help="The training's ranks (default 2, torchrun).")
    parser.add_argument("--lora_rank", type=int, default=8, help="The run's LoRA rank (default 8; 0: every weight).")
    parser.add_argument("--out", default="runs/bench/chat_training.json", help="Where to write the JSON results.")
    parser.add_argument("--doc", default=None, help="Write the table into this Markdown file's section.")
    parser.add_argument("--section", default="chat-training", help="The section's marker name in --doc.")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else harness.ensure_model("smollm2")
    threads = max(1, usable_cores() // 2)  # chat-e's default: the cores over --concurrency 2

    results, waits = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-chat-training-") as tmp:
        tmp = Path(tmp)
        store = FeedbackStore(f"sqlite:///{tmp}/feedback.db")
        for i in range(args.rows):
            store.add_feedback(**choice(i))
        train_args = ["--per_device_train_batch_size", "2", "--max_length", "128", "--n_eval", "4"]
        server = Server(model, tmp / "chat-e.log", threads=threads, new_tokens=args.new_tokens)
        try:
            server.wait_ready()
            served = httpx.get(f"{server.url}v1/models", timeout=30).json()["data"][0]["id"]
            for phase in PHASES:
                run_id = None
                if phase != "idle":
                    manager = RunManager(store, str(model), tmp / "train", train_args)
                    manager.niceness = 0 if phase == "training, not niced" else studio_runs.NICENESS
                    form = RunForm(method="dpo", max_steps=100_000, lora_rank=args.lora_rank, launcher="torchrun",
                                   nproc=args.nproc)  # fmt: skip
                    run_id = manager.start(form)
                    waits[phase] = round(training_running(manager, run_id, timeout=900), 1)
                try:
                    latencies(server.url, served, args.warmup)
                    results[phase] = latencies(server.url, served, args.requests)
                finally:
                    if run_id is not None:
                        stop(manager, run_id)
        finally:
            server.stop()
            store.close()

    idle = results["idle"]
    rows = {phase: summary(values, None if phase == "idle" else idle) for phase, values in results.items()}
    table = harness.markdown_table(
        ["phase", "p50 (s)", "p95 (s)", "p50 / idle", "p95 / idle"],
        [[phase, r["p50_s"], r["p95_s"], r.get("p50_ratio", 1.0), r.get("p95_ratio", 1.0)] for phase, r in rows.items()],
    )
    note = (f"One user's reply latency ({args.new_tokens} new tokens, greedy, {args.requests} replies per phase) from "
            f"`chat-e` serving {model.name} with {threads} torch thread(s), while the Train page's DPO run "
            f"({args.nproc} ranks under torchrun, LoRA rank {args.lora_rank}, {args.rows} feedback rows) trains the "
            f"served model on the same {usable_cores()} cores.")  # fmt: skip
    report = {"model": str(model), "threads": threads, "phases": rows, "latencies_s": results,
              "seconds_to_first_step": waits, "args": vars(args)}  # fmt: skip
    return harness.publish("benchmarks.bench_chat_training", argv, [note, table], report, args)


if __name__ == "__main__":
    main()
