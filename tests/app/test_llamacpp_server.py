"""Chat-E served by llama.cpp, for real: ``chat-e`` on a GGUF file, and on a model directory with ``--engine
llamacpp`` (exported once into its ``gguf/`` folder), called through the real OpenAI client and gradio_client. The
oracle is the PyTorch engine on the fp32 model directory, in this process: the same greedy reply through the API, whole
and streamed, cut at a stop string; the feedback rows name the GGUF model; a finished run's model is written as GGUF
from the Train page, promoted (llama.cpp then serves it: its replies are its PyTorch replies) and rolled back."""

from __future__ import annotations

import functools

import gguf
import httpx
import openai
import pytest

from chat_e.data.messages import message_text
from chat_e.feedback.store import DONE, FeedbackStore
from hf_ext.saving.gguf import gguf_fields

from ..conftest import BIN, ROOT
from .support import UI_SETTINGS, ChatEServer, gradio_client, make_sensitive_model, serving

pytestmark = pytest.mark.slow

ADMIN = ("op", "s3cret")
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def models(tiny_chat_model_dir, tmp_path_factory):
    """The served model and a finished run's (two draws of the tiny chat model's weights) and the served one's F16
    GGUF file, written by the installed ``hf-ext export``."""
    import subprocess

    root = tmp_path_factory.mktemp("llamacpp")
    served = make_sensitive_model(tiny_chat_model_dir, root / "served", std=0.5, seed=0)
    run = make_sensitive_model(tiny_chat_model_dir, root / "run-1" / "out", std=0.5, seed=1)
    gguf_file = root / "served.gguf"
    proc = subprocess.run([str(BIN / "hf-ext"), "export", str(served), "--out", str(gguf_file), "--format", "gguf"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return served, run, gguf_file


@functools.cache
def oracle(model_dir, message: str, max_tokens: int = GREEDY["max_tokens"]) -> str:
    """The PyTorch engine's greedy reply (fp32, no int8) to ``message``, as the API checks it and asks for it."""
    from chat_e.data.limits import ChatLimits, check_request
    from chat_e.engines.local import LocalEngine

    engine = LocalEngine.from_pretrained(model_dir)
    settings = engine.default_settings().replace(num_beams=1, do_sample=False, max_new_tokens=max_tokens)
    return engine.reply(check_request(ChatLimits(), message=message).but(settings=settings)).text


def test_a_gguf_file_is_served_by_llama_cpp_with_pytorch_s_replies(models, tmp_path):
    served, _, gguf_file = models
    server = ChatEServer(gguf_file, tmp_path / "gguf.log", model_defaults=True)
    with serving(server):
        client = openai.OpenAI(base_url=f"{server.url}v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [str(gguf_file)]
        want = oracle(served, "What do you do for fun?")
        assert want
        answer = client.chat.completions.create(
            model=str(gguf_file), messages=[{"role": "user", "content": "What do you do for fun?"}], **GREEDY
        )
        assert answer.choices[0].message.content == want
        assert answer.model == str(gguf_file) and answer.usage.completion_tokens == GREEDY["max_tokens"]
        assert answer.choices[0].finish_reason == "length"
        chunks = client.chat.completions.create(
            model=str(gguf_file), messages=[{"role": "user", "content": "What do you do for fun?"}], stream=True,
            **GREEDY,
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        # a stop string: the reply up to it, ended "stop"
        stop = want.split()[1]
        cut = client.chat.completions.create(
            model=str(gguf_file), messages=[{"role": "user", "content": "What do you do for fun?"}], stop=[stop],
            **GREEDY,
        )  # fmt: skip
        assert cut.choices[0].message.content == want[: want.index(stop)]  # OpenAI: the text before the stop string
        assert cut.choices[0].finish_reason == "stop"
        # a rating in the chat UI: its feedback row names the GGUF model
        ui = gradio_client(server.url)
        _, chat, *_ = ui.predict("Hello there!", [], api_name="/add_message")
        chat = ui.predict(chat, "none", "", *UI_SETTINGS, api_name="/respond")
        ui.predict(len(chat) - 1, "like", api_name="/rate")
        rows = FeedbackStore(server.feedback_db).feedback()
        assert [(row["kind"], row["model"]) for row in rows] == [("rating", str(gguf_file))]
        assert message_text(chat[-1]["content"]).strip() == rows[0]["reply"]
    assert "llama.cpp F16" in server.log()


def test_a_run_s_model_as_gguf_promoted_and_rolled_back(models, tmp_path):
    served, run, _ = models
    url = f"sqlite:///{tmp_path}/feedback.db"
    store = FeedbackStore(url)
    run_id = store.add_run(method="sft", settings={"form": {}, "command": [], "base_model": str(served)}, rows=1,
                           rows_sha256="", status=DONE, output_dir=str(run), log_path=str(tmp_path / "train.log"))  # fmt: skip
    store.close()
    server = ChatEServer(served, tmp_path / "served.log", "--engine", "llamacpp", "--admin", ":".join(ADMIN),
                         "--train_dir", str(tmp_path / "train"), model_defaults=True, feedback_db=url)  # fmt: skip
    with serving(server):
        api = openai.OpenAI(base_url=f"{server.url}v1", api_key="unused")

        def reply() -> tuple[str, str]:
            answer = api.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "Tell me about your weekend."}], **GREEDY
            )
            return answer.model, answer.choices[0].message.content

        first = served / "gguf" / "model-f16.gguf"  # written once by the server, from the directory it was given
        assert reply() == (str(first), oracle(served, "Tell me about your weekend."))
        page = gradio_client(f"{server.url}admin/", auth=ADMIN)
        listed = page.predict(run_id, api_name="/export_gguf")
        for kind, gguf_type in (("f16", "F16"), ("q8_0", "Q8_0"), ("q4_k_m", "Q4_K_M")):
            path = run / "gguf" / f"model-{kind}.gguf"
            assert str(path) in listed
            assert gguf.LlamaFileType(gguf_fields(path)["general.file_type"]).name.endswith(gguf_type)
        page.predict(run_id, True, api_name="/promote")
        name, text = reply()
        assert name == f"run-{run_id}-sft" and text == oracle(run, "Tell me about your weekend.")
        assert text != oracle(served, "Tell me about your weekend.")
        page.predict(api_name="/rollback")
        assert reply() == (str(first), oracle(served, "Tell me about your weekend."))
        with pytest.raises(Exception, match="Nothing to roll back to"):
            page.predict(api_name="/rollback")
        assert httpx.get(f"{server.url}v1/models", timeout=30).json()["data"][0]["id"] == str(first)
