"""Offline corpus conversion, local files, seeded sampling, and bad-row accounting."""

import json
import logging
from collections import Counter

import pytest

from chat_e.data.corpora import (
    CHATTERBOT_HEADERS,
    CHITCHAT_CONTEXT_TURNS,
    DataArguments,
    chatterbot_conversations,
    chitchat_conversations,
    chitchat_corpus,
    chitchat_pairs,
    conversation_pairs,
    load_chatterbot,
    load_chitchat,
    load_dialogue_dataset,
    tokenize_dataset,
)
from chat_e.data.dialogue import TURN_JOIN, make_header, parse_header, parse_texts


@pytest.fixture(scope="module")
def conversations():
    return chatterbot_conversations()


def test_corpus_has_all_topics(conversations):
    categories = {c["category"] for c in conversations}
    assert len(categories) >= 20
    assert all(len(c["turns"]) >= 2 for c in conversations)


def test_pairs_cover_both_speaker_directions():
    turns = ["A1", "B1", "A2", "B2", "A3"]
    pairs = conversation_pairs("food", turns)
    assert [p["labels"] for p in pairs] == ["B1", "A2", "B2", "A3"]  # B answers A, and (swapped) A answers B
    for i, pair in enumerate(pairs, start=1):
        header, context = parse_texts(pair["texts"])
        assert header == make_header("domain", "food")
        assert context == turns[:i]


def test_category_headers(conversations):
    mode, context = CHATTERBOT_HEADERS["emotion"]
    pair = conversation_pairs("emotion", ["You are happy", "I am"])[0]
    assert parse_texts(pair["texts"])[0] == make_header(mode, context)
    pair = conversation_pairs("tech_support", ["My pc is slow", "Restart it"])[0]
    assert parse_texts(pair["texts"])[0] == "domain: tech support"


def test_split_is_seeded_deterministic_and_by_conversation(conversations):
    a, b = load_chatterbot(seed=1), load_chatterbot(seed=1)
    assert a["train"]["texts"] == b["train"]["texts"]
    assert load_chatterbot(seed=2)["validation"]["texts"] != a["validation"]["texts"]
    total = sum(len(c["turns"]) - 1 for c in conversations)
    assert sum(len(a[s]) for s in ("train", "validation", "test")) == total
    # no opening turn (hence no context) is shared between splits
    firsts = {s: {parse_texts(t)[1][0].lower() for t in a[s]["texts"]} for s in a}
    assert not (firsts["train"] & firsts["validation"]) and not (firsts["train"] & firsts["test"])


def test_n_train_samples_randomly_with_the_seed():
    full = load_dialogue_dataset(DataArguments())
    small = load_dialogue_dataset(DataArguments(n_train=50, n_val=20))
    again = load_dialogue_dataset(DataArguments(n_train=50, n_val=20))
    assert len(small["train"]) == 50 and len(small["validation"]) == 20
    assert small["train"]["texts"] == again["train"]["texts"]
    assert small["train"]["texts"] != full["train"]["texts"][:50]
    assert set(small["train"]["texts"]) <= set(full["train"]["texts"])


def _bad_rows():
    good = [{"texts": f"hello {i}", "labels": f"hi {i}"} for i in range(5)]
    bad = [
        {"texts": "no label"},
        {"texts": "", "labels": "empty texts"},
        {"texts": 42, "labels": "non-string texts"},
        {"texts": "none label", "labels": None},
        {"texts": "blank", "labels": "   "},
    ]
    return good, bad


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_bad_rows_are_counted_skipped_and_reported_once(tmp_path, caplog, suffix):
    good, bad = _bad_rows()
    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in good + bad) + "\n{not json\n")
        expected_bad = len(bad) + 1
    elif suffix == ".json":
        path.write_text(json.dumps(good + bad))
        expected_bad = len(bad)
    else:
        lines = ["texts,labels"] + [f"{r['texts']},{r['labels']}" for r in good] + [",empty texts", "no label,"]
        path.write_text("\n".join(lines) + "\n")
        expected_bad = 2
    with caplog.at_level(logging.WARNING, logger="chat_e.data.corpora"):
        ds = load_dialogue_dataset(DataArguments(train_file=str(path)))
    assert ds["train"]["texts"] == [r["texts"] for r in good]
    lines = [r.message for r in caplog.records if "Skipped" in r.message]
    assert len(lines) == 1
    assert f"Skipped {expected_bad} of {expected_bad + len(good)} rows in the train split" in lines[0]


