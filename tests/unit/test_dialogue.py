"""The MuDoConv context format: headers, joins, parsing, and left truncation that keeps the newest turn."""

import pytest

from chat_e.data.dialogue import (
    HEADER_JOIN,
    IGNORE_INDEX,
    MODES,
    TURN_JOIN,
    encode_context,
    encode_example,
    encode_history,
    encode_texts,
    family_of,
    format_context,
    make_header,
    parse_header,
    parse_texts,
)

MUDOCONV_EXAMPLE = (
    "your persona: i've 2 kids. i love flowers. </s>  <s> I like acting, I hope to be an actor, what about you? "
    "</s> <s> that is ok.  have any kids?"
)


def test_headers_per_mode():
    assert make_header("persona", "i love flowers.") == "your persona: i love flowers. </s>"
    assert make_header("emotion", "happy") == "context: happy"
    assert make_header("domain", "vacation ideas") == "domain: vacation ideas"
    assert make_header("topic", "Flowers") == "topic: Flowers"
    assert make_header("none", "ignored") == ""
    assert make_header("persona", "   ") == ""
    with pytest.raises(ValueError, match="persona"):
        make_header("free")


def test_format_matches_mudoconv_layout():
    texts = format_context(["I like acting.", "that is ok."], "persona", "i love flowers.")
    assert texts == "your persona: i love flowers. </s>" + HEADER_JOIN + "I like acting." + TURN_JOIN + "that is ok."
    assert format_context(["hi", "hello"]) == "hi" + TURN_JOIN + "hello"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_parse_inverts_format(mode):
    turns = ["Hello there!", "Hi, how are you?", "Fine  thanks."]
    header, parsed = parse_texts(format_context(turns, mode, "some context"))
    assert header == make_header(mode, "some context")
    assert parsed == ["Hello there!", "Hi, how are you?", "Fine thanks."]


def test_parse_real_mudoconv_row():
    header, turns = parse_texts(MUDOCONV_EXAMPLE)
    assert header == "your persona: i've 2 kids. i love flowers. </s>"
    assert turns == ["I like acting, I hope to be an actor, what about you?", "that is ok.  have any kids?"]


def test_short_context_is_not_truncated(tiny_tokenizer):
    ids = encode_texts(tiny_tokenizer, MUDOCONV_EXAMPLE, max_length=128)
    plain = tiny_tokenizer(MUDOCONV_EXAMPLE.replace("  have", " have"))["input_ids"]
    assert len(ids) <= 128
    assert ids[-1] == tiny_tokenizer.eos_token_id
    assert (
        tiny_tokenizer.decode(ids, skip_special_tokens=True).split()
        == tiny_tokenizer.decode(plain, skip_special_tokens=True).split()
    )


def test_left_truncation_keeps_header_and_newest_turns(tiny_tokenizer):
    turns = [f"old turn number {i} with some words about flowers and cats" for i in range(40)] + ["NEWEST question?"]
    ids = encode_history(tiny_tokenizer, turns, "persona", "i love flowers.", max_length=64)
    assert len(ids) <= 64
    text = tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.lstrip().startswith("your persona: i love flowers.")
    assert text.rstrip().endswith("NEWEST question?</s>")
    assert "number 0 " not in text  # the oldest turns went first
    kept = [i for i in range(40) if f"number {i} " in text]
    assert kept and kept == list(range(kept[0], 40))  # a contiguous run of the newest old turns


def test_single_overlong_turn_keeps_its_end(tiny_tokenizer):
    long_turn = " ".join(f"w{i}" for i in range(500)) + " THE END"
    ids = encode_context(tiny_tokenizer, [long_turn], make_header("domain", "tech support"), max_length=48)
    assert len(ids) == 48
    text = tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.lstrip().startswith("domain: tech support")
    assert text.rstrip().endswith("THE END</s>")
    no_header = encode_context(tiny_tokenizer, [long_turn], "", max_length=48)
    assert len(no_header) == 48 and tiny_tokenizer.decode(no_header).rstrip().endswith("THE END</s>")


def test_training_and_chat_paths_agree(tiny_tokenizer):
    """The app (history, mode, context) and training (raw texts) build the same ids."""
    history = ["Hello", "Hi! What do you do?", "I grow flowers."]
    texts = format_context(history, "emotion", "happy")
    assert encode_history(tiny_tokenizer, history, "emotion", "happy", 128) == encode_texts(tiny_tokenizer, texts, 128)


def test_parse_header_reads_back_every_header():
    # literal MuDoConv headers (DESIGN.md) and their (mode, context)
    assert parse_header("your persona: i've 2 kids. i love flowers. </s>") == (
        "persona",
        "i've 2 kids. i love flowers.",
    )
    assert parse_header("context: sentimental") == ("emotion", "sentimental")
    assert parse_header("domain: travel") == ("domain", "travel")
    assert parse_header("topic: Hiking") == ("topic", "Hiking")
    assert parse_header("") == ("none", None)


