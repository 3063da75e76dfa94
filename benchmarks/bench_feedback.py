"""Chat-E's feedback writes under load: the latency (p50, p95) and throughput of ``/rate`` with SQLite and with
PostgreSQL as the feedback database, side by side in one run, two Chat-E replicas on one database.

    python -m benchmarks.bench_feedback --clients 50 --replicas 2 --writes 20 --out runs/bench/feedback.json \
        --doc docs/benchmarks.md

One model server (``chat-e --no_feedback --concurrency 2`` on the tiny chat model, ``tests/app/support.py``'s
``make_sensitive_model``: a random-init model whose replies are text) serves both databases' runs. For each database,
one after the other, everything else the same:

* **SQLite**: a fresh file in a temporary folder, opened as Chat-E opens it (WAL, ``synchronous=FULL``: every commit
  synced, ``busy_timeout`` 30 s);
* **PostgreSQL**: a fresh database on a real server (``tests/app/postgres.py``'s ``PostgresServer``, its data in a
  temporary folder on the same disk), started with ``fsync`` on (the tests' server runs without it) and the default
  ``synchronous_commit=on``: like SQLite, every commit is on disk before it is acknowledged (``--no-postgres_fsync``:
  the tests' setting).

``--replicas`` Chat-E servers (``chat-e --backend <model server>/v1 --feedback_db URL``, as ``tests/app/
test_feedback_loop.py`` runs them) start on the fresh database. ``--clients`` ``gradio_client`` clients, one thread
each, client ``i`` on replica ``i % replicas``, each chat once (``/add_message`` + ``/respond``: a reply to rate; not
timed), then wait on one barrier. When the last arrives, each sends ``--writes`` ``/rate`` calls in a row on its reply,
alternating like and dislike; each call is timed with ``time.perf_counter()`` around ``client.predict(...,
api_name="/rate")``: the client's request, the server's handler and its commit, the answer. Per database:

* **p50, p95**: of every acknowledged write's latency (linear interpolation, ``harness.percentile``);
* **throughput**: acknowledged writes / seconds from the barrier's release to the end of the last write;
* **rows**: the ``rating`` rows in the database afterwards (``chat_e.feedback.store.FeedbackStore.counts``). They must
  equal the acknowledged writes (the database holds nothing else): the run fails otherwise, before anything is
  published;
* **CPU ms per write**: user and system CPU seconds over the same span (barrier to last write) per acknowledged write,
  of this process (the clients), of the replicas, of PostgreSQL's processes (its server and connections), and the
  rest of the host's busy time (the idle model server; anything else running on the host shows here).

The clients talk http to loopback (no TLS) with ``ssl_verify=False``: with it on, gradio_client loads the CA bundle
for each request it makes, about 40 ms of the client's CPU per ``/rate`` call on the host of docs/benchmarks.md. The
replicas' logs up to the end of the load are searched for lines that say a write went wrong ("could not store
feedback", "database is locked", tracebacks); their counts are in the JSON, the logs beside it (``--out``). The
clients, the servers and the databases share the host's cores: the latencies include the clients' own time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness

DATABASES = ("SQLite", "PostgreSQL")
#: the model's name, as the replicas in front of the model server call it
SERVED_NAME = "tiny-chat"
#: what the replicas' logs are searched for, by name
LOG_PATTERNS = {
    "could not store feedback": re.compile(r"could not store feedback"),
    "database is locked": re.compile(r"database is locked", re.IGNORECASE),
    "traceback": re.compile(r"^Traceback \(most recent call last\)", re.MULTILINE),
}
#: seconds every client may take to connect and chat once before the barrier
SETUP_SECONDS = 600


def rating(k: int) -> str:
    """A client's ``k``-th rating: like, dislike, like, ..."""
    return "dislike" if k % 2 else "like"


