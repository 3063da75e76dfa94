"""The harness's statistics, tables and docs sections against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from benchmarks import harness


def test_geometric_mean_and_t_interval_of_three_ratios():
    # log ratios -ln 2, 0, ln 2: mean 0, sample standard deviation ln 2, t(2 df) = 4.30, so the interval is
    # exp(±4.30 ln 2 / √3) = 2^(±2.4826) = 0.1789 .. 5.5891
    mean, low, high = harness.geometric_mean_interval([0.5, 1.0, 2.0])
    assert mean == pytest.approx(1.0)
    assert low == pytest.approx(0.17892, abs=1e-5)
    assert high == pytest.approx(5.58906, abs=1e-5)
    # ratios 0.9, 1.0, 1.1: geometric mean (0.99)^(1/3)
    mean, low, high = harness.geometric_mean_interval([0.9, 1.0, 1.1])
    assert mean == pytest.approx(0.99 ** (1 / 3))
    assert (low, high) == pytest.approx((0.77682, 1.27870), abs=1e-5)


def test_t_table_uses_the_next_smaller_degrees_of_freedom():
    assert harness.t95(2) == 4.30
    assert harness.t95(22) == harness.t95(20) == 2.09  # between 20 and 25: the wider interval
    assert harness.t95(31) == 1.96
    mean, low, high = harness.geometric_mean_interval([1.2])
    assert mean == pytest.approx(1.2) and math.isnan(low) and math.isnan(high)


def test_percentile_interpolates():
    assert harness.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert harness.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8)


def test_markdown_table():
    assert harness.markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_write_section_replaces_only_the_marked_part(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n## Memory\n\nnotes above\n<!-- bench_x -->\nold\n<!-- /bench_x -->\nnotes below\n")
    harness.write_section(doc, "bench_x", "new table\n")
    assert doc.read_text() == (
        "# Benchmarks\n\n## Memory\n\nnotes above\n<!-- bench_x -->\nnew table\n<!-- /bench_x -->\nnotes below\n"
    )
    harness.write_section(doc, "bench_y", "appended")
    assert doc.read_text().endswith("notes below\n\n<!-- bench_y -->\nappended\n<!-- /bench_y -->\n")


def test_launcher_commands_run_modules_and_scripts():
    assert harness.launcher_cmd("deepspeed", "benchmarks.worker")[-2:] == ["--module", "benchmarks.worker"]
    assert harness.launcher_cmd("torchrun", "benchmarks.worker")[-2:] == ["-m", "benchmarks.worker"]
    cmd = harness.launcher_cmd("torchrun", "recipes/blenderbot.py")
    assert cmd[-1] == "recipes/blenderbot.py" and "-m" not in cmd
    with pytest.raises(ValueError):
        harness.launcher_cmd("mpirun", "x.py")


def test_synthetic_dataset_is_seeded_and_avoids_special_tokens():
    rows = harness.synthetic_dataset(3, vocab=50, seq_len=8, seed=1)
    assert rows == harness.synthetic_dataset(3, vocab=50, seq_len=8, seed=1)
    assert all(len(r["input_ids"]) == len(r["labels"]) == 8 and min(r["input_ids"] + r["labels"]) >= 4 for r in rows)


def test_synthetic_dataset_gives_a_classifier_one_class_id_per_row():
    rows = harness.synthetic_dataset(50, vocab=50, seq_len=8, seed=1, num_labels=3)
    assert all(isinstance(r["labels"], int) for r in rows)
    assert {r["labels"] for r in rows} == {0, 1, 2}
    # the inputs do not depend on whether the labels are class ids: the same rows as a seq2seq run's first draw
    assert rows[0]["input_ids"] == harness.synthetic_dataset(1, vocab=50, seq_len=8, seed=1)[0]["input_ids"]


def test_classifier_shapes_match_the_hub_model_cards(tmp_path):
    # microsoft/deberta-v3-large's model card: "304M backbone parameters with a vocabulary of 128K tokens which
    # introduces 131M parameters in the Embedding layer"
    model = harness.ensure_model("deberta-v3-large", tmp_path / "v3")
    assert not harness.has_weights(model)
    total = harness.parameter_count(model)
    embedding = 128100 * 1024
    assert abs(embedding - 131e6) < 1e6 and abs((total - embedding) - 304e6) < 0.01 * 304e6, total


def test_reuse_reads_back_a_finished_launch_and_not_a_half_one(tmp_path):
    import json

    out = tmp_path / "memory_zero2_hf-ext"
    (tmp_path / "memory_zero2_hf-ext.rank0.json").write_text(json.dumps({"peak_bytes": 7}))
    assert harness.finished_launch(out) is None  # rank 1 never wrote: the launch did not finish
    (tmp_path / "memory_zero2_hf-ext.rank1.json").write_text(json.dumps({"peak_bytes": 9}))
    # both ranks wrote: read back, no launch (a launch of this bogus worker argument would fail)
    assert harness.launch_worker(["--no_such_flag"], out, reuse=True) == [{"peak_bytes": 7}, {"peak_bytes": 9}]


def test_the_printed_command_quotes_what_the_shell_would_split():
    assert harness.command("benchmarks.bench_exit", ["--layouts", "ZeRO-3, deepspeed", "--repeats", "8"]) == (
        "python -m benchmarks.bench_exit --layouts 'ZeRO-3, deepspeed' --repeats 8"
    )
