"""The feedback-write bench's pure parts: the ratings it sends, its statistics, its row check and its table."""

import pytest

from benchmarks import bench_feedback


def test_each_client_alternates_like_and_dislike():
    assert [bench_feedback.rating(k) for k in range(4)] == ["like", "dislike", "like", "dislike"]


def test_summary_gives_percentiles_in_ms_and_acknowledged_writes_per_second():
    latencies = [0.010, 0.020, 0.030, 0.040, 0.050]
    result = bench_feedback.summarize(latencies, failed=1, wall_s=2.0, rows=5)
    assert result["writes_acked"] == 5 and result["writes_failed"] == 1
    assert result["p50_ms"] == pytest.approx(30.0) and result["p95_ms"] == pytest.approx(48.0)
    assert result["writes_per_s"] == 2.5  # the failed write is not counted
    assert result["rows_match"] is True
    assert bench_feedback.summarize(latencies, failed=0, wall_s=2.0, rows=6)["rows_match"] is False


def results(sqlite_rows=4, postgres_rows=4):
    sqlite = bench_feedback.summarize([0.01, 0.02, 0.03, 0.04], failed=0, wall_s=1.0, rows=sqlite_rows)
    postgres = bench_feedback.summarize([0.02, 0.04, 0.06, 0.08], failed=0, wall_s=0.5, rows=postgres_rows)
    return {"SQLite": sqlite, "PostgreSQL": postgres}


def test_ratios_are_postgresql_over_sqlite():
    ratio = bench_feedback.ratios(results())
    assert ratio["throughput"] == pytest.approx(2.0) and ratio["p95"] == pytest.approx(2.0)
    assert ratio["p50"] == pytest.approx(2.0)


def test_a_database_whose_rows_differ_from_its_acknowledged_writes_is_named():
    assert bench_feedback.mismatches(results()) == []
    assert bench_feedback.mismatches(results(postgres_rows=3)) == [
        "PostgreSQL: 3 rows in the database for 4 acknowledged writes"
    ]


def test_table_has_a_row_per_database_and_the_ratios():
    setup = {"clients": 50, "replicas": 2, "postgres_fsync": True}
    found = results()
    found["SQLite"]["cpu_ms_per_write"] = {"clients": 24.0, "replicas": 15.0, "other": 1.0}
    found["PostgreSQL"]["cpu_ms_per_write"] = {"clients": 24.0, "replicas": 16.0, "postgres": 0.5, "other": 1.5}
    text = bench_feedback.markdown(found, bench_feedback.ratios(found), setup)
    assert "| SQLite | 2 | 50 | 4 | 0 | 25.0 | 38.5 | 4.0 | 4 | 24.0 | 15.0 | – | 1.0 |" in text
    assert "| PostgreSQL | 2 | 50 | 4 | 0 | 50.0 | 77.0 | 8.0 | 4 | 24.0 | 16.0 | 0.5 | 1.5 |" in text
    assert "throughput 2.00×" in text and "PostgreSQL fsync: on" in text


def test_cpu_per_write_is_the_difference_over_the_acknowledged_writes():
    load = bench_feedback.Load(clients=1, processes={})
    load.latencies = [0.01] * 4
    load.cpu = [{"clients": 1.0, "replicas": 2.0, "host": 5.0}, {"clients": 1.2, "replicas": 2.1, "host": 5.4}]
    per_write = load.cpu_ms_per_write()
    assert per_write["clients"] == pytest.approx(50.0) and per_write["replicas"] == pytest.approx(25.0)
    assert per_write["other"] == pytest.approx(25.0)  # the host's 100 ms a write, less the 75 ms of the two


def test_cpu_seconds_of_this_process_grow_with_its_work():
    import os

    before = bench_feedback.cpu_seconds(os.getpid(), descendants=False)
    sum(i * i for i in range(2_000_000))
    assert bench_feedback.cpu_seconds(os.getpid(), descendants=False) > before
