"""hf-ext against stock transformers in the same 2-rank DeepSpeed launch: same model, data, seed and config file.

benchmarks.worker with ``--segments`` (the engine of ``bench_train --interleave``) trains stock, hf-ext, hf-ext,
stock, each segment from nothing. These tests check what the throughput ratio relies on: the segments really are
independent, both paths run the same engine, and what hf-ext changes on the way is only the loss fix.
"""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import harness
from benchmarks.worker import StepCodeTracer
from hf_ext.deepspeed.fill import walk  # nested config -> ("a.b", value) pairs


# ZeRO-3, the stage with the most to differ (partitioned parameters, engines kept alive by DeepSpeed's globals); each
# preset's filled config against stock's, ZeRO-2 included: tests/unit/test_deepspeed_config.py
@pytest.fixture(scope="module", params=[3], ids=["zero3"])
def interleaved(request, tmp_path_factory, tiny_model_dir) -> list[dict]:
    from hf_ext.deepspeed.resolve import load_deepspeed_config

    work = tmp_path_factory.mktemp("interleaved")
    config = work / f"zero{request.param}.json"
    # the preset's JSON: stock fills its "auto"s, hf-ext resolves them
    config.write_text(json.dumps(load_deepspeed_config(f"zero{request.param}")))
    args = ["--model", str(tiny_model_dir), "--config", str(config), "--batch", "2", "--steps", "4"]
    result = harness.launch_worker(args + ["--segments", "4", "--trace"], work / "run", {"OMP_NUM_THREADS": 1})
    if isinstance(result, str):
        pytest.fail(result)
    return [r["segments"] for r in result]


@pytest.mark.distributed
def test_segments_take_turns_and_start_from_nothing(interleaved):
    for segments in interleaved:
        assert [s["path"] for s in segments] == ["stock", "hf-ext", "hf-ext", "stock"]
        by_path = {p: [s for s in segments if s["path"] == p] for p in ("stock", "hf-ext")}
        for first, again in by_path.values():
            # a segment run after the other path's gives the same result: nothing carries over
            assert again["final_loss"] == pytest.approx(first["final_loss"], rel=1e-6)
            assert len(again["step_end_times"]) == len(first["step_end_times"]) == 4
        # dropped engines do not pile up (under ZeRO-3 only with release_zero3_globals): at most the last one is
        # still referenced after its segment, and the resident set after each segment stays where it was
        assert [s["engines_alive"] for s in segments] in ([0] * 4, [1] * 4)
        rss = [s["rss_after_bytes"] for s in segments]
        assert max(rss) - rss[0] < 64 * 2**20, [r / 2**20 for r in rss]


@pytest.mark.distributed
def test_both_paths_run_the_same_engine(interleaved):
    for segments in interleaved:
        stages = {(s["path"], s["zero_stage"], s["train_batch_size"]) for s in segments}
        stage = segments[0]["zero_stage"]
        assert stage in (2, 3) and stages == {("stock", stage, 2 * 2), ("hf-ext", stage, 2 * 2)}
        # the whole config the engine ran with, every "auto" filled: stock's fill and hf-ext's resolution agree key by
        # key (bucket sizes, optimizer, scheduler steps, precision), so the throughput ratio compares the same engine
        stock = next(s for s in segments if s["path"] == "stock")["engine_config"]
        ours = next(s for s in segments if s["path"] == "hf-ext")["engine_config"]
        # as {"a.b": value}, so that a failure names the keys that differ
        stock, ours = dict(walk(stock)), dict(walk(ours))
        assert "auto" not in stock.values()
        assert ours == stock


@pytest.mark.distributed
def test_hf_ext_logs_the_true_loss_where_stock_logs_it_world_size_times(interleaved):
    """BlenderBot's forward takes ``**kwargs`` but averages its loss itself; stock still multiplies it by the number of
    ranks (its fix for models that divide by the global token count), hf-ext does not. The same training otherwise:
    with the gradient clipped and Adam's step scale-free, the two runs follow the same trajectory."""
    for segments in interleaved:
        stock = next(s for s in segments if s["path"] == "stock")["final_loss"]
        ours = next(s for s in segments if s["path"] == "hf-ext")["final_loss"]
        assert stock == pytest.approx(2 * ours, rel=2e-3)


