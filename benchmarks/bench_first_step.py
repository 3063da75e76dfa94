"""How long an operator waits for the first step of a Train-page run with the page's defaults.

The Train page's Start hands the form to :class:`chat_e.studio.runs.RunManager`; this bench does the same with the
form's defaults (``RunForm()``: DPO, LoRA rank 16, learning rate 5e-4, one rank, 16 held-out rows, batch 4, max length
256) on ``--model`` (``make demo``'s model by default), after ``--users`` simulated users have each corrected two
replies (benchmarks/simulated_users.py: a correction built by rule over the served reply, a DPO pair each, one session
per user). It times, from Start, each phase the page shows (preparing the data, the evaluation before, the training's
first step) from the run's own progress file, then cancels the run (Cancel's path: a checkpoint or nothing to
resume) and reports how it ended.

    make demo
    python -m benchmarks.bench_first_step --out runs/bench/first_step.json --doc docs/benchmarks.md

Run it on an idle machine: the run is niced, as the page's are, and yields to anything else.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.simulated_users import FEEDBACK_MESSAGES, population
from chat_e.feedback.store import ACTIVE_STATES, FeedbackStore
from chat_e.studio.runs import RunForm, RunManager
from chat_e.training.progress import EVAL_BEFORE, PREPARING, read_progress
from hf_ext.runtime import usable_cores

#: what the served model said, which each correction replaces (the rejected side of its DPO pair)
SERVED_REPLY = "I am a student at a university in the United States."


def seed_corrections(store: FeedbackStore, users: int, seed: int) -> int:
    """Two corrections per simulated user, each user's in a session of its own; how many rows."""
    rng = random.Random(seed)
    for user in population(users, seed):
        history: list[str] = []
        for i, message in enumerate(rng.sample(FEEDBACK_MESSAGES, 2)):
            store.add_feedback(kind="edit", reply_id=f"u{user.id}-{i}", model="served", reply=SERVED_REPLY,
                               edited=user.correction(message, rng), session_id=f"user-{user.id}", mode="persona",
                               context=user.persona, history=list(history), message=message.text, settings={})  # fmt: skip
            history += [message.text, SERVED_REPLY]
    return len(store.feedback())


def first_step_times(progress: Path, started: float, timeout: float) -> dict:
    """Seconds from ``started`` to each phase and to the first logged training step (the run's progress file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_progress(progress) if progress.is_file() else []
        phases = {r["phase"]: r for r in records if r["event"] == "phase"}
        step = next((r for r in records if r["event"] == "log" and "loss" in r), None)
        if step is not None:
            return {
                "preparing_s": round(phases[PREPARING]["time"] - started, 1),
                "eval_before_s": round(phases[EVAL_BEFORE]["time"] - started, 1),
                "training_begins_s": round(next(r for r in records if r["event"] == "begin")["time"] - started, 1),
                "first_step_s": round(step["time"] - started, 1),
                "training_rows": phases[EVAL_BEFORE]["training_rows"],
                "held_out_rows": phases[EVAL_BEFORE]["held_out_rows"],
            }
        time.sleep(0.5)
    raise TimeoutError(f"no training step within {timeout:.0f} s: see {progress.parent}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_served_model_argument(parser)
    parser.add_argument("--users", type=int, default=20, help="Simulated users, two corrections each (default 20).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="Give up after this many seconds.")
    harness.add_publish_arguments(parser, out="runs/bench/first_step.json", section="first_step")
    args = parser.parse_args(argv)
    model = harness.served_model(parser, args)
    form = RunForm()
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as tmp:
        store = FeedbackStore(f"sqlite:///{tmp}/feedback.db")
        try:
            rows = seed_corrections(store, args.users, args.seed)
            manager = RunManager(store, str(model.resolve()), Path(tmp) / "train")
            started = time.time()
            run_id = manager.start(form)
            progress = Path(store.run(run_id)["log_path"]).parent / "progress.jsonl"
            times = first_step_times(progress, started, args.timeout)
            manager.cancel(run_id)
            deadline = time.monotonic() + args.timeout
            while manager.refresh() and store.run(run_id)["status"] in ACTIVE_STATES:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run #{run_id} did not stop within {args.timeout:.0f} s of Cancel")
                time.sleep(1)
            record = store.run(run_id)
        finally:
            store.close()
    report = {"model": str(model), "feedback_rows": rows, "form": vars(form), "cores": usable_cores(), **times,
              "cancelled_as": record["status"], "cancel_detail": record["detail"].splitlines()[0]}  # fmt: skip
    table = [
        "| from Start to | seconds |",
        "|---|---|",
        f"| preparing the data (the launch's imports done) | {times['preparing_s']} |",
        f"| the evaluation before ({times['held_out_rows']} held-out rows) | {times['eval_before_s']} |",
        f"| training begins ({times['training_rows']} training rows) | {times['training_begins_s']} |",
        f"| **the first step** | **{times['first_step_s']}** |",
    ]
    note = (
        f"`{model}`, the page's defaults ({form.method.upper()}, LoRA rank {form.lora_rank}, learning rate "
        f"{form.learning_rate}, {form.launcher} with {form.nproc} rank, {form.held_out} held-out rows, batch "
        f"{form.batch}, max length {form.max_length}), {rows} corrections of {args.users} simulated users; "
        f"Cancel then ended it `{record['status']}`."
    )
    return harness.publish("benchmarks.bench_first_step", argv, [note, "\n".join(table)], report, args)


if __name__ == "__main__":
    main()
