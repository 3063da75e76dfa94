"""Chat-E's fine-tune loop on the demo model: 48 pieces of feedback, a Train-page DPO run on them, and chat latency
while that run uses the machine.

One ``chat-e serve --admin`` server (``runs/demo`` by default, the model ``make demo`` writes; greedy replies of
exactly ``--new_tokens`` tokens; the server's default threads for this machine):

1. **Feedback**: ``--rows`` chats through the chat UI's endpoints (``gradio_client``: ``/add_message``,
   ``/respond``), each reply corrected (``/correct``) with the reply a person gave in the chit-chat corpus (its
   validation dialogues). Each correction is a DPO pair: the person's reply over the model's.
2. **Idle**: one user's reply latency (``POST /v1/chat/completions``, ``--requests`` replies one after another).
3. **The Train page's run** (``/admin/``, ``/start``: DPO, LoRA rank ``--lora_rank``, ``--steps`` steps, torchrun
   with ``--nproc`` ranks, as the operator starts it, niced by the app): the same latency measured once the run has
   logged its first step. Then the run is left to finish: its wall time, and its held-out before/after (the run's
   record: the model's own preference for the chosen reply, with its 95 % interval).
4. **The control**: the same run started without the app's lowering of its priority (``RunManager.niceness = 0``),
   the same latency, then the run is stopped.

Reported: p50 and p95 latency of each phase and their ratio to idle's, and the run's numbers.

    make demo
    python -m benchmarks.bench_chat_training --out runs/bench/chat_training.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from dataclasses import astuple
from pathlib import Path

import httpx
import psutil

from benchmarks import harness
from benchmarks.bench_api import Server
from chat_e.data.corpora import DataArguments, load_dialogue_dataset
from chat_e.data.dialogue import parse_texts
from chat_e.feedback.store import DONE, RUNNING, FeedbackStore
from chat_e.studio.runs import RunForm, RunManager, run_processes, share_text
from hf_ext.runtime import usable_cores

MESSAGE = "I finally got the job! What should I do to celebrate?"
ADMIN = ("operator", "bench-only-password")
#: what every run's training gets first (the Train page's --train_args)
#: the Train page's run: held-out rows, batch, max length (the form's fields)
HELD_OUT, BATCH, MAX_LENGTH = 8, 4, 160


def feedback_rows(url: str, n: int) -> float:
    """``n`` chats through the UI's endpoints, each reply corrected with the corpus's human reply; the seconds."""
    from gradio_client import Client

    data = load_dialogue_dataset(DataArguments(dataset_name="chitchat", n_val=n, n_train=1))["validation"]
    client = Client(url, verbose=False, analytics_enabled=False, ssl_verify=False)
    started = time.perf_counter()
    for row in data:
        _, turns = parse_texts(row["texts"])
        _, chat, *_ = client.predict(turns[-1], [], api_name="/add_message")
        client.predict(chat, "free", "", 1, False, 1.0, 1.0, 32, 1, api_name="/respond")
        client.predict(row["labels"], api_name="/correct")
    client.close()
    return time.perf_counter() - started


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


def wait_for_step(store: FeedbackStore, run_id: int, timeout: float = 1200) -> None:
    """Until run ``run_id`` logged a training step (its progress file); an error with its log if it ended first."""
    run = store.run(run_id)
    progress = Path(run["log_path"]).parent / "progress.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if progress.is_file() and '"event": "log"' in progress.read_text():
            return
        if store.run(run_id)["status"] != RUNNING:
            raise RuntimeError(f"run #{run_id} ended early:\n{Path(run['log_path']).read_text()[-3000:]}")
        time.sleep(1)
    raise TimeoutError(f"run #{run_id} logged no step in {timeout:.0f}s")


def wait_until_over(store: FeedbackStore, page, run_id: int, timeout: float = 3600) -> dict:
    """Until run ``run_id`` is no longer running (the page settles it); its record."""
    deadline = time.monotonic() + timeout
    while store.run(run_id)["status"] == RUNNING and time.monotonic() < deadline:
        page.predict(api_name="/status")
        time.sleep(2)
    return store.run(run_id)


def summary(values: list[float], idle: list[float] | None, overlapped: bool | None = None) -> dict:
    row = {"p50_s": round(statistics.median(values), 3), "p95_s": round(harness.percentile(values, 0.95), 3),
           "requests": len(values)}  # fmt: skip
    if idle:
        row["p50_ratio"] = round(row["p50_s"] / statistics.median(idle), 2)
        row["p95_ratio"] = round(row["p95_s"] / harness.percentile(idle, 0.95), 2)
    if overlapped is not None:
        row["training_ran_throughout"] = overlapped
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_served_model_argument(parser)
    parser.add_argument("--rows", type=int, default=48, help="Corrected replies, each a DPO pair (default 48).")
    parser.add_argument("--requests", type=int, default=20, help="Measured replies per phase (default 20).")
    parser.add_argument("--warmup", type=int, default=2, help="Replies before each phase's, not counted.")
    parser.add_argument("--new_tokens", type=int, default=32, help="Every reply is exactly this long (default 32).")
    parser.add_argument("--steps", type=int, default=40, help="The DPO run's steps (default 40).")
    parser.add_argument("--lora_rank", type=int, default=16, help="The run's LoRA rank (default 16).")
    parser.add_argument("--nproc", type=int, default=2, help="The run's ranks under torchrun (default 2).")
    harness.add_publish_arguments(parser, out="runs/bench/chat_training.json", section="chat-training")
    args = parser.parse_args(argv)
    model = harness.served_model(parser, args)
    from gradio_client import Client

    threads = max(1, usable_cores() // 2)  # chat-e's default: the cores over --concurrency 2
    form = RunForm(method="dpo", max_steps=args.steps, lora_rank=args.lora_rank, learning_rate=1e-3,
                   launcher="torchrun", nproc=args.nproc, held_out=HELD_OUT, batch=BATCH, max_length=MAX_LENGTH)  # fmt: skip
    phases, run_report = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-chat-training-") as tmp:
        tmp = Path(tmp)
        extra = ["--admin", ":".join(ADMIN), "--train_dir", str(tmp / "train")]
        server = Server(model, tmp / "chat-e.log", threads=threads, new_tokens=args.new_tokens, extra=extra)
        store = FeedbackStore(f"sqlite:///{(tmp / 'chat-e.log').with_suffix('.feedback.db')}")
        try:
            server.wait_ready()
            served = httpx.get(f"{server.url}v1/models", timeout=30).json()["data"][0]["id"]
            run_report["feedback_seconds"] = round(feedback_rows(server.url, args.rows), 1)
            run_report["feedback_rows"] = len(store.feedback())

            latencies(server.url, served, args.warmup)
            phases["idle"] = (latencies(server.url, served, args.requests), None)

            page = Client(f"{server.url}admin/", auth=ADMIN, verbose=False, analytics_enabled=False, ssl_verify=False)
            page.predict(*astuple(form), api_name="/start")  # the page's fields, in the form's order
            run_id = store.runs()[0]["id"]
            wait_for_step(store, run_id)
            latencies(server.url, served, args.warmup)
            measured = latencies(server.url, served, args.requests)
            phases["training, as the Train page runs it"] = (measured, store.run(run_id)["status"] == RUNNING)
            record = wait_until_over(store, page, run_id)
            page.close()
            if record["status"] != DONE:
                raise RuntimeError(f"the Train page's run ended {record['status']}: {record['detail']}")
            before, after = record["metrics_before"], record["metrics_after"]
            run_report.update(
                run_id=run_id, rows=record["rows"], steps=args.steps, lora_rank=args.lora_rank, nproc=args.nproc,
                wall_s=round((record["ended_at"] - record["started_at"]).total_seconds(), 1),
                prefers_chosen=[before.get("preferred_sum"), after.get("preferred_sum")],
                reply_nll=[before.get("reply_nll"), after.get("reply_nll")],
            )  # fmt: skip

            control = RunManager(store, str(model), tmp / "control")
            control.niceness = 0
            control_id = control.start(form)
            try:
                wait_for_step(store, control_id)
                latencies(server.url, served, args.warmup)
                measured = latencies(server.url, served, args.requests)
                phases["training, not niced (control)"] = (measured, store.run(control_id)["status"] == RUNNING)
            finally:
                pid = store.run(control_id)["pid"]
                processes = run_processes(pid)
                for process in processes:  # the control run is killed outright: its outcome is not measured
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                psutil_wait(processes)
        finally:
            server.stop()
            store.close()

    idle = phases["idle"][0]
    rows = {name: summary(values, None if name == "idle" else idle, overlapped)
            for name, (values, overlapped) in phases.items()}  # fmt: skip
    latency_table = harness.markdown_table(
        ["phase", "p50 (s)", "p95 (s)", "p50 / idle", "p95 / idle"],
        [[name, r["p50_s"], r["p95_s"], r.get("p50_ratio", 1.0), r.get("p95_ratio", 1.0)] for name, r in rows.items()],
    )
    pref, nll = run_report["prefers_chosen"], run_report["reply_nll"]
    run_table = harness.markdown_table(
        ["feedback rows", "DPO rows", "run wall time (s)", "held-out: prefers chosen", "held-out chosen NLL/token"],
        [[run_report["feedback_rows"], run_report["rows"], run_report["wall_s"],
          f"{share_text(pref[0])} → {share_text(pref[1])}", f"{nll[0]:.3f} → {nll[1]:.3f}"]],
    )  # fmt: skip
    note = (f"`{model}` served by `chat-e` ({threads} torch thread(s) per reply) on {usable_cores()} cores. "
            f"{args.rows} replies corrected through the chat UI with the chit-chat corpus's human replies, then the "
            f"Train page's DPO run on them ({args.steps} steps, LoRA rank {args.lora_rank}, {args.nproc} ranks under "
            f"torchrun; {HELD_OUT} rows held out). Latency: one user, {args.requests} replies of "
            f"{args.new_tokens} tokens per phase, measured once the run has logged its first step.")  # fmt: skip
    report = {"model": str(model), "threads": threads, "phases": rows, "run": run_report,
              "latencies_s": {name: values for name, (values, _) in phases.items()}, "args": vars(args)}  # fmt: skip
    return harness.publish("benchmarks.bench_chat_training", argv, [note, run_table, latency_table], report, args)


def psutil_wait(processes) -> None:
    for process in processes:
        try:
            process.wait(timeout=60)
        except Exception:  # gone already, or not our child
            pass


if __name__ == "__main__":
    main()
