"""bench_gpu's logic that a one-shot GPU run depends on: the padding-free summary, the doc's sections written from a
report (measured rows only, never a dry run's), the row grouping, and launches run side by side with their failures
kept apart. No GPU, no model: a report made up here."""

from __future__ import annotations

import copy

import pytest

from benchmarks import bench_gpu, harness

ENV = {"device": "NVIDIA H100 80GB HBM3", "cuda": "12.8", "torch": "2.11.0", "transformers": "5.23.0",
       "deepspeed": "0.19.8", "trl": "1.16.0", "date": "2026-11-27 12:00 UTC"}  # fmt: skip


def worker_result(tokens_per_step: int, seconds_per_step: float, eval_loss: float, peak: int) -> dict:
    # step k (1-based) ends at k * seconds_per_step with k * tokens_per_step tokens seen
    steps = [(k * seconds_per_step, k * tokens_per_step) for k in range(1, 11)]
    return {"steps": steps, "global_batch": 4, "eval_loss": eval_loss, "final_loss": 1.0, "peak_increment_bytes": 7,
            "peak_device_increment_bytes": peak, "attn_implementation": "sdpa", "bf16": True}  # fmt: skip


def test_padding_free_summary_counts_from_the_end_of_the_warmup_step():
    paths = bench_gpu.summarize_padding_free(
        {"stock": worker_result(100, 0.5, 2.0, 2**30), "hf-ext": worker_result(100, 0.25, 2.2, 2**29)}, warmup=2
    )
    # from the end of step 2 to the end of step 10: 8 steps, 800 tokens, 4 s (stock) and 2 s (hf-ext)
    assert paths["stock"]["tokens_per_s"] == pytest.approx(200)
    assert paths["hf-ext"]["tokens_per_s"] == pytest.approx(400)
    assert paths["hf-ext"]["tokens_ratio"] == pytest.approx(2.0)
    assert paths["hf-ext"]["samples_per_s"] == pytest.approx(4 * 8 / 2)
    assert paths["hf-ext"]["eval_loss_vs_stock"] == pytest.approx(0.1)
    assert paths["stock"]["real_tokens"] == 1000
    assert paths["stock"]["peak_bytes"] == 2**30 and paths["stock"]["peak_kind"] == "device"


def report() -> dict:
    pf = bench_gpu.summarize_padding_free(
        {p: worker_result(100, 0.5, 2.0, 2**30) for p in ("stock", "hf-ext", "trl")}, warmup=2
    )
    save = {"rank0_device_extra_bytes": 2**20, "rank0_extra_rss_bytes": 2**29, "seconds": 1.5, "files": 4,
            "bytes": 3 * 2**28}  # fmt: skip
    return {
        "command": "python -m benchmarks.bench_gpu --out x.json", "dry_run": False, "wall_s": 120.0,
        "settings": {"attn": "sdpa"}, "environment": ENV,
        "rows": {
            "padding_free": {"status": "ok", "model": "chat-135m", "parameters": 134_515_008, "batch": 16,
                             "steps": 40, "warmup": 5, "attn": "sdpa", "bf16": True, "paths": pf,
                             "same_real_tokens": True},
            "chat": {"status": "failed", "reason": "RowError: boom"},
            "save_zero3": {"status": "ok", "model": "400m", "parameters": 364_800_000, "max_shard_size": "200MB",
                           "side_by_side": ["save_zero3_stock", "save_zero3_hf_ext", "planner"], "paths": {"stock": save, "hf_ext": save},
                           "ratio": {"host_rss_hf_ext_vs_stock": 1.0, "device_hf_ext_vs_stock": 1.0}},
            "planner": {"status": "skipped", "reason": "3 s left of the budget"},
        },
    }  # fmt: skip


def test_doc_gets_the_measured_rows_each_with_device_and_command(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Saving\n\ntext\n")
    assert bench_gpu.write_doc(report(), doc) == ["padding_free", "save_zero3"]
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Saving\n\ntext\n\n## GPU\n")  # the layout appended once
    for row in bench_gpu.ROWS:
        assert text.count(f"<!-- {bench_gpu.SECTION}_{row} -->") == 1
    pf = text.split("<!-- bench_gpu_padding_free -->")[1].split("<!-- /bench_gpu_padding_free -->")[0]
    assert "NVIDIA H100 80GB HBM3" in pf and "`python -m benchmarks.bench_gpu --rows padding_free`" in pf
    assert "| hf-ext | 1,000 | 200 | **1.00×** |" in pf
    assert "side by side" in text.split("<!-- bench_gpu_save_zero3 -->")[1]
    # a failed or skipped row leaves its part as it was: the placeholder
    chat = text.split("<!-- bench_gpu_chat -->")[1].split("<!-- /bench_gpu_chat -->")[0]
    assert "Not measured yet" in chat and "boom" not in chat
    # a second run rewrites the marked parts only
    again = copy.deepcopy(report())
    again["rows"]["padding_free"]["paths"]["hf-ext"]["tokens_ratio"] = 1.5
    bench_gpu.write_doc(again, doc)
    assert "**1.50×**" in doc.read_text() and doc.read_text().count("## GPU") == 1


def test_dry_run_reports_never_reach_the_doc(tmp_path):
    dry = dict(report(), dry_run=True)
    with pytest.raises(ValueError):
        bench_gpu.write_doc(dry, tmp_path / "benchmarks.md")
    assert not (tmp_path / "benchmarks.md").exists()
    assert "DRY RUN" in bench_gpu.render(dry)
    with pytest.raises(SystemExit):
        bench_gpu.main(["--dry_run", "--doc", str(tmp_path / "benchmarks.md")])


def test_timed_rows_run_alone_and_memory_rows_together():
    assert bench_gpu.steps(list(bench_gpu.ROWS), side_by_side=True) == [
        ["padding_free"],
        ["chat"],
        ["eval_zero3"],
        ["save_zero3", "planner"],
    ]
    assert bench_gpu.steps(["planner", "chat", "save_zero3"], side_by_side=False) == [
        ["chat"],
        ["save_zero3"],
        ["planner"],
    ]


def test_launches_side_by_side_report_each_outcome(tmp_path):
    opts = bench_gpu.parse(["--dry_run", "--out", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "w")])[1]
    run = bench_gpu.Run(opts, cuda=False)
    outcome = run.launch_all([
        bench_gpu.Launch("ok", ["json.tool", "--help"], one_rank=False),
        bench_gpu.Launch("bad", ["json.tool", str(tmp_path / "missing.json")]),
    ])  # fmt: skip
    assert outcome["ok"] is None
    assert outcome["bad"].startswith("bad: exit 2") and "missing.json" in outcome["bad"]
    assert (tmp_path / "r_logs" / "ok.log").read_text().startswith(harness.sys.executable)
