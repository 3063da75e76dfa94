"""The API-latency bench: its statistics, and one short run against a real ``chat-e`` server on the tiny chat model."""

import json

import pytest

from benchmarks import bench_api


def test_summary_gives_each_path_its_statistics_and_its_ratio_to_gradio():
    totals = {"gradio": [1.0, 2.0, 3.0], "api": [0.5, 1.0, 1.5], "api-stream": [1.0, 2.0, 3.0]}
    requests = [
        {"path": path, "round": i, "total_s": t, "first_text_s": t / 4 if path == "api-stream" else None,
         "generate_s": 0.4}
        for path, values in totals.items()
        for i, t in enumerate(values)
    ]  # fmt: skip
    results = bench_api.summarize(requests)
    assert list(results) == list(bench_api.PATHS)
    assert results["gradio"]["total"] == {"median_s": 2.0, "p90_s": 2.8, "min_s": 1.0, "max_s": 3.0}
    assert results["api"]["median_vs_gradio"] == 0.5
    assert results["api"]["per_round_ratio_vs_gradio"][0] == pytest.approx(0.5)
    assert results["gradio"]["first_text"] is None and results["api-stream"]["first_text"]["median_s"] == 0.5
    assert results["api-stream"]["server_generate"]["median_s"] == 0.4
    assert results["api"]["overhead"]["median_s"] == pytest.approx(0.6)  # each total less its generation time
    table = bench_api.markdown(results)
    assert "| /v1/chat/completions (openai) | 1.000 | 1.400 | 0.50 | 0.50 (0.50–0.50) |" in table
    assert "(whole reply)" in table


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny chat model with its weight matrices redrawn at std 1: at its initial scale the greedy reply is
    whitespace only, which would make "the same reply" hold trivially; at this scale it is 32 tokens of text."""
    import torch
    from transformers import AutoModelForCausalLM

    from chat_e.data.models import build_chat_model

    model_dir = build_chat_model(tmp_path_factory.mktemp("models") / "chat-tiny", "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen))
    model.save_pretrained(model_dir)
    return model_dir


def test_three_requests_per_path_through_a_real_server_give_one_reply(chat_model_dir, tmp_path):
    out = tmp_path / "api.json"
    bench_api.main(["--model", str(chat_model_dir), "--requests", "3", "--warmup", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["same_reply"] is True and len(report["replies"]) == 1 and report["replies"][0].strip()
    assert report["requests_per_path"] == 3 and len(report["requests"]) == 9
    assert report["server"]["generations_logged"] == 12  # (1 warm-up + 3) rounds x 3 paths, one reply each
    assert report["new_tokens_logged"] == [32]  # every reply exactly --new_tokens long
    assert set(report["results"]) == set(bench_api.PATHS)
    for path, result in report["results"].items():
        assert result["requests"] == 3
        assert 0 < result["total"]["median_s"] <= result["total"]["p90_s"] <= result["total"]["max_s"]
        assert result["server_generate"]["median_s"] <= result["total"]["max_s"]
        assert result["overhead"]["median_s"] > 0  # the server's generation time lies within the client's
        assert (result["first_text"] is not None) == (path == "api-stream")
    stream = report["results"]["api-stream"]
    assert stream["first_text"]["median_s"] <= stream["total"]["median_s"]
    assert report["results"]["gradio"]["median_vs_gradio"] == 1.0
    rounds = [(r["round"], r["path"]) for r in report["requests"]]
    assert rounds[:3] == [(1, "api"), (1, "api-stream"), (1, "gradio")]  # the order rotates round by round
    assert report["command"].startswith("python -m benchmarks.bench_api --model ")
