"""recipes/preference.py on 2 ranks under ZeRO-2, on the tiny random-init chat model with the
offline SPIN pairs: DPO makes the model itself prefer the human reply on held-out pairs (its own log-probability, the
same measure before and after), the model's own replies are generated once
and reused from the cache, KTO trains too, and the output loads as Chat-E serves it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from chat_e.engines.local import LocalEngine

from ..app.support import request
from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run

pytestmark = pytest.mark.distributed

RECIPE = ROOT / "recipes" / "preference.py"
CONFIG = ROOT / "recipes" / "configs" / "preference_tiny.yaml"
RUNS = {
    # name: (launcher, extra flags); the runs share one cache directory: KTO's reuses the DPO run's model replies.
    # ZeRO-2 as hf-ext's preset, which DeepSpeed's launcher (make demo-preference's) implies (the blenderbot recipe's
    # deepspeed-zero2 run in tests/distributed/test_recipe_distributed.py shows it)
    "dpo": (TRAIN_LAUNCHER, ["--deepspeed", "zero2"]),
    # KTO with its SFT term on the desirable replies (hf_ext.trl.KTOConfig.sft_weight), as the Train page's kto+sft
    "kto": (TRAIN_LAUNCHER, ["--loss", "kto", "--max_steps", "6", "--sft_weight", "1"]),
}


@pytest.fixture(scope="module")
def preference_runs(tiny_chat_model_dir, tmp_path_factory):
    """Each launch happens once, on first use, in the order the tests ask: (output dir, log)."""
    cache_dir = tmp_path_factory.mktemp("spin_cache")
    done: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            launcher, extra = RUNS[name]
            cmd = launcher_cmd(launcher, RECIPE) + [
                "--config", str(CONFIG), "--model_name_or_path", str(tiny_chat_model_dir),
                "--spin_cache_dir", str(cache_dir), "--output_dir", str(out), *extra,
            ]  # fmt: skip
            proc = run(cmd)
            done[name] = (out, proc.stdout + proc.stderr)
        return done[name]

    return get


def metrics(out: Path) -> dict:
    return json.loads((out / "preference_metrics.json").read_text())


def test_dpo_on_spin_pairs_prefers_the_human_reply_after_training(preference_runs):
    out, log = preference_runs("dpo")
    report = metrics(out)
    assert report["loss"] == "dpo" and report["steps"] == 12 and report["eval_rows"] >= 24
    before, after = report["before"], report["after"]
    # the model's own preference, the same measure before and after (not 0 by construction, as TRL's implicit reward
    # accuracy is): DPO moves it towards the human reply
    for metrics_ in (before, after):
        assert metrics_["preferred_sum"]["n"] == report["eval_rows"] and metrics_["rows"] == report["eval_rows"]
        assert 0 < metrics_["reply_nll"] < 20
    assert 0 < before["preferred_sum"]["k"] < after["preferred_sum"]["k"]
    assert after["preferred_per_token"]["k"] > before["preferred_per_token"]["k"]
    assert after["reply_nll"] < before["reply_nll"]
    assert json.loads((out / "train_results.json").read_text())["run"]["zero_stage"] == 2
    assert "prefers chosen (summed)" in log and "preferred reply NLL/token" in log  # the printed table
    assert "SPIN: generating the model's replies" in log


def test_a_rerun_reuses_the_cached_model_replies(preference_runs):
    first, first_log = preference_runs("dpo")
    generated = re.search(r"SPIN: generating the model's replies to (\d+) contexts .* -> (\S+)", first_log)
    count, cache = int(generated[1]), Path(generated[2])
    written = cache.stat().st_mtime_ns
    assert len(cache.read_text().splitlines()) == count
    again, log = preference_runs("kto")  # the same model, corpus and contexts: the same replies, whatever the loss
    assert f"SPIN: reusing {count} cached model replies from {cache}" in log
    assert "SPIN: generating" not in log
    assert cache.stat().st_mtime_ns == written
    # the same held-out human replies: the rerun's "before" NLL of them is the first run's
    assert metrics(again)["before"]["reply_nll"] == pytest.approx(metrics(first)["before"]["reply_nll"])


def test_kto_trains_and_reports_before_and_after(preference_runs):
    out, log = preference_runs("kto")
    report = metrics(out)
    assert report["loss"] == "kto" and report["steps"] == 6
    assert report["eval_rows"] % 2 == 0  # each held-out pair: the human reply (True) and the model's (False)
    before, after = report["before"], report["after"]
    for metrics_ in (before, after):  # each held-out pair's human reply against the model's, on one prompt
        assert metrics_["pairing"] == "desirable against undesirable, same prompt"
        assert metrics_["preferred_sum"]["n"] == report["eval_rows"] // 2
    assert after["preferred_sum"]["k"] > before["preferred_sum"]["k"]
    assert "prefers chosen (desirable) (summed)" in log
    # the SFT term ran on both ranks, was logged, and made the held-out human replies likelier
    assert report["sft_weight"] == 1 and "'sft_loss':" in log and "+ 1 x SFT on the desirable replies" in log
    assert after["reply_nll"] < before["reply_nll"]


def test_the_output_serves_in_chat_e(preference_runs):
    out, _ = preference_runs("dpo")
    engine = LocalEngine.from_pretrained(str(out), device="cpu")
    reply = engine.reply(
        request(engine, "Hi! How was your weekend?", [], "topic", "Weekends", engine.default_settings())
    ).text
    assert isinstance(reply, str)