def summarize(latencies: list[float], failed: int, wall_s: float, rows: int) -> dict:
    """One database's numbers: the acknowledged writes (one latency each, seconds), those that failed, the seconds
    from the barrier to the last write's end, and the rows found afterwards."""
    acked = len(latencies)
    return {
        "writes_acked": acked,
        "writes_failed": failed,
        "p50_ms": 1000 * harness.percentile(latencies, 0.50) if latencies else None,
        "p95_ms": 1000 * harness.percentile(latencies, 0.95) if latencies else None,
        "max_ms": 1000 * max(latencies) if latencies else None,
        "wall_s": wall_s,
        "writes_per_s": acked / wall_s if wall_s > 0 else None,
        "rows": rows,
        "rows_match": rows == acked,
    }


def ratios(results: dict) -> dict:
    """PostgreSQL's throughput and p95 over SQLite's."""
    sqlite, postgres = results["SQLite"], results["PostgreSQL"]
    return {
        "throughput": postgres["writes_per_s"] / sqlite["writes_per_s"],
        "p95": postgres["p95_ms"] / sqlite["p95_ms"],
        "p50": postgres["p50_ms"] / sqlite["p50_ms"],
    }


def mismatches(results: dict) -> list[str]:
    """What is wrong with the rows: a database whose count of rows is not its count of acknowledged writes."""
    return [
        f"{name}: {r['rows']} rows in the database for {r['writes_acked']} acknowledged writes"
        for name, r in results.items()
        if not r["rows_match"]
    ]


def markdown(results: dict, ratio: dict, setup: dict) -> str:
    header = ["database", "replicas", "clients", "writes acked", "failed", "p50 (ms)", "p95 (ms)", "writes/s",
              "rows in the database", "CPU ms/write: clients", "replicas", "PostgreSQL", "rest of the host"]  # fmt: skip

    def cpu(r: dict, name: str) -> str:
        value = r.get("cpu_ms_per_write", {}).get(name)
        return "–" if value is None else f"{value:.1f}"

    rows = [[name, setup["replicas"], setup["clients"], r["writes_acked"], r["writes_failed"], f"{r['p50_ms']:.1f}",
             f"{r['p95_ms']:.1f}", f"{r['writes_per_s']:.1f}", r["rows"], cpu(r, "clients"), cpu(r, "replicas"),
             cpu(r, "postgres"), cpu(r, "other")]
            for name, r in results.items()]  # fmt: skip
    table = harness.markdown_table(header, rows)
    line = (
        f"PostgreSQL / SQLite: throughput {ratio['throughput']:.2f}×, p50 {ratio['p50']:.2f}×, p95 "
        f"{ratio['p95']:.2f}×. PostgreSQL fsync: {'on' if setup['postgres_fsync'] else 'off'}."
    )
    return f"{table}\n\n{line}"


