"""BLEU generation eval on 2 real ranks (tests/distributed/workers/bleu_eval_worker.py): ZeRO-2 and ZeRO-3 runs,
eval-only and best-model training, agree with one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..bleu_support import N_EVAL, decoded_labels, eval_dataset, read_jsonl
from ..conftest import ROOT, launcher_cmd, run

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "bleu_eval_worker.py"


def launch_worker(model_dir: Path, out: Path, stage: int, *extra: str) -> list[dict]:
    run(launcher_cmd("deepspeed", WORKER) + [
        "--model", str(model_dir), "--out", str(out), "--stage", str(stage), "--n_eval", str(N_EVAL), *extra,
    ])  # fmt: skip
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]


def check_two_ranks_equal_one(results: list[dict], single: dict, tokenizer) -> None:
    for result in results:
        assert result["world_size"] == 2
        metrics = result["eval_only"]
        assert result["eval_only_generations"] == single["generations"]
        for key in ("eval_bleu", "eval_chrf", "eval_gen_len"):
            assert metrics[key] == single["metrics"][key], key
        # (eval_loss is the stock loop's: on 2 ranks it averages per-batch means over a sampler padded to 20 rows)
        assert "eval_loss" in metrics


def test_zero3_two_ranks_uneven_lengths_equal_one_rank(eval_model_dir, tokenizer, single_rank, tmp_path):
    # evaluate, then train with metric_for_best_model="bleu" (stock cannot train after a ZeRO-3 evaluate())
    results = launch_worker(eval_model_dir, tmp_path, 3, "--train_steps", "8", "--eval_steps", "4")
    stats = [r["eval_only_stats"] for r in results]
    # the scenario: ranks hold different numbers of batches and generate to different lengths ...
    assert sorted(s["batches"] for s in stats) == [2, 3]
    assert stats[0]["widths"][: len(stats[1]["widths"])] != stats[1]["widths"][: len(stats[0]["widths"])]
    # ... yet make the same number of generate() calls (synced), finish, and agree with one process
    assert stats[0]["calls"] == stats[1]["calls"] == 3
    check_two_ranks_equal_one(results, single_rank, tokenizer)
    check_best_model(results, tmp_path)


def test_zero2_eval_only_and_best_model(eval_model_dir, tokenizer, single_rank, tmp_path):
    results = launch_worker(eval_model_dir, tmp_path, 2, "--train_steps", "8", "--eval_steps", "4")
    assert not results[0]["engine_after_eval_only"]  # evaluated without building an inference engine
    check_two_ranks_equal_one(results, single_rank, tokenizer)
    rows = read_jsonl(tmp_path / "generations" / "step-0.jsonl")
    dataset = eval_dataset(tokenizer)
    assert [r["index"] for r in rows] == list(range(N_EVAL))
    assert [r["reference"] for r in rows] == decoded_labels(tokenizer, dataset)
    assert [r["generation"] for r in rows] == single_rank["generations"]
    check_best_model(results, tmp_path)


def check_best_model(results: list[dict], out: Path) -> None:
    """metric_for_best_model="bleu" picked the best evaluation and load_best_model_at_end loaded that model."""
    history = results[0]["log_history"]
    evals = [(h["step"], h["eval_bleu"]) for h in history if "eval_bleu" in h]
    assert [step for step, _ in evals] == [4, 8]
    best_step, best_bleu = max(evals, key=lambda e: (e[1], -e[0]))  # ties keep the first
    for result in results:
        assert result["best_metric"] == best_bleu
        assert Path(result["best_model_checkpoint"]).name == f"checkpoint-{best_step}"
        assert result["final"]["eval_bleu"] == best_bleu
    at_best = [r["generation"] for r in read_jsonl(out / "generations" / f"step-{best_step}.jsonl")]
    if best_step != 8:  # the final evaluation rewrote step-8.jsonl; the best one is intact
        assert results[0]["final_generations"] == at_best


def test_decoder_only_zero3_two_ranks_equal_one_rank(tiny_chat_model_dir, tmp_path, tmp_path_factory):
    """A decoder-only chat model (chat-template rows, loss on the reply only): left-padded, bucketed generation under
    ZeRO-3 on 2 ranks gives one process's generations and scores, and the same sample file."""
    from transformers import AutoTokenizer

    from ..app.support import make_sensitive_model
    from ..bleu_support import evaluate_single_rank

    model_dir = make_sensitive_model(tiny_chat_model_dir, tmp_path / "model", std=0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    single = evaluate_single_rank(model_dir, tokenizer, tmp_path_factory)
    assert len(set(single["generations"])) > 3
    results = launch_worker(model_dir, tmp_path / "run", 3)
    check_two_ranks_equal_one(results, single, tokenizer)
    rows = read_jsonl(tmp_path / "run" / "generations" / "step-0.jsonl")
    assert [r["generation"] for r in rows] == single["generations"]
    assert [r["reference"] for r in rows] == decoded_labels(tokenizer, eval_dataset(tokenizer, family="causal"))
