"""Chat-E's OpenAI-compatible API and its ``--backend``, served for real and called with the real ``openai`` client:
a ``chat-e`` subprocess on a tiny chat model, and ``chat-e --backend`` in front of a ``transformers serve``
subprocess on the same model. The oracles are stock transformers' ``generate`` on the tokenizer's chat template, and
``transformers serve``'s own replies."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from chat_e.data.messages import message_text
from chat_e.web.ui import APOLOGY

from ..conftest import BIN, ROOT, free_port, launch_env
from .support import TEST_SETTINGS, ChatEServer, make_sensitive_model, serving, stop_process, wait_until_up

KEY = "k3y-for-the-api"
PERSONA = "I love hiking and my cat."
#: the system messages that select each mode, written out here (the form docs/api.md gives)
SYSTEM = {
    "persona": f"your persona: {PERSONA}",
    "emotion": "context: happy",
    "domain": "domain: travel",
    "topic": "topic: favorite foods",
}
CONTEXT = {"persona": PERSONA, "emotion": "happy", "domain": "travel", "topic": "favorite foods"}
MESSAGE_LIMIT_TEXT = "The message is 2,001 characters long; Chat-E takes up to 2,000. Shorten it and send again."


class TransformersServe:
    """``transformers serve MODEL_DIR`` on a free port (offline: an empty hub cache of its own)."""

    def __init__(self, model_dir: Path, log_path: Path, cache: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        cmd = [str(BIN / "transformers"), "serve", str(model_dir), "--port", str(self.port), "--device", "cpu"]
        env = launch_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> TransformersServe:
        wait_until_up(self.proc, f"{self.url}/models", "transformers serve", self.log_path.read_text, timeout)
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tiny_chat_model_dir, tmp_path_factory):
    """The tiny chat model with large weights, so that its reply depends on everything it is told."""
    return make_sensitive_model(tiny_chat_model_dir, tmp_path_factory.mktemp("openai-model"))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Started side by side: Chat-E on the model (fp32, an API key), ``transformers serve`` on it, Chat-E with
    ``--backend`` in front of that (it reaches its backend only when asked for a reply), and Chat-E with a
    ``--backend`` where nothing listens."""
    logs = tmp_path_factory.mktemp("openai-logs")
    remote = TransformersServe(model_dir, logs / "transformers-serve.log", tmp_path_factory.mktemp("hub-cache"))
    embedded = ChatEServer(model_dir, logs / "embedded.log", "--quantize", "none", api_key=KEY)
    fronted = ChatEServer(model_dir, logs / "backend.log", "--backend", remote.url)
    down = ChatEServer(model_dir, logs / "down.log", "--backend", f"http://127.0.0.1:{free_port()}/v1")
    try:
        remote.wait_ready()
        with serving(embedded, fronted, down) as ready:
            yield {"embedded": ready[0], "backend": ready[1], "down": ready[2], "remote": remote}
    finally:
        remote.stop()


@pytest.fixture(scope="module")
def api(servers):
    return openai.OpenAI(base_url=f"{servers['embedded'].url}v1", api_key=KEY, max_retries=0)


def stock_chat_reply(model_dir, messages: list[dict], **settings) -> str:
    """Stock transformers only: the tokenizer's chat template with the generation prompt, greedy ``generate`` with
    the test servers' settings (``settings`` override them), one thread as they run, the new tokens decoded without
    special tokens."""
    return stock_chat_completion(model_dir, messages, **settings)[0]