# --- the load -----------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User and system CPU seconds of process ``pid``; with ``descendants``, also of those it started, running or
    ended (PostgreSQL's connections)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *(root.children(recursive=True) if descendants else ())]
    except psutil.NoSuchProcess:
        return total
    for process in processes:
        try:
            t = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + ((t.children_user + t.children_system) if descendants else 0.0)
    return total


class Load:
    """The clients' record: each acknowledged write's latency, the failures, when the barrier released them and when
    each finished, and the CPU seconds of ``processes`` (a name: its process ids) at both ends of the writes."""

    def __init__(self, clients: int, processes: dict[str, list[int]]):
        self.lock = threading.Lock()
        self.clients, self.processes = clients, processes
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.setup_errors: list[str] = []
        self.started: list[float] = []
        self.ended: list[float] = []
        self.cpu: list[dict[str, float]] = []
        self.barrier = threading.Barrier(clients, action=self._release)

    def cpu_now(self) -> dict[str, float]:
        """This process (the clients) alone: the servers are its children; ``host``: every core's busy time."""
        import psutil

        cpu = {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in self.processes.items()}
        busy = psutil.cpu_times()
        host = sum(getattr(busy, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))
        return {"clients": cpu_seconds(os.getpid(), descendants=False), **cpu, "host": host}

    def _release(self) -> None:
        self.cpu.append(self.cpu_now())
        self.started.append(time.perf_counter())

    def finished(self, latencies: list[float], failures: list[str]) -> None:
        """A client's writes are done; after the last client's, the CPU seconds again."""
        end = time.perf_counter()
        with self.lock:
            self.latencies += latencies
            self.failures += failures
            self.ended.append(end)
            if len(self.ended) == self.clients:
                self.cpu.append(self.cpu_now())

    def cpu_ms_per_write(self) -> dict[str, float]:
        """CPU milliseconds per acknowledged write, by process group, from the barrier to the last write; ``other``:
        the rest of the host's busy time (the idle model server, and anything else this host was running)."""
        start, end = self.cpu
        per_write = {name: 1000 * (end[name] - start[name]) / max(len(self.latencies), 1) for name in end}
        host = per_write.pop("host", None)
        if host is not None:
            per_write["other"] = max(host - sum(per_write.values()), 0.0)
        return per_write


def greedy() -> tuple:
    """``/respond``'s generation settings after the chat, mode and context: greedy, the test servers' length."""
    from tests.app.support import TEST_SETTINGS

    return (1, False, 1.0, 1.0, TEST_SETTINGS["max_new_tokens"], TEST_SETTINGS["min_new_tokens"])


def client_session(i: int, url: str, writes: int, load: Load) -> None:
    from tests.app.support import gradio_client  # ssl_verify=False: see its docstring

    client = None
    try:
        try:
            client = gradio_client(url)
            _, chat, *_ = client.predict(f"client {i}: hello, who is there?", [], api_name="/add_message")
            chat = client.predict(chat, "free", "", *greedy(), api_name="/respond")
            index = len(chat) - 1
        except Exception as err:
            with load.lock:
                load.setup_errors.append(f"client {i}: {type(err).__name__}: {err}")
            load.barrier.abort()
            return
        try:
            load.barrier.wait(timeout=SETUP_SECONDS)
        except threading.BrokenBarrierError:
            return
        latencies, failures = [], []
        for k in range(writes):
            start = time.perf_counter()
            try:
                client.predict(index, rating(k), api_name="/rate")
            except Exception as err:
                failures.append(f"client {i} write {k}: {type(err).__name__}: {err}")
            else:
                latencies.append(time.perf_counter() - start)
        load.finished(latencies, failures)
    finally:
        if client is not None:
            client.close()


def run_load(urls: list[str], clients: int, writes: int, processes: dict[str, list[int]]) -> Load:
    load = Load(clients, processes)
    threads = [
        threading.Thread(target=client_session, args=(i, urls[i % len(urls)], writes, load), daemon=True)
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SETUP_SECONDS + 600)
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a client did not finish within its time")
    if load.setup_errors or not load.started:
        raise RuntimeError(f"clients could not chat before the writes: {load.setup_errors[:5]}")
    return load


# --- the databases ------------------------------------------------------------------------------------------------


def database_settings(url: str) -> dict:
    """What the database does on a commit: SQLite's journal mode and synchronous level as Chat-E's connections set
    them, or PostgreSQL's fsync and synchronous_commit."""
    from sqlalchemy import text

    from chat_e.feedback.store import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                levels = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
                return {
                    "journal_mode": conn.execute(text("PRAGMA journal_mode")).scalar(),
                    "synchronous": levels.get(conn.execute(text("PRAGMA synchronous")).scalar()),
                }
            return {name: conn.execute(text(f"SHOW {name}")).scalar() for name in ("fsync", "synchronous_commit")}
    finally:
        engine.dispose()


def rating_rows(url: str) -> int:
    from chat_e.feedback.store import FeedbackStore

    store = FeedbackStore(url)
    try:
        return store.counts()["rating"]
    finally:
        store.close()


def log_findings(logs: list[str]) -> dict:
    return {name: sum(len(pattern.findall(log)) for log in logs) for name, pattern in LOG_PATTERNS.items()}


def measure(name: str, url: str, backend, work: Path, args, postgres=None) -> dict:
    """One database's run: the replicas on ``url``, the load, the rows; the replicas stopped whatever happens."""
    from tests.app.support import TEST_SETTINGS, ChatEServer

    front = ("--backend", f"{backend.url}v1", "--max_new_tokens", str(TEST_SETTINGS["max_new_tokens"]))
    replicas = []
    try:
        for n in range(args.replicas):
            replicas.append(
                ChatEServer(SERVED_NAME, work / f"{name.lower()}-replica-{n}.log", *front, feedback_db=url)
            )
        for server in replicas:
            server.wait_ready()
        processes = {"replicas": [server.proc.pid for server in replicas]}
        if postgres is not None:
            processes["postgres"] = [postgres.process.pid]
        load = run_load([server.url for server in replicas], args.clients, args.writes, processes)
        logs = [server.log() for server in replicas]  # the load's lines, before any of the shutdown's
    finally:
        for server in replicas:
            server.stop()
    wall = max(load.ended) - load.started[0]
    result = summarize(load.latencies, len(load.failures), wall, rating_rows(url))
    result["cpu_ms_per_write"] = load.cpu_ms_per_write()
    result["settings"] = database_settings(url)
    result["log"] = log_findings(logs)
    result["stored_in"] = sum(f"feedback: stored in {name.lower()}" in log for log in logs)
    result["failures"] = load.failures[:20]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50, help="concurrent gradio_client clients (default 50)")
    parser.add_argument("--replicas", type=int, default=2, help="chat-e servers on one database (default 2)")
    parser.add_argument("--writes", type=int, default=20, help="/rate calls per client, in a row (default 20)")
    parser.add_argument(
        "--postgres_fsync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="PostgreSQL syncs every commit to disk, as SQLite does (default; the tests' server does not)",
    )
    harness.add_publish_arguments(parser, out=None, section="bench-feedback")
    args = parser.parse_args(argv)

    from chat_e.data.models import build_chat_model
    from tests.app.postgres import PostgresServer
    from tests.app.support import ChatEServer, make_sensitive_model

    started = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-feedback-") as folder:
        work = Path(folder)
        model = make_sensitive_model(build_chat_model(work / "tiny-chat", "tiny", seed=0), work / "model", std=0.5)
        backend = postgres = None
        try:
            backend = ChatEServer(model, work / "model-server.log", "--no_feedback", "--concurrency", "2")
            postgres = PostgresServer(fsync=args.postgres_fsync)
            backend.wait_ready()
            urls = {"SQLite": f"sqlite:///{work / 'feedback.db'}", "PostgreSQL": postgres.fresh_database("feedback")}
            fsync = database_settings(urls["PostgreSQL"])["fsync"]
            if fsync != ("on" if args.postgres_fsync else "off"):
                raise RuntimeError(f"PostgreSQL's fsync is {fsync!r}")
            for name in DATABASES:
                server = postgres if name == "PostgreSQL" else None
                results[name] = measure(name, urls[name], backend, work, args, server)
                print(name, {k: v for k, v in results[name].items() if k != "failures"}, flush=True)
        finally:
            if backend is not None:
                backend.stop()
            if postgres is not None:
                postgres.stop()
            if args.out:  # the servers' logs beside the JSON
                logs = Path(args.out).with_name(Path(args.out).stem + "-logs")
                logs.mkdir(parents=True, exist_ok=True)
                for log in work.glob("*.log"):
                    shutil.copy(log, logs / log.name)
    seconds = time.monotonic() - started
    setup = {"clients": args.clients, "replicas": args.replicas, "writes_per_client": args.writes,
             "postgres_fsync": args.postgres_fsync, "run_seconds": round(seconds, 1)}  # fmt: skip
    wrong = mismatches(results)
    if wrong:  # nothing published; the JSON says what was found
        if args.out:
            harness.write_json(args.out, {"setup": setup, "results": results, "mismatches": wrong})
        raise SystemExit("acknowledged writes missing from (or extra in) the database: " + "; ".join(wrong))
    ratio = ratios(results)
    report = {"setup": setup, "results": results, "postgres_over_sqlite": ratio}
    return harness.publish("benchmarks.bench_feedback", argv, [markdown(results, ratio, setup)], report, args)


if __name__ == "__main__":
    main(sys.argv[1:])
