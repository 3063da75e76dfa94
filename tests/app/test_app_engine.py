"""LocalEngine on the tiny BlenderBot: context format, truncation, streaming, the three model-dir kinds, precision."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import pytest
import torch

from chat_e.data import dialogue
from chat_e.data.dialogue import normalize_mode
from chat_e.data.limits import Request
from chat_e.engines.local import GenerationSettings, LocalEngine, ModelLoadError

from .support import make_broken_model, make_sensitive_model, mudoconv_prompt, request, stock_seq2seq_reply

GREEDY = dict(num_beams=1, do_sample=False, max_new_tokens=12, min_new_tokens=3)
HISTORY = ["hello, who are you?", "I am a bot. And you?", "a person who likes cats"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LocalEngine:
    return LocalEngine.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def sensitive_dir(tiny_model_dir, tmp_path_factory):
    return make_sensitive_model(tiny_model_dir, tmp_path_factory.mktemp("sensitive"))


@pytest.fixture(scope="module")
def sensitive(sensitive_dir) -> LocalEngine:
    return LocalEngine.from_pretrained(sensitive_dir)


@pytest.mark.parametrize(
    "ui_mode, mode, context",
    [
        ("persona", "persona", "My name is Chat-E. I'm helpful, creative, clever, sarcastic and very friendly."),
        ("emotion", "emotion", "happy"),
        ("domain", "domain", "vacation ideas"),
        ("topic", "topic", "Cats"),
        ("free", "none", "ignored in free chat"),
    ],
)
def test_context_string_and_ids_per_mode(engine, ui_mode, mode, context):
    turns = [*HISTORY, "what do you like?"]
    expected = dialogue.format_context(turns, mode, context)
    assert normalize_mode(ui_mode) == normalize_mode(mode) == mode
    header = dialogue.make_header(mode, context)
    assert (header != "") == (mode != "none") and expected.startswith(header)
    expected_ids = dialogue.encode_history(engine.tokenizer, turns, mode, context, 128)
    for name in (ui_mode, mode):
        assert engine.encode(Request("what do you like?", HISTORY, name, context)) == expected_ids


def test_unknown_mode_is_refused(engine):
    with pytest.raises(ValueError, match="persona, emotion, domain"):
        engine.encode(Request("hi", [], "pirate", "arr"))


def test_truncation_keeps_header_and_newest_turn(engine):
    history = [f"old turn number {i} with a few extra words to fill the window" for i in range(60)]
    newest = "this newest question must survive truncation"
    ids = engine.encode(Request(newest, history, "persona", "I love flowers."))
    assert len(ids) <= engine.max_input_length == 128
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.strip().startswith(dialogue.make_header("persona", "I love flowers."))
    assert text.rstrip("</s>").rstrip().endswith(newest)
    assert "old turn number 59 " in text and "old turn number 0 " not in text


def test_huge_message_is_cut_and_answered(engine, tiny_model_dir):
    """The engine takes a message as given (the request edge cuts what it keeps); the window keeps its newest
    tokens."""
    message = "word " * 20_000 + "the very end"
    ids = engine.encode(Request(message, HISTORY, "domain", "vacation ideas"))
    assert len(ids) <= 128
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert dialogue.make_header("domain", "vacation ideas") in text and text.rstrip().endswith("the very end")
    reply = engine.reply(request(engine, message, HISTORY, "domain", "vacation ideas", **GREEDY)).text
    assert reply and reply == stock_seq2seq_reply(tiny_model_dir, ids, **GREEDY)


@pytest.mark.parametrize(
    "message, history, mode, context",
    [("hi there!", [], "persona", "I like hiking."), ("tell me more", HISTORY[:2], "domain", "vacation ideas")]
    + [("what?", HISTORY, "free", None), ("and then?", HISTORY[1:], "emotion", "happy")],
)
def test_replies_equal_stock_generate_on_the_mudoconv_prompt(
    sensitive, sensitive_dir, message, history, mode, context
):
    """The BlenderBot oracle shares no code with Chat-E: the prompt as MuDoConv writes it, stock ``generate``."""
    reply = sensitive.reply(request(sensitive, message, history, mode, context, **GREEDY)).text
    assert reply and reply == stock_seq2seq_reply(
        sensitive_dir, mudoconv_prompt(message, history, mode, context), **GREEDY
    )


@pytest.mark.parametrize("turn", range(3))
def test_stream_concatenation_equals_chat_under_greedy(sensitive, turn):
    message = ["hi there!", "tell me about your weekend plans", "<b>really?</b> & why"][turn]
    history = HISTORY[: turn + 1]
    pieces = list(sensitive.stream(request(sensitive, message, history, "persona", "I like hiking.", **GREEDY)))
    reply = sensitive.reply(request(sensitive, message, history, "persona", "I like hiking.", **GREEDY)).text
    assert reply and "".join(pieces) == reply
    assert len(pieces) > 1  # it did stream


def test_beam_search_streams_the_whole_reply_at_once(sensitive):
    settings = dict(GREEDY, num_beams=3)
    pieces = list(sensitive.stream(request(sensitive, "hi", [], "emotion", "happy", **settings)))
    assert pieces == [sensitive.reply(request(sensitive, "hi", [], "emotion", "happy", **settings)).text]


def test_closing_the_stream_stops_generation(sensitive):
    """Generation really stops when the reader goes away: the model runs a few more steps, not the whole reply."""
    long = dict(GREEDY, max_new_tokens=100, min_new_tokens=100)
    steps: list[int] = []
    hook = sensitive.model.register_forward_hook(lambda *_: steps.append(1))  # one call per generated token
    try:
        full = "".join(sensitive.stream(request(sensitive, "hi", [], "free", None, **long)))
        full_steps = len(steps)
        steps.clear()
        stream = sensitive.stream(request(sensitive, "hi", [], "free", None, **long))
        first = next(stream)
        stream.close()
        closed_steps = len(steps)
    finally:
        hook.remove()
    assert full_steps == 100 and full.startswith(first)
    assert not [t for t in threading.enumerate() if t.name == "chat-e-generate"]
    assert closed_steps < full_steps // 4, f"{closed_steps} of {full_steps} steps ran after the stream was closed"
    # the reply so far: the text read, the tokens generated before generation stopped, a stop not a length end
    assert stream.reply.text == first and 0 < stream.reply.tokens <= closed_steps
    assert stream.reply.finish_reason == "stop"


def test_defaults_are_blenderbots_and_settings_apply(engine, caplog):
    assert engine.default_settings() == GenerationSettings(
        num_beams=10, do_sample=False, temperature=1.0, top_p=1.0, max_new_tokens=59, min_new_tokens=19
    )
    config = engine.generation_config
    assert (config.length_penalty, config.no_repeat_ngram_size, config.encoder_no_repeat_ngram_size) == (0.65, 3, 3)
    with caplog.at_level(logging.INFO, logger="chat_e.engines.local"):
        engine.reply(request(engine, "hi", [], "free", None, num_beams=2, max_new_tokens=5, min_new_tokens=5))
    assert "new_tokens=5 " in caplog.text
    with pytest.raises(TypeError, match="Unknown generation setting"):
        engine.default_settings().replace(beams=3)


def test_generation_errors_reach_the_caller(tiny_model_dir, tmp_path):
    broken = LocalEngine.from_pretrained(make_broken_model(tiny_model_dir, tmp_path / "broken"))
    with pytest.raises(IndexError):
        broken.reply(request(broken, "hi", **GREEDY))
    with pytest.raises(IndexError):
        list(broken.stream(request(broken, "hi", **GREEDY)))


# ---- the three model-dir kinds ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_dirs(sensitive_dir, tmp_path_factory):
    """A PEFT LoRA adapter on the sensitive tiny model, and the same adapter merged and exported."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForSeq2SeqLM.from_pretrained(sensitive_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    root = tmp_path_factory.mktemp("lora")
    model.save_pretrained(root / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(root / "merged")
    AutoTokenizer.from_pretrained(sensitive_dir).save_pretrained(root / "merged")
    return root / "adapter", root / "merged"


def _logits(engine: LocalEngine) -> torch.Tensor:
    ids = torch.tensor([engine.encode(Request("how are you?", HISTORY, "persona", "I like cats."))])
    with torch.no_grad():
        return engine.model(input_ids=ids, decoder_input_ids=torch.tensor([[1, 5, 9]])).logits.float()


def test_loads_a_16_bit_save(sensitive_dir, sensitive, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    AutoModelForSeq2SeqLM.from_pretrained(sensitive_dir, dtype=torch.bfloat16).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(sensitive_dir).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    engine = LocalEngine.from_pretrained(tmp_path)
    assert next(engine.model.parameters()).dtype == torch.float32  # served in fp32 unless asked
    assert engine.info["kind"] == "model"
    source = sensitive.model.state_dict()
    for name, value in engine.model.state_dict().items():  # the 16-bit weights, upcast
        assert torch.equal(value, source[name].to(torch.bfloat16).float()), name
    reply = engine.reply(request(engine, "hi", **GREEDY)).text
    assert reply and reply == stock_seq2seq_reply(tmp_path, mudoconv_prompt("hi"), dtype=torch.float32, **GREEDY)


def test_loads_an_adapter_and_an_exported_merge_alike(lora_dirs, sensitive, sensitive_dir):
    adapter_dir, merged_dir = lora_dirs
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        sensitive_dir
    )
    adapter = LocalEngine.from_pretrained(adapter_dir)
    merged = LocalEngine.from_pretrained(merged_dir)
    assert adapter.info["kind"] == "base + adapter" and adapter.info["base"] == str(sensitive_dir)
    assert "adapter on" in adapter.describe()
    assert merged.info["kind"] == "model"
    torch.testing.assert_close(_logits(adapter), _logits(merged), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(_logits(adapter), _logits(sensitive), atol=1e-3)  # the adapter is applied
    assert (
        adapter.reply(request(adapter, "hi", HISTORY, "emotion", "sad", **GREEDY)).text
        == merged.reply(request(merged, "hi", HISTORY, "emotion", "sad", **GREEDY)).text
    )


def test_load_errors_name_the_path(tmp_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match=str(tmp_path / "missing")):
        LocalEngine.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LocalEngine.from_pretrained(tmp_path / "empty")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text(json.dumps({"model_type": "blenderbot"}))
    with pytest.raises(ModelLoadError, match="no weights"):
        LocalEngine.from_pretrained(tmp_path / "weightless")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=f"Could not load the model in {corrupt}"):
        LocalEngine.from_pretrained(corrupt)
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "no-base"), "peft_type": "LORA"})
    )
    (tmp_path / "orphan" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no-base"):
        LocalEngine.from_pretrained(tmp_path / "orphan")


# ---- serving precision ------------------------------------------------------------------------------------------


def test_bf16_and_int8(tiny_model_dir, sensitive_dir):
    prompt = ("hi, how are you?", HISTORY[:2], "persona", "I like cats.")
    bf16 = LocalEngine.from_pretrained(sensitive_dir, dtype="bf16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    reply = bf16.reply(request(bf16, *prompt, **GREEDY)).text
    assert reply and reply == stock_seq2seq_reply(
        sensitive_dir, mudoconv_prompt(*prompt), dtype=torch.bfloat16, **GREEDY
    )
    int8 = LocalEngine.from_pretrained(sensitive_dir, quantize="int8")
    reply = int8.reply(request(int8, *prompt, **GREEDY)).text
    assert reply and reply == stock_seq2seq_reply(sensitive_dir, mudoconv_prompt(*prompt), int8=True, **GREEDY)
    int8 = LocalEngine.from_pretrained(tiny_model_dir, quantize="int8")
    modules = list(int8.model.modules())
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in modules)
    assert not any(type(m) is torch.nn.Linear for m in modules)
    assert int8.info["parameters"] == LocalEngine.from_pretrained(tiny_model_dir).info["parameters"]
    assert "int8" in int8.describe()
    with pytest.raises(ValueError, match="drop --dtype bf16"):
        LocalEngine.from_pretrained(tiny_model_dir, dtype="bf16", quantize="int8")


# ---- decoder-only chat models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_sensitive_dir(tiny_chat_model_dir, tmp_path_factory):
    return make_sensitive_model(tiny_chat_model_dir, tmp_path_factory.mktemp("chat_sensitive"), std=0.5)


@pytest.fixture(scope="module")
def chat_engine(chat_sensitive_dir) -> LocalEngine:
    return LocalEngine.from_pretrained(chat_sensitive_dir)


def _stock_reply(model_dir, messages, int8_mlp: bool = False, **generate_kwargs) -> str:
    """The oracle: stock transformers on the tokenizer's own chat template, only the new tokens decoded;
    ``int8_mlp``: torch's dynamic int8 quantization of the feed-forward (``mlp``) Linear layers first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if int8_mlp:
        mlp = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".mlp." in n}
        model = torch.ao.quantization.quantize_dynamic(model, mlp, dtype=torch.qint8)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_chat_model_replies_equal_stock_generate_on_the_chat_template(chat_engine, chat_sensitive_dir):
    assert chat_engine.family == "causal"
    messages = [
        {"role": "system", "content": "your persona: I like cats."},
        {"role": "user", "content": HISTORY[0]},
        {"role": "assistant", "content": HISTORY[1]},
        {"role": "user", "content": HISTORY[2]},
    ]
    reply = chat_engine.reply(request(chat_engine, HISTORY[2], HISTORY[:2], "persona", "I like cats.", **GREEDY)).text
    stock = _stock_reply(
        chat_sensitive_dir, messages, do_sample=False, max_new_tokens=12, min_new_tokens=3, repetition_penalty=1.2
    )
    assert reply == stock and reply
    # the model's own defaults apply (a repetition penalty against greedy loops), lengths count new tokens only
    defaults = chat_engine.default_settings()
    assert (defaults.num_beams, defaults.max_new_tokens) == (1, 32)
    assert chat_engine.generation_config.repetition_penalty == 1.2


@pytest.mark.parametrize("turn", ["hello there", "what is your favourite food?"])
def test_chat_model_stream_concatenation_equals_chat(chat_engine, turn):
    pieces = list(chat_engine.stream(request(chat_engine, turn, HISTORY, "emotion", "happy", **GREEDY)))
    assert len(pieces) > 1
    assert "".join(pieces) == chat_engine.reply(request(chat_engine, turn, HISTORY, "emotion", "happy", **GREEDY)).text


def test_chat_model_replies_depend_on_the_mode(chat_engine):
    replies = {
        mode: chat_engine.reply(request(chat_engine, "hello there", [], mode, "cats", **GREEDY)).text
        for mode in ("persona", "domain")
    }
    replies["free"] = chat_engine.reply(request(chat_engine, "hello there", [], "free", None, **GREEDY)).text
    assert len(set(replies.values())) == 3


def test_chat_model_adapter_int8_and_window(chat_sensitive_dir, chat_engine, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(chat_sensitive_dir), lora)
    model.save_pretrained(tmp_path / "adapter")
    adapter = LocalEngine.from_pretrained(tmp_path / "adapter")
    assert adapter.info["kind"] == "base + adapter" and adapter.family == "causal"
    merged = model.merge_and_unload().eval()
    ids = torch.tensor([adapter.encode(Request("hi", HISTORY, "domain", "food"))])
    with torch.no_grad():
        torch.testing.assert_close(adapter.model(ids).logits, merged(ids).logits, atol=1e-4, rtol=1e-4)
    int8 = LocalEngine.from_pretrained(chat_sensitive_dir, quantize="int8")
    kinds = {name: type(module) for name, module in int8.model.named_modules()}
    # the feed-forward layers are int8; the attention projections and the tied output head stay fp32
    assert "quantized" in kinds["model.layers.0.mlp.up_proj"].__module__
    assert kinds["model.layers.0.self_attn.q_proj"] is torch.nn.Linear and kinds["lm_head"] is torch.nn.Linear
    reply = int8.reply(request(int8, "hi", **GREEDY)).text
    stock = _stock_reply(
        chat_sensitive_dir,
        [{"role": "user", "content": "hi"}],
        int8_mlp=True,
        do_sample=False,
        max_new_tokens=12,
        min_new_tokens=3,
        repetition_penalty=1.2,
    )
    assert reply and reply == stock
    # the prompt leaves room for the reply in the model's 256 positions
    assert chat_engine.max_input_length == 128
    long_history = [f"turn {i} with several words in it" for i in range(100)]
    assert len(chat_engine.encode(Request("newest", long_history, "persona", "I like cats."))) <= 128


def test_regenerate_samples_under_greedy_settings_and_offers_a_choice_only_between_different_replies(sensitive):
    """Regenerate answers the same prompt again: under settings that cannot vary (greedy here) it samples, so the
    choice "Which reply is better?" is between two replies; an equal pair is never offered."""
    from chat_e.web.ui import FeedbackControls, Handlers

    handlers = Handlers(sensitive)
    greedy = (1, False, 1.0, 1.0, 8, 1)  # the respond endpoint's settings, in GenerationSettings' order
    chat = [{"role": "user", "content": "Hello, how are you?"}]
    *_, (shown, records) = handlers.respond_event(chat, "free", "", *greedy, {})
    first = records[1]
    assert first["settings"]["do_sample"] is False and "previous" not in first
    again = handlers.regenerate(shown)
    assert again == chat
    torch.manual_seed(0)
    *_, (shown, records) = handlers.respond_event(again, "free", "", *greedy, records)
    second = records[1]
    assert second["settings"]["do_sample"] is True and second["settings"]["num_beams"] == 1  # it sampled
    assert second["reply"] != first["reply"] and second["previous"]["reply"] == first["reply"]
    assert FeedbackControls.offer_choice(records)["visible"] is True
    # sampling the user asked for, twice with one seed: the same reply, so no choice is offered
    sampled = (1, True, 1.0, 1.0, 8, 1)
    torch.manual_seed(1)
    *_, (shown, records) = handlers.respond_event(handlers.regenerate(shown), "free", "", *sampled, records)
    third = records[1]
    torch.manual_seed(1)
    *_, (_, records) = handlers.respond_event(handlers.regenerate(shown), "free", "", *sampled, records)
    assert records[1]["reply"] == third["reply"] and "previous" not in records[1]
    assert FeedbackControls.offer_choice(records)["visible"] is False


def test_a_swap_serves_the_next_reply_and_the_one_under_way_finishes_on_its_model(sensitive, engine):
    """The Train page's Promote (chat_e.engines.switch): a stream started before the swap ends as the model it began
    on would have it, named by that model; the next reply is the new model's, named by it."""
    from chat_e.engines.gate import GatedEngine
    from chat_e.engines.switch import SwitchableEngine

    switch = SwitchableEngine(sensitive)
    served = GatedEngine(switch, concurrency=2)
    settings = sensitive.default_settings().replace(**GREEDY)
    stream = served.stream(request(served, "hello, who are you?", HISTORY[:1], "none", None, settings))
    assert stream.model == sensitive.name
    first = next(stream)
    assert switch.swap(engine) is sensitive and served.name == engine.name
    rest = "".join(stream)
    assert rest  # the swap came in the middle of the reply
    assert (
        first + rest
        == sensitive.reply(request(sensitive, "hello, who are you?", HISTORY[:1], "none", None, settings)).text
    )
    assert stream.reply.model == sensitive.name and stream.reply.text == first + rest
    reply = served.reply(request(served, "hello, who are you?", HISTORY[:1], "none", None, settings))
    assert reply.text == engine.reply(request(engine, "hello, who are you?", HISTORY[:1], "none", None, settings)).text
    assert reply.model == engine.name != sensitive.name


def test_openai_penalties_break_the_greedy_loop_of_a_random_model(tiny_chat_model_dir):
    """The random-init chat model's greedy reply repeats one token (a newline) to its limit; OpenAI's penalties,
    applied to the reply generated so far (chat_e.engines.sampling), make every token of it a new one."""
    from chat_e.data.settings import RequestSampling

    engine = LocalEngine.from_pretrained(tiny_chat_model_dir)
    settings = dict(num_beams=1, do_sample=False, max_new_tokens=16, min_new_tokens=1)
    looped = engine.reply(request(engine, "Hi! What's your name?", **settings))
    assert looped.tokens == 16 and looped.text == ""  # 16 whitespace tokens, stripped
    penalties = RequestSampling(presence_penalty=2.0, frequency_penalty=2.0)
    done = engine.reply(request(engine, "Hi! What's your name?", sampling=penalties, **settings))
    ids = engine.tokenizer(done.text, add_special_tokens=False)["input_ids"]
    assert done.text and len(set(ids)) == len(ids) > 8 and done.tokens > 8