def stock_chat_completion(model_dir, messages: list[dict], **settings) -> tuple[str, str]:
    """:func:`stock_chat_reply`, and why stock's ``generate`` stopped in OpenAI's words: "stop" when its last new
    token is one of the model's end tokens, "length" when it made every token it was allowed without one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **{**TEST_SETTINGS, **settings})
    finally:
        torch.set_num_threads(before)
    new = out[0, ids.shape[1] :]
    ends = model.generation_config.eos_token_id
    ends = ends if isinstance(ends, list) else [ends]
    limit = {**TEST_SETTINGS, **settings}["max_new_tokens"]
    finish = "stop" if int(new[-1]) in ends else "length" if len(new) == limit else "unknown"
    return tokenizer.decode(new, skip_special_tokens=True).strip(), finish


def streamed(stream) -> str:
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


CHATS = {
    "free": [{"role": "user", "content": "Hi! What's your name?"}],
    "persona": [{"role": "system", "content": SYSTEM["persona"]}, {"role": "user", "content": "Any plans today?"}],
    "history": [
        {"role": "system", "content": SYSTEM["topic"]},
        {"role": "user", "content": "I'm starving."},
        {"role": "assistant", "content": "Me too!"},
        {"role": "user", "content": "Pizza?"},
    ],
}


@pytest.mark.parametrize("chat", list(CHATS))
def test_replies_equal_stock_generate_streamed_or_not(api, model_dir, chat):
    messages = CHATS[chat]
    expected, finish = stock_chat_completion(model_dir, messages)
    assert expected  # the model says something, so equality means something
    reply = api.chat.completions.create(model=str(model_dir), messages=messages)
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == finish
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    chunks = list(api.chat.completions.create(model=str(model_dir), messages=messages, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert streamed(chunks) == expected and chunks[-1].choices[0].finish_reason == finish


def test_a_reply_cut_at_max_tokens_finishes_with_length_streamed_or_not(api, model_dir):
    """OpenAI's ``finish_reason``: "length" when the reply was cut at ``max_tokens`` (stock's ``generate`` made
    its 2 tokens and no end token)."""
    messages = CHATS["free"]
    expected, finish = stock_chat_completion(model_dir, messages, max_new_tokens=2, min_new_tokens=0)
    assert finish == "length"  # the oracle: stock was cut too
    for tokens in (dict(max_tokens=2), dict(max_completion_tokens=2)):
        reply = api.chat.completions.create(model=str(model_dir), messages=messages, **tokens)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (expected, "length")
    chunks = list(api.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=2, stream=True))
    assert streamed(chunks) == expected and chunks[-1].choices[0].finish_reason == "length"
    # "stop", a reply the model ended: the pretrained chat model's (this random one never ends a reply itself),
    # tests/app/test_app_real_model.py


def test_models_lists_the_served_model(api, model_dir):
    assert [m.id for m in api.models.list()] == [str(model_dir)]


@pytest.mark.parametrize("mode", list(SYSTEM))
def test_the_mode_by_system_message_or_extra_fields_is_the_chat_endpoints(api, servers, mode):
    message = "Tell me something."
    by_endpoint = servers["embedded"].client().predict(message, [], mode, CONTEXT[mode], api_name="/chat")
    system = [{"role": "system", "content": SYSTEM[mode]}, {"role": "user", "content": message}]
    by_system = api.chat.completions.create(model="chat-e", messages=system).choices[0].message.content
    extra = {"mode": mode, "context": CONTEXT[mode]}
    user = [{"role": "user", "content": message}]
    by_fields = api.chat.completions.create(model="chat-e", messages=user, extra_body=extra).choices[0].message.content
    assert by_system == by_fields == by_endpoint
    free = api.chat.completions.create(model="chat-e", messages=user).choices[0].message.content
    assert by_endpoint != free or mode == "emotion"  # the mode reaches the model (an emotion may change nothing)


def test_requests_over_the_limits_or_beyond_chat_e_get_400(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="chat-e", messages=[{"role": "user", "content": "m" * 2001}])
    assert (
        refused.value.body["message"] == MESSAGE_LIMIT_TEXT and refused.value.body["type"] == "invalid_request_error"
    )
    user = [{"role": "user", "content": "hi"}]
    for extra, text, param in [
        (dict(n=9), "^n should be a whole number from 1 to 8", "n"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "does not call tools",
         "tools"),
        # a generation setting is named as the client sent it
        (dict(max_tokens=100_000), "^max_tokens should be a whole number from 1 to", "max_tokens"),
        (dict(max_completion_tokens=100_000), "^max_completion_tokens should be a whole number from 1 to",
         "max_completion_tokens"),
        (dict(temperature=7), "^temperature should be a number from", "temperature"),
        (dict(extra_body={"mode": "poetry"}), "Unknown context mode 'poetry'", None),
        # what Chat-E cannot honour is refused, never ignored
        (dict(seed=2**64), "^seed should be a whole number from", "seed"),
        (dict(presence_penalty=2.5), "^presence_penalty should be a number from -2 to 2", "presence_penalty"),
        (dict(frequency_penalty=-3), "^frequency_penalty should be a number from -2 to 2", "frequency_penalty"),
        (dict(logit_bias={"42": 5}), "does not apply logit_bias", "logit_bias"),
        (dict(response_format={"type": "json_object"}), "plain text only", "response_format"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop takes up to 4 strings", "stop"),
        (dict(stop="s" * 201), "of up to 200 characters", "stop"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="chat-e", messages=user, **extra)
        assert re.search(text, refused.value.body["message"]) and refused.value.body["param"] == param, extra
    # their values that ask for nothing are taken
    neutral = dict(presence_penalty=0, frequency_penalty=0, response_format={"type": "text"}, max_tokens=2)
    assert api.chat.completions.create(model="chat-e", messages=user, **neutral).choices[0].finish_reason


def test_stop_ends_the_reply_before_its_first_stop_string_streamed_or_not(api):
    """OpenAI's ``stop``: the reply up to the first stop string, without it, and ``finish_reason`` "stop"; a stop
    string the reply never holds changes nothing. The oracle is the same server's reply without ``stop``."""
    messages = CHATS["free"]
    whole = api.chat.completions.create(model="chat-e", messages=messages).choices[0].message.content
    middle = len(whole) // 2
    stop = whole[middle : middle + 3]
    expected = whole[: whole.index(stop)]
    assert 0 < len(expected) < len(whole)
    for stops in (stop, ["never in it", stop]):
        reply = api.chat.completions.create(model="chat-e", messages=messages, stop=stops)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (expected, "stop")
    chunks = list(api.chat.completions.create(model="chat-e", messages=messages, stop=[stop], stream=True))
    assert streamed(chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"
    unstopped = api.chat.completions.create(model="chat-e", messages=messages, stop="never in it")
    assert unstopped.choices[0].message.content == whole and unstopped.choices[0].finish_reason != "stop"


def test_seed_n_and_penalties_shape_the_reply(api):
    """``seed`` repeats a sampled reply; ``n`` choices are the replies of seed, seed + 1, ... (streamed: each choice's
    chunks in turn, each naming its index; the usage sums them). The penalties, too small for this model's margins,
    are the engine's test (tests/app/test_app_engine.py) and their arithmetic tests/unit/test_sampling.py's."""
    messages, sampled = CHATS["free"], dict(temperature=2.0, max_tokens=TEST_SETTINGS["max_new_tokens"])
    three = api.chat.completions.create(model="chat-e", messages=messages, n=3, seed=11, **sampled)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    alone = [api.chat.completions.create(model="chat-e", messages=messages, seed=11 + i, **sampled) for i in range(3)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1  # sampled: another seed, another reply
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    stream = api.chat.completions.create(model="chat-e", messages=messages, n=2, seed=11, stream=True,
                                         stream_options={"include_usage": True}, **sampled)  # fmt: skip
    chunks = list(stream)
    order = [c.index for chunk in chunks for c in chunk.choices]
    assert order == sorted(order) and set(order) == {0, 1}  # choice 0's chunks, then choice 1's
    for index in (0, 1):
        parts = [c for chunk in chunks for c in chunk.choices if c.index == index]
        assert "".join(c.delta.content or "" for c in parts) == texts[index]
        assert [c.finish_reason for c in parts if c.finish_reason] == [three.choices[index].finish_reason]
    assert chunks[-1].usage.completion_tokens == sum(a.usage.completion_tokens for a in alone[:2])


def test_the_api_key_is_needed(servers):
    url = f"{servers['embedded'].url}v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    answer = httpx.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert answer.status_code == 401


def test_backend_replies_are_transformers_serves(servers, model_dir):
    """``chat-e --backend`` in front of ``transformers serve``: its streamed reply, and its ``chat`` endpoint's,
    equal the reply ``transformers serve`` streams to the openai client directly for the same messages."""
    remote = openai.OpenAI(base_url=servers["remote"].url, api_key="none", max_retries=0)
    front = openai.OpenAI(base_url=f"{servers['backend'].url}v1", api_key="none", max_retries=0)
    message = "Any plans today?"
    messages = [{"role": "system", "content": SYSTEM["persona"]}, {"role": "user", "content": message}]
    settings = dict(max_tokens=TEST_SETTINGS["max_new_tokens"], temperature=0)
    direct = streamed(remote.chat.completions.create(model=str(model_dir), messages=messages, stream=True, **settings))
    assert direct.strip()
    through = streamed(front.chat.completions.create(model=str(model_dir), messages=messages, stream=True, **settings))
    assert through == direct.strip()
    endpoint = servers["backend"].client().predict(message, [], "persona", PERSONA, api_name="/chat")
    assert endpoint == direct.strip()
    # a seed goes to the backend: its sampled reply for a seed is the one transformers serve gives for that seed
    sampled = dict(max_tokens=TEST_SETTINGS["max_new_tokens"], temperature=2.0)
    for seed in (3, 4):
        direct = streamed(remote.chat.completions.create(model=str(model_dir), messages=messages, stream=True,
                                                         seed=seed, **sampled))  # fmt: skip
        through = front.chat.completions.create(model=str(model_dir), messages=messages, seed=seed, **sampled)
        assert through.choices[0].message.content == direct.strip()


def test_a_backend_that_is_down_gets_an_apology_and_one_log_line_per_request(servers):
    """Chat-E before a backend where nothing listens: the chat user gets the apology (through the UI's events and
    the ``chat`` endpoint), an API client a 500 in OpenAI's shape; each failure is one log line, no traceback, and
    an apology is no reply to give feedback on."""
    from gradio_client.exceptions import AppError

    down = servers["down"]
    client = down.client()
    assert client.predict("Hello?", [], "free", "", api_name="/chat") == APOLOGY
    _, chat, *_ = client.predict("Are you there?", [], api_name="/add_message")
    chat = client.predict(chat, "free", "", 1, False, 1.0, 1.0, 8, 1, api_name="/respond")
    assert message_text(chat[-1]["content"]) == APOLOGY
    with pytest.raises(AppError, match="no reply of this chat's at index 1"):
        client.predict(1, "like", api_name="/rate")
    api = openai.OpenAI(base_url=f"{down.url}v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="could not generate a reply"):
        api.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi?"}], max_tokens=4)
    log = down.log()
    assert "Traceback" not in log
    failures = [line for line in log.splitlines() if "generation failed" in line]
    assert len(failures) == 3, failures  # the chat endpoint, the UI's reply, the API; each names the backend's address
    assert all("127.0.0.1:" in line for line in failures), failures
