"""``chat-e eval`` end to end on the tiny chat model: the report (JSON, table, plot) of two models, its counts, its
NLL against transformers' own loss, and the paired differences of a model with itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_e.data import adherence
from chat_e.data.corpora import load_offline, sample
from chat_e.data.dialogue import encode_example

from ..conftest import ROOT, run

N_NLL = 12


@pytest.fixture(scope="module")
def report(tiny_chat_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    model = str(tiny_chat_model_dir)
    proc = run([sys.executable, "-m", "chat_e", "eval", "--model", model, "--model", model, "--output_dir", str(out),
                "--n_nll", str(N_NLL), "--quantize", "none", "--max_new_tokens", "16"])  # fmt: skip
    return out, json.loads((out / "eval.json").read_text()), proc.stdout


def test_the_report_scores_every_probe_and_writes_its_table_and_plot(report):
    out, doc, stdout = report
    assert (out / "eval.png").stat().st_size > 10_000
    table = (out / "eval.md").read_text()
    assert table.strip() in stdout and "| instructions, strict |" in table and "difference (2nd − 1st)" in table
    first = doc["models"][0]
    assert len(first["replies"]) == len(adherence.PROMPTS) + len(adherence.MODE_PROBES)
    shares = first["shares"]
    assert shares["instruction_strict"]["n"] == len(adherence.PROMPTS) >= 60
    assert shares["mode"]["n"] == len(adherence.MODE_PROBES)
    assert {"mode:persona", "mode:emotion", "mode:domain", "mode:topic"} <= set(shares)
    assert first["nll_rows"] == N_NLL and len(first["items"]["nll"]) == N_NLL


def test_the_nll_is_transformers_own_loss_on_the_held_out_human_replies(report, tiny_chat_model_dir):
    _, doc, _ = report
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir).eval()
    rows = sample(load_offline("chitchat+chatterbot", seed=42)["validation"], N_NLL, 42)
    for row, got in zip(list(rows)[:4], doc["models"][0]["items"]["nll"]):
        example = encode_example(tokenizer, row["texts"], row["labels"], 96, 32, "causal")
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([example["input_ids"]]), labels=torch.tensor([example["labels"]])).loss
        # float32 logits; the report sums each token's log-probability in float64
        assert got == pytest.approx(float(loss), rel=1e-5)


def test_a_model_against_itself_differs_by_nothing(report):
    _, doc, _ = report
    assert doc["models"][0]["replies"] == doc["models"][1]["replies"]  # greedy: the same replies
    for key, d in doc["differences"].items():
        assert d["diff"] == d["low"] == d["high"] == 0, key
    assert doc["worse"] == []


def test_three_models_are_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "chat_e", "eval", "--model", "a", "--model", "b", "--model", "c"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "chat-e eval: error: give one or two --model, not 3."
    )