@pytest.mark.distributed
def test_hf_ext_callbacks_are_timed_on_every_step(interleaved):
    """The benchmark's direct measure of hf-ext's own per-step code: its callbacks, timed on every step event of the
    hf-ext segments only (stock segments have none)."""
    for segments in interleaved:
        for s in segments:
            if s["path"] == "stock":
                assert s["hf_ext_hook_seconds"] == {} and s["hf_ext_hook_seconds_per_step"] == 0
                continue
            events = s["hf_ext_hook_seconds"]
            assert {"on_train_begin", "on_step_begin", "on_step_end", "on_train_end"} <= set(events)
            assert s["hf_ext_hook_seconds_per_step"] > 0  # its cost against a run without it: bench_preemption


def test_the_step_tracer_names_hf_ext_code():
    """The tracer behind the next test sees hf-ext's functions when they run, and files them under hf_ext."""
    from hf_ext.deepspeed.resolve import load_deepspeed_config

    tracer = StepCodeTracer()
    sys.setprofile(tracer._profile)
    try:
        load_deepspeed_config("zero2")
    finally:
        sys.setprofile(None)
    assert tracer.hf_ext_functions["resolve.py:load_deepspeed_config"] == 1
    assert tracer.calls["hf_ext"] >= 1


#: the hf-ext functions a training step runs: the loss of a model that averages its own micro-batch, taken over the
#: global batch (hf_ext/loss.py, with the decoder inputs the model would build itself), the preemption agreement
#: (hf_ext/preemption.py: one all-reduce started at the step's begin, waited for at its end) and the token count
#: (hf_ext/trainer.py: stock's, counted once per tensor-parallel group)
STEP_FUNCTIONS = {
    "trainer.py:TrainerMixin.compute_loss", "trainer.py:TrainerMixin._track_num_input_tokens",
    "loss.py:with_decoder_inputs", "loss.py:global_token_mean_loss",
    "loss.py:decoder_inputs_from_labels.<locals>.<lambda>", "preemption.py:PreemptionCallback.on_step_begin",
    "preemption.py:PreemptionCallback.on_step_end", "ranks.py:max_over_ranks", "ranks.py:max_over_ranks.<locals>.result",
    "ranks.py:max_over_ranks.<locals>.result.<locals>.<listcomp>", "ranks.py:_world", "ranks.py:_device",
}  # fmt: skip


@pytest.mark.distributed
def test_only_the_loss_and_the_preemption_agreement_run_inside_a_training_step(interleaved):
    """Every Python call from the first step's begin to the last step's end, counted by package: hf-ext's Trainer and
    TrainingArguments add to the step path only :data:`STEP_FUNCTIONS`, and the step does about the interpreter work
    of stock's (within 1 %; measured +0.1 %: the functions above and one more small all-reduce)."""
    for segments in interleaved:
        calls = {}
        for s in segments:
            assert set(s["hf_ext_functions_in_steps"]) <= (STEP_FUNCTIONS if s["path"] == "hf-ext" else set()), s[
                "path"
            ]
            # the tracer sees the step: the Trainer's loop, accelerate's backward and DeepSpeed's engine
            assert all(s["python_calls_per_step"].get(p, 0) > 0 for p in ("transformers", "accelerate", "deepspeed"))
            calls.setdefault(s["path"], s["python_calls_per_step"])
            # the same path does the same interpreter work in each of its segments
            assert s["python_calls_per_step"] == pytest.approx(calls[s["path"]], rel=0.02)
        # the worker's own instruments (its timers, and HookClock on hf-ext's callbacks) left out
        ours, stock = ({k: v for k, v in calls[p].items() if k != "benchmark"} for p in ("hf-ext", "stock"))
        assert sum(ours.values()) <= 1.01 * sum(stock.values()), (ours, stock)
