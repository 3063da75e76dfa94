"""BLEU generation eval on 2 real ranks (tests/distributed/workers/bleu_eval_worker.py): ZeRO-2 and ZeRO-3 runs,
eval-only and best-model training, agree with one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ..bleu_support import N_EVAL, decoded_labels, eval_dataset, read_jsonl
from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "workers" / "bleu_eval_worker.py"


def launch_worker(model_dir: Path, out: Path, stage: int, *extra: str) -> list[dict]:
    run(launcher_cmd(TRAIN_LAUNCHER, WORKER) + [
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


@pytest.fixture(scope="module")
def per_token_run(eval_model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    """ZeRO-3, 2 ranks, generation on the partitioned model (a gather per layer per decoding step): evaluate, train
    with metric_for_best_model="bleu" (stock cannot train after a ZeRO-3 evaluate()), a final beam-search eval."""
    out = tmp_path_factory.mktemp("per_token")
    return launch_worker(eval_model_dir, out, 3, "--train_steps", "8", "--eval_steps", "4", "--gather", "false",
                         "--final_beams", "3"), out  # fmt: skip


def test_zero3_two_ranks_uneven_lengths_equal_one_rank(per_token_run, tokenizer, single_rank):
    results, out = per_token_run
    stats = [r["eval_only_stats"] for r in results]
    assert {s["path"] for s in stats} == {"per-token gathers"}
    # the scenario: ranks hold different numbers of batches and generate to different lengths ...
    assert sorted(s["batches"] for s in stats) == [2, 3]
    assert stats[0]["widths"][: len(stats[1]["widths"])] != stats[1]["widths"][: len(stats[0]["widths"])]
    # ... yet make the same number of generate() calls (synced), finish, and agree with one process
    assert stats[0]["calls"] == stats[1]["calls"] == 3
    check_two_ranks_equal_one(results, single_rank, tokenizer)
    check_best_model(results, out, final_as_during_training=False)  # the final evaluation searches 3 beams


def test_zero3_gathered_once_generates_the_same_and_training_continues_bit_identically(
    per_token_run, eval_model_dir, tokenizer, single_rank, tmp_path
):
    """The same run with the weights gathered once per evaluation: the same generations (greedy and beam search),
    no synced calls, and the checkpoints written after each evaluation are bit-identical to the per-token run's
    (nothing of the gathered copy leaks into the partitioned parameters)."""
    from safetensors.torch import load_file

    per_token, per_token_out = per_token_run
    results = launch_worker(eval_model_dir, tmp_path, 3, "--train_steps", "8", "--eval_steps", "4", "--gather",
                            "true", "--final_beams", "3")  # fmt: skip
    for gathered, reference in zip(results, per_token):
        stats = gathered["eval_only_stats"]
        assert stats["path"] == "gathered once" and stats["calls"] == stats["batches"]  # no synced extra calls
        assert gathered["final_stats"]["path"] == "gathered once"
        assert gathered["eval_only_generations"] == reference["eval_only_generations"] == single_rank["generations"]
        assert gathered["final_generations"] == reference["final_generations"]  # beam search, after training
        for key in ("eval_bleu", "eval_chrf", "eval_gen_len"):
            assert gathered["final"][key] == reference["final"][key]
        assert eval_scores(gathered["log_history"]) == eval_scores(reference["log_history"])
    assert len({r["final_generations"][0] for r in results}) == 1
    for step in (4, 8):
        ours = load_file(tmp_path / f"checkpoint-{step}" / "model.safetensors")
        theirs = load_file(per_token_out / f"checkpoint-{step}" / "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), step
    check_best_model(results, tmp_path, final_as_during_training=False)


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


def eval_scores(history: list[dict]) -> list[dict]:
    """The evaluations of a log history without their timings."""
    timing = ("runtime", "per_second", "_time")
    return [{k: v for k, v in h.items() if k.startswith("eval_") and not any(t in k for t in timing)}
            for h in history if "eval_bleu" in h]  # fmt: skip


def check_best_model(results: list[dict], out: Path, final_as_during_training: bool = True) -> None:
    """metric_for_best_model="bleu" picked the best evaluation and load_best_model_at_end loaded that model: the
    weights after training are the best checkpoint's, bit for bit, and the final evaluation, when it generates as the
    evaluations during training did, scores and generates as the best one did."""
    from safetensors.torch import load_file

    history = results[0]["log_history"]
    evals = [(h["step"], h["eval_bleu"]) for h in history if "eval_bleu" in h]
    assert [step for step, _ in evals] == [4, 8]
    best_step, best_bleu = min(evals, key=lambda e: (e[1], e[0]))  # greater_is_better=False; ties keep the first
    assert best_step == 4, evals  # BLEU rose: the best is not the last, which loading it must undo
    for result in results:
        assert result["best_metric"] == best_bleu
        assert Path(result["best_model_checkpoint"]).name == f"checkpoint-{best_step}"
    after = torch.load(out / "after_train.pt")
    best = load_file(out / f"checkpoint-{best_step}" / "model.safetensors")
    common = sorted(set(best) & set(after))  # every parameter stored (tied ones once); the rest are buffers
    assert len(common) > 50 and set(best) - set(after) <= {"final_logits_bias"}
    assert [name for name in common if not torch.equal(after[name], best[name])] == []
    last = load_file(out / "checkpoint-8" / "model.safetensors")
    assert any(not torch.equal(after[name], last[name]) for name in common)  # loading the best changed the weights
    if not final_as_during_training:
        return
    for result in results:
        assert result["final"]["eval_bleu"] == best_bleu
    at_best = [r["generation"] for r in read_jsonl(out / "generations" / f"step-{best_step}.jsonl")]
    assert results[0]["final_generations"] == at_best  # step-4.jsonl: the final evaluation rewrote step-8.jsonl


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
    results = launch_worker(model_dir, tmp_path / "run", 3)  # generation_gather_weights="auto": room to gather
    assert {r["eval_only_stats"]["path"] for r in results} == {"gathered once"}
    check_two_ranks_equal_one(results, single, tokenizer)
    rows = read_jsonl(tmp_path / "run" / "generations" / "step-0.jsonl")
    assert [r["generation"] for r in rows] == single["generations"]
    assert [r["reference"] for r in rows] == decoded_labels(tokenizer, eval_dataset(tokenizer, family="causal"))
