"""The MuDoConv context format: headers, joins, parsing, and left truncation that keeps the newest turn."""

import pytest

from chat_e.dialogue import (
    HEADER_JOIN,
    MODES,
    TURN_JOIN,
    encode_context,
    encode_history,
    encode_texts,
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
