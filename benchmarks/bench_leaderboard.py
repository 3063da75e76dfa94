"""The arena's leaderboard refresh at 100 and 10,000 votes: what it reads from the feedback store, and its time.

    python -m benchmarks.bench_leaderboard --votes 100 10000 --repeats 5 --out runs/bench/leaderboard.json \
        --doc docs/benchmarks.md

A SQLite feedback store (WAL, as Chat-E runs it) holds ``N`` votes among three models, each with the texts a real
vote carries (a 200-character message, two 300-character replies, a 6-turn history). A refresh is what the
Leaderboard tab runs: the votes loaded, then ``chat_e.feedback.leaderboard.leaderboard`` (Bradley-Terry with its bootstrap
interval). Two ways to load them, side by side in one process:

* **rows**: ``FeedbackStore.votes()``, every column of every vote (how the arena loaded them before);
* **outcomes**: ``FeedbackStore.vote_outcomes()``, the three columns a leaderboard needs (how it loads them now).

For each: the median seconds of ``--repeats`` refreshes, and the peak of Python's allocations during one
(``tracemalloc``: what the refresh itself holds at once, whatever the heap held before).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from benchmarks import harness

MODELS = ("base", "tuned", "other")
PATHS = ("rows", "outcomes")


def filled_store(folder: Path, n: int):
    from sqlalchemy.orm import Session

    from chat_e.feedback.store import WINNERS, FeedbackStore, Vote, utcnow

    store = FeedbackStore(f"sqlite:///{folder}/feedback-{n}.db")
    history = {"model_a": ["h" * 80] * 6, "model_b": ["h" * 80] * 6}
    rows = [
        Vote(battle_id=f"b{i}", turn=1, model_a=MODELS[i % 3], model_b=MODELS[(i + 1) % 3],
             winner=WINNERS[i % len(WINNERS)], session_id="s", mode="none", context="", history=history,
             message="m" * 200, settings={"num_beams": 1}, reply_a="a" * 300, reply_b="b" * 300, created_at=utcnow())
        for i in range(n)
    ]  # fmt: skip
    with Session(store.engine) as session, session.begin():
        session.add_all(rows)
    return store


def refresh(store, path: str):
    from chat_e.feedback.leaderboard import leaderboard

    votes = store.votes() if path == "rows" else store.vote_outcomes()
    return leaderboard(votes, list(MODELS))


def measure(store, path: str, repeats: int) -> dict:
    refresh(store, path)  # warm: imports, SQLite's page cache
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        refresh(store, path)
        seconds.append(time.perf_counter() - start)
    tracemalloc.start()
    refresh(store, path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"seconds": statistics.median(seconds), "peak_mib": peak / harness.MiB}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--votes", type=int, nargs="+", default=[100, 10_000])
    parser.add_argument("--repeats", type=int, default=5)
    harness.add_publish_arguments(parser, out=None, section="bench-leaderboard")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for n in args.votes:
            store = filled_store(Path(folder), n)
            try:
                found = {path: measure(store, path, args.repeats) for path in PATHS}
            finally:
                store.close()
            results.append({"votes": n, **found})
            print(results[-1], flush=True)
    rows = [[r["votes"], f"{r['rows']['seconds']:.3f}", f"{r['outcomes']['seconds']:.3f}",
             f"{r['rows']['seconds'] / r['outcomes']['seconds']:.1f}", f"{r['rows']['peak_mib']:.1f}",
             f"{r['outcomes']['peak_mib']:.1f}"] for r in results]  # fmt: skip
    table = (
        harness.markdown_table(["votes", "refresh, rows (s)", "refresh, outcomes (s)", "rows / outcomes",
                                "peak, rows (MiB)", "peak, outcomes (MiB)"], rows)
    )  # fmt: skip
    return harness.publish("benchmarks.bench_leaderboard", argv, [table], {"results": results}, args)


if __name__ == "__main__":
    main(sys.argv[1:])