# ---------------------------------------------------------------------------------------------- decoder-only family
@pytest.fixture(scope="module")
def chat_tokenizer(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model_dir)


def _template_ids(tokenizer, messages):
    """The oracle: the tokenizer's own chat template over hand-written messages."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_causal_rendering_is_the_chat_template_with_the_header_as_system(chat_tokenizer):
    turns = ["Hi there.", "Hello! How can I help?", "Do you like dogs?"]
    ids = encode_history(chat_tokenizer, turns, "persona", "I love dogs.", family="causal")
    messages = [
        {"role": "system", "content": "your persona: I love dogs."},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Do you like dogs?"},
    ]
    assert ids == _template_ids(chat_tokenizer, messages)
    text = chat_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nyour persona: I love dogs.<|im_end|>\n<|im_start|>user\nHi there.")
    assert text.endswith("<|im_start|>user\nDo you like dogs?<|im_end|>\n<|im_start|>assistant\n")
    # the same dialogue from a MuDoConv row renders the same way (training rows and serving agree)
    texts = format_context(turns, "persona", "I love dogs.")
    assert encode_texts(chat_tokenizer, texts, family="causal") == ids


def test_causal_free_chat_has_no_header_and_even_turns_start_with_the_assistant(chat_tokenizer):
    ids = encode_history(chat_tokenizer, ["I am back.", "Welcome back!", "Thanks."], "none", None, family="causal")
    messages = [
        {"role": "user", "content": "I am back."},
        {"role": "assistant", "content": "Welcome back!"},
        {"role": "user", "content": "Thanks."},
    ]
    assert ids == _template_ids(chat_tokenizer, messages)
    two = encode_history(chat_tokenizer, ["Nice day.", "Yes it is."], family="causal")
    assert two == _template_ids(
        chat_tokenizer, [{"role": "assistant", "content": "Nice day."}, {"role": "user", "content": "Yes it is."}]
    )


def test_causal_example_has_loss_on_the_reply_only(chat_tokenizer):
    texts = format_context(["Where do you live?"], "topic", "travel")
    row = encode_example(chat_tokenizer, texts, "In Paris, by the river.", 128, 32, family="causal")
    prompt = encode_texts(chat_tokenizer, texts, 128, family="causal")
    n = len(prompt)
    assert row["input_ids"][:n] == prompt and row["labels"][:n] == [IGNORE_INDEX] * n
    reply = row["labels"][n:]
    assert all(t != IGNORE_INDEX for t in reply) and row["input_ids"][n:] == reply
    assert chat_tokenizer.decode(reply) == "In Paris, by the river.<|im_end|>"
    assert reply[-1] == chat_tokenizer.eos_token_id
    assert row["attention_mask"] == [1] * len(row["input_ids"])
    long = encode_example(chat_tokenizer, texts, "word " * 100, 128, 16, family="causal")
    assert len(long["labels"]) - n == 16 and long["labels"][-1] == chat_tokenizer.eos_token_id


def test_seq2seq_example_is_context_and_reply_ids(tiny_tokenizer):
    row = encode_example(tiny_tokenizer, MUDOCONV_EXAMPLE, "Two, both girls.", 128, 64)
    assert row["input_ids"] == encode_texts(tiny_tokenizer, MUDOCONV_EXAMPLE, 128)
    assert row["labels"] == tiny_tokenizer(text_target="Two, both girls.")["input_ids"]


def test_causal_left_truncation_drops_oldest_turns_and_keeps_the_header(chat_tokenizer):
    turns = [f"turn number {i} says something fairly long about topic {i}." for i in range(12)]
    ids = encode_history(chat_tokenizer, turns, "domain", "small talk", max_length=96, family="causal")
    assert len(ids) <= 96
    # the result is exactly the template over the header and the k newest turns, for the largest k that fits
    fits = [
        k
        for k in range(1, len(turns) + 1)
        if len(encode_history(chat_tokenizer, turns[-k:], "domain", "small talk", family="causal")) <= 96
    ]
    assert ids == encode_history(chat_tokenizer, turns[-max(fits) :], "domain", "small talk", family="causal")
    assert max(fits) < len(turns)
    text = chat_tokenizer.decode(ids)
    assert "domain: small talk" in text and "turn number 11" in text and "turn number 0 " not in text


def test_causal_overlong_newest_turn_keeps_header_and_its_end(chat_tokenizer):
    long_turn = " ".join(f"w{i}" for i in range(300)) + " FINAL"
    ids = encode_history(chat_tokenizer, ["hello", long_turn], "emotion", "happy", max_length=80, family="causal")
    assert len(ids) <= 80
    text = chat_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\ncontext: happy<|im_end|>")
    assert text.endswith("FINAL<|im_end|>\n<|im_start|>assistant\n") and "w0 " not in text


def test_family_of_configs():
    from transformers import BlenderbotConfig, LlamaConfig

    assert family_of(BlenderbotConfig()) == "seq2seq" and family_of(LlamaConfig()) == "causal"
    with pytest.raises(ValueError, match="causal"):
        encode_texts(None, "hi", family="decoder")
