"""The resume benchmark's reading of a failed launch's log."""

from benchmarks.bench_resume import last_error


def test_last_error_is_the_exception_line_without_the_rank_prefix(tmp_path):
    log = tmp_path / "stock.log"
    log.write_text(
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "x.py", line 1, in <module>\n'
        "[rank0]: deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size"
        " of 2 but the current world size is 1.\n"
        "[2026-11-24 08:40:00,000] [ERROR] [launch.py:259:sigkill_handler] exits with return code = 1\n"
    )
    assert last_error(log) == (
        "deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2 but"
        " the current world size is 1."
    )


def test_last_error_falls_back_to_the_last_line(tmp_path):
    log = tmp_path / "killed.log"
    log.write_text("step 1\nKilled\n")
    assert last_error(log) == "Killed"
