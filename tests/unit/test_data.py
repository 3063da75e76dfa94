"""Offline corpus conversion, local files, seeded sampling, and bad-row accounting."""

import json
import logging

import pytest

from chat_e.corpora import (
    CHATTERBOT_HEADERS,
    DataArguments,
    chatterbot_conversations,
    conversation_pairs,
    load_chatterbot,
    load_dialogue_dataset,
    tokenize_dataset,
)
from chat_e.dialogue import make_header, parse_texts


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
    with caplog.at_level(logging.WARNING, logger="chat_e.corpora"):
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
