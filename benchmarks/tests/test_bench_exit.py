"""The exit benchmark's pure parts: what counts as an abort, the dump it keeps, the per-cell counts."""

import subprocess
import sys
import time
from pathlib import Path

from benchmarks import bench_exit, harness

DEEPSPEED_ABORT = (
    "[2026-11-25 05:50:00,000] [INFO] [launch.py:351:main] Process 4242 exits successfully.\n"
    "[2026-11-25 05:50:01,000] [ERROR] [launch.py:325:sigkill_handler] ['/venv/bin/python', '-u', '-m', "
    "'benchmarks.exit_worker', '--local_rank=1'] exits with return code = -6\n"
)
TORCHRUN_ABORT = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "Failures:\n  <NO_OTHER_FAILURES>\nRoot Cause (first observed failure):\n[0]:\n"
    "  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 4243)\n"
)
FAULTHANDLER = (
    "terminate called without an active exception\n"
    "Fatal Python error: Aborted\n\n"
    "Thread 0x00007f0000000700 (most recent call first):\n  <no Python frame>\n\n"
    "Current thread 0x00007f0000000740 (most recent call first):\n  <no Python frame>\n"
)


def test_an_abort_is_told_by_the_exit_code_or_by_what_the_launcher_or_rank_printed():
    assert bench_exit.classify(-6, "") == bench_exit.classify(134, "") == "abort"
    assert bench_exit.classify(250, DEEPSPEED_ABORT) == "abort"  # deepspeed's launcher exits with the rank's code
    assert bench_exit.classify(1, TORCHRUN_ABORT) == "abort"
    assert bench_exit.classify(0, FAULTHANDLER) == "abort"  # counted even when the launcher returned 0
    assert bench_exit.classify(1, "ValueError: bad\n") == "error"
    assert bench_exit.classify(None, "") == "hung"
    assert bench_exit.classify(0, "exits successfully\n") == "clean"


def test_the_dump_starts_at_the_abort_message():
    dump = bench_exit.abort_dump("step 3\nsaved\n" + FAULTHANDLER)
    assert dump.splitlines()[0] == "terminate called without an active exception"
    assert "Current thread" in dump and "saved" not in dump
    assert bench_exit.abort_dump("all good\n") is None
    assert len(bench_exit.abort_dump(FAULTHANDLER * 40, lines=10).splitlines()) == 10


def test_summary_counts_each_layout_and_variant():
    def launch(variant, outcome, seconds, engine="ZeRO-3", exit_seconds=None):
        return {"layout": "ZeRO-3, torchrun", "variant": variant, "outcome": outcome, "seconds": seconds,
                "engine": engine, "exit_seconds": exit_seconds}  # fmt: skip

    # a launch whose ranks did not both report their last statement has no exit time, and is left out of its mean
    launches = [launch("hf-ext", "clean", 10.0, exit_seconds=0.5), launch("stock", "abort", 20.0),
                launch("hf-ext", "clean", 12.0, exit_seconds=1.0), launch("stock", "error", 30.0, None),
                launch("stock", "hung", 40.0)]  # fmt: skip
    cells = {c["variant"]: c for c in bench_exit.summarize(launches)}
    assert cells["hf-ext"] == {"layout": "ZeRO-3, torchrun", "variant": "hf-ext", "engine": "ZeRO-3", "launches": 2,
                               "aborts": 0, "other_failures": 0, "mean_seconds": 11.0,
                               "mean_exit_seconds": 0.75}  # fmt: skip
    assert (cells["stock"]["aborts"], cells["stock"]["other_failures"], cells["stock"]["mean_seconds"]) == (1, 2, 30)
    assert cells["stock"]["mean_exit_seconds"] is None
    table = bench_exit.markdown(list(cells.values()))
    assert bench_exit.VARIANTS["stock"] in table and "| 30.0 | ? |" in table and "| 11.0 | 0.75 |" in table


def test_engine_label_reads_the_rank_report():
    rank = {"engine": "DeepSpeedEngine", "zero_stage": 3, "dtensor_params": 0}
    assert bench_exit.engine_label(rank) == "ZeRO-3"
    assert bench_exit.engine_label({"engine": "FSDPBlenderbot", "zero_stage": None, "dtensor_params": 91}) == "FSDP2"
    assert bench_exit.engine_label({"engine": "DistributedDataParallel", "zero_stage": None, "dtensor_params": 0}) == (
        "DDP"
    )


def test_every_layout_launches_two_ranks_of_the_worker():
    for launcher, _, worker in bench_exit.LAYOUTS.values():
        cmd = harness.launcher_cmd(launcher, worker)
        assert cmd[-1] == worker and cmd[-2] in ("--module", "-m")
        assert (harness.ROOT / (worker.replace(".", "/") + ".py")).exists()
        if launcher.startswith("accelerate:"):
            assert Path(launcher.split(":", 1)[1]).exists()
    assert bench_exit.ZERO3.exists()


def test_a_hog_stops_by_itself_after_its_seconds():
    """In its own process, as the benchmark starts it: busy for its seconds (CPU time, not a sleep), then exits 0."""
    code = bench_exit.hog_code(0.5) + "import resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_utime)\n"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started >= 0.5  # it ran its seconds ...
    assert float(proc.stdout) >= 0.1  # ... busy on the CPU (a sleep would use about 0.01 s of it)