def test_local_files_with_custom_columns(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("\n".join(json.dumps({"context": f"c{i}", "response": f"r{i}"}) for i in range(3)))
    ds = load_dialogue_dataset(
        DataArguments(validation_file=str(path), text_column="context", label_column="response")
    )
    assert ds["validation"]["labels"] == ["r0", "r1", "r2"]


def test_tokenized_rows_fit_and_end_in_eos(tiny_tokenizer):
    args = DataArguments(n_train=64, max_source_length=32, max_target_length=16)
    ds = tokenize_dataset(load_dialogue_dataset(args)["train"], tiny_tokenizer, args)
    assert set(ds.column_names) == {"input_ids", "attention_mask", "labels"}
    assert max(len(x) for x in ds["input_ids"]) <= 32 and max(len(x) for x in ds["labels"]) <= 16
    eos = tiny_tokenizer.eos_token_id
    assert all(x[-1] == eos for x in ds["input_ids"]) and all(y[-1] == eos for y in ds["labels"])


def test_decoder_inputs_start_at_bos_not_pad(tiny_model_dir, tiny_tokenizer):
    """The recipe lets the model shift the labels itself: decoder inputs start at <s> (1), as BlenderBot expects."""
    import torch
    from transformers import BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

    args = DataArguments(n_train=8)
    ds = tokenize_dataset(load_dialogue_dataset(args)["train"], tiny_tokenizer, args)
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    batch = DataCollatorForSeq2Seq(tiny_tokenizer, model=model)([ds[i] for i in range(4)])
    assert "decoder_input_ids" not in batch
    labels = batch["labels"]
    starts_at_bos = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1]], dim=1)
    starts_at_bos = starts_at_bos.masked_fill(starts_at_bos.eq(-100), tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        implicit = model(**batch).logits
        explicit = model(**{k: v for k, v in batch.items() if k != "labels"}, decoder_input_ids=starts_at_bos).logits
    assert torch.allclose(implicit, explicit)


# ---------------------------------------------------------------------------------------------- chitchat corpus
@pytest.fixture(scope="module")
def chitchat():
    return load_chitchat(seed=1)


def first_contexts(ds) -> list[str]:
    """The contexts of one turn, lowercased: each conversation's first pair (later pairs have more turns)."""
    return [t.lower() for t in ds["texts"][:] if TURN_JOIN not in t]  # [:] reads the column at once


def test_chitchat_corpus_counts():
    # facts about the installed chitchat-dataset 0.9.0: 7,168 conversations, 3,150 of them a single message group
    conversations, drops = chitchat_conversations()
    assert len(conversations) == 4017 and len(chitchat_corpus()) == 7168
    assert sum(len(c["turns"]) for c in conversations) == 135565
    assert drops == Counter({"conversation with fewer than 2 turns": 3151, "empty message": 33, "URL-only message": 9})
    assert sum(1 for c in conversations if not c["topic"]) == 145  # conversations without a prompt: no header
    assert all(len(c["turns"]) >= 2 and c["category"] == "chitchat" for c in conversations)


def test_chitchat_first_pair_of_a_real_conversation():
    # messages [["Hello", "How are you doing today?"], ["whats up MD", "im doing good", "how are you doing?"], ...]
    cid = "a07edb12-6b91-4138-b11e-02421888d699"
    (conversation,), _ = chitchat_conversations({cid: chitchat_corpus()[cid]})
    first = chitchat_pairs(conversation)[0]
    assert first["texts"] == (
        "topic: What's one thing your best friend doesn't know about you?  <s> Hello How are you doing today?"
    )
    assert first["labels"] == "whats up MD im doing good how are you doing?"


def test_chitchat_bad_records_are_counted_and_skipped(caplog):
    def msg(text, sender):
        return {"text": text, "sender": sender}

    dataset = {
        "ok": {
            "prompt": "  Pets? ",
            "messages": [
                [msg("hi", "a"), msg("  ", "a"), msg("you \n there?", "a")],
                [msg("yes", "b"), msg("https://x.io/a www.y.com", "b")],
                [msg("cool", "a"), msg("look: https://x.io", "a")],
            ],
        },
        "no prompt": {"messages": [[msg("hello", "a")], [msg("hey", "b")]]},
        "one-sided": {"prompt": "p", "messages": [[msg("anyone?", "a"), msg("hello?", "a")]]},
        "link answer": {"prompt": "p", "messages": [[msg("hi", "a")], [msg("http://z.org", "b")]]},
        "no messages": {"prompt": "p"},
        "messages not a list": {"prompt": "p", "messages": "hi"},
        "not a record": ["hi"],
        "none": None,
        "bad parts": {
            "prompt": 7,
            "messages": [
                "not a group",
                [42, msg(None, "a"), {"text": "no sender"}, msg("hi", "a")],
                [msg(["yo"], "b"), msg("yo", "b")],
            ],
        },
    }
    with caplog.at_level(logging.INFO, logger="chat_e.data.corpora"):
        conversations, drops = chitchat_conversations(dataset)
    assert conversations == [
        {"category": "chitchat", "topic": "Pets?", "turns": ["hi you there?", "yes", "cool look: https://x.io"]},
        {"category": "chitchat", "topic": "", "turns": ["hello", "hey"]},
        {"category": "chitchat", "topic": "", "turns": ["hi", "yo"]},
    ]
    assert drops == Counter(
        {
            "conversation without a message list": 4,
            "conversation with fewer than 2 turns": 2,
            "URL-only message": 2,
            "message text not a string": 2,
            "empty message": 1,
            "message group not a list": 1,
            "message not a dict": 1,
            "message without sender": 1,
        }
    )
    lines = [r.message for r in caplog.records if "Chitchat corpus" in r.message]
    assert len(lines) == 1 and "kept 3 of 9 conversations" in lines[0]


def test_chitchat_topic_header_round_trips_and_context_is_capped():
    turns = [f"turn {i}" for i in range(CHITCHAT_CONTEXT_TURNS + 4)]
    pairs = chitchat_pairs({"category": "chitchat", "topic": "What if pigs could fly?", "turns": turns})
    assert [p["labels"] for p in pairs] == turns[1:]
    for i, pair in enumerate(pairs, start=1):
        header, context = parse_texts(pair["texts"])
        assert parse_header(header) == ("topic", "What if pigs could fly?")
        assert context == turns[max(0, i - CHITCHAT_CONTEXT_TURNS) : i]
    untitled = chitchat_pairs({"category": "chitchat", "topic": "", "turns": ["hi", "hey"]})[0]
    assert untitled["texts"] == "hi" and parse_texts(untitled["texts"]) == ("", ["hi"])


def test_chitchat_split_is_seeded_and_by_conversation(chitchat):
    assert sum(len(chitchat[s]) for s in chitchat) == 131548  # one pair per turn after the first
    firsts = {s: first_contexts(chitchat[s]) for s in chitchat}
    assert sum(len(f) for f in firsts.values()) == 4017  # every conversation, once
    assert abs(len(firsts["validation"]) - 401.7) < 20 and abs(len(firsts["test"]) - 401.7) < 20
    train, val, test = (set(firsts[s]) for s in ("train", "validation", "test"))
    assert not (train & val) and not (train & test) and not (val & test)
    again = load_chitchat(seed=1)  # the evaluation splits and the train size fix the partition
    assert len(again["train"]) == len(chitchat["train"])
    assert all(again[s]["texts"][:] == chitchat[s]["texts"][:] for s in ("validation", "test"))
    assert first_contexts(load_chitchat(seed=2)["validation"]) != firsts["validation"]


def test_chitchat_plus_chatterbot_has_both_sources_shuffled():
    ds = load_dialogue_dataset(DataArguments(dataset_name="chitchat+chatterbot", n_train=2000, n_val=500))
    assert len(ds["train"]) == 2000 and len(ds["validation"]) == 500
    assert all(ds[s].column_names == ["texts", "labels"] for s in ds)

    def from_chatterbot(split) -> list[bool]:
        # chatterbot's headers are domain/emotion/persona; chitchat's are topic, or none without a prompt
        return [parse_header(parse_texts(t)[0])[0] not in ("topic", "none") for t in ds[split]["texts"][:]]

    for split in ("train", "validation"):
        assert 0 < sum(from_chatterbot(split)) < len(ds[split])
    # the whole test split: all chitchat test pairs plus the chatterbot ones, shuffled together (not appended)
    texts, chatterbot = ds["test"]["texts"][:], from_chatterbot("test")
    assert sorted(t for t, c in zip(texts, chatterbot) if not c) == sorted(load_chitchat(seed=42)["test"]["texts"][:])
    assert sum(chatterbot) > 200 and chatterbot.index(True) < len(chatterbot) - sum(chatterbot)


def test_chatterbot_topics_are_the_corpus_categories_split_by_conversation():
    from collections import Counter

    from chat_e.data.corpora import chatterbot_conversations, load_chatterbot_topics

    data = load_chatterbot_topics()
    names = data["train"].features["label"].names
    sizes = Counter(conv["category"] for conv in chatterbot_conversations())
    assert names == sorted(c for c, n in sizes.items() if n >= 40)  # oracle: counted from the corpus here
    total = Counter(names[label] for split in data.values() for label in split["label"])
    assert total == {c: min(sizes[c], 200) for c in names}
    texts = {split: set(data[split]["text"]) for split in data}
    assert not texts["train"] & texts["test"] and not texts["train"] & texts["validation"]
    assert data["train"][0]["text"] and isinstance(data["train"][0]["label"], int)
