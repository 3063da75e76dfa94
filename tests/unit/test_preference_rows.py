"""The preference training's rows (chat_e.training.preference, what recipes/preference.py runs): bad preference rows are counted per reason and skipped, and SPIN pairs are the text
Chat-E serves (checked against chat_e.data.dialogue's serving path called directly)."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from chat_e.data.dialogue import chat_reply_ids, encode_history, format_context


@pytest.fixture(scope="module")
def recipe():
    from chat_e.training import preference

    return preference


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_chat_model_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_model_dir)


CONVERSATION = [{"role": "user", "content": "Hi!"}]
REPLY = [{"role": "assistant", "content": "Hello."}]

DPO_ROWS = [
    {"prompt": "Hi!", "chosen": "Hello.", "rejected": "Go away."},  # good, plain text
    {"prompt": CONVERSATION, "chosen": REPLY, "rejected": [{"role": "assistant", "content": "No."}]},  # good
    {"prompt": "Hi!", "chosen": "Hello."},  # missing rejected
    {"prompt": "Hi!", "chosen": "   ", "rejected": "No."},  # empty chosen
    {"prompt": "", "chosen": "Hello.", "rejected": "No."},  # empty prompt
    {"prompt": "Hi!", "chosen": 3, "rejected": "No."},  # neither text nor a conversation
    {"prompt": CONVERSATION, "chosen": [{"role": "assistant"}], "rejected": REPLY},  # malformed conversation
    {"prompt": CONVERSATION, "chosen": "Hello.", "rejected": REPLY},  # text and conversation mixed
    ["not", "a", "record"],
]
KTO_ROWS = [
    {"prompt": "Hi!", "completion": "Hello.", "label": True},  # good
    {"prompt": CONVERSATION, "completion": REPLY, "label": False},  # good
    {"prompt": "Hi!", "completion": "Hello.", "label": "yes"},  # wrong label type
    {"prompt": "Hi!", "completion": "Hello.", "label": 1},  # an int is not a label either
    {"prompt": "Hi!", "completion": "Hello."},  # missing label
    {"prompt": "Hi!", "completion": "", "label": True},  # empty completion
]


def test_bad_dpo_rows_are_counted_per_reason_and_skipped(recipe, caplog):
    with caplog.at_level(logging.WARNING, logger="chat_e.training.preference"):
        kept = recipe.clean_preference_rows(DPO_ROWS, "dpo", "rows.jsonl", unparsable=2)
    assert kept == DPO_ROWS[:2]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "Skipped 9 of 11 rows of rows.jsonl" in line
    for reason in (
        "2 unparsable line",
        "1 missing 'rejected'",
        "1 empty 'chosen'",
        "1 empty 'prompt'",
        "1 'chosen' neither text nor a conversation",
        "1 malformed conversation in 'chosen'",
        "1 text and conversation mixed",
        "1 not a record",
    ):
        assert reason in line, (reason, line)


def test_bad_kto_rows_are_counted_per_reason_and_skipped(recipe, caplog):
    with caplog.at_level(logging.WARNING, logger="chat_e.training.preference"):
        kept = recipe.clean_preference_rows(KTO_ROWS, "kto", "hub")
    assert kept == KTO_ROWS[:2]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "Skipped 4 of 6 rows of hub" in line
    assert "2 label not a boolean" in line and "1 missing 'label'" in line and "1 empty 'completion'" in line


def test_a_data_file_is_cleaned_held_out_and_unpaired_for_kto(recipe, tmp_path):
    good = [{"prompt": f"question {i}?", "chosen": f"answer {i}.", "rejected": f"nonsense {i}"} for i in range(10)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([*map(json.dumps, good), "{not json", json.dumps({"prompt": "x"})]) + "\n")
    args = recipe.PreferenceDataArguments(data_file=str(path), n_eval=3, loss="dpo")
    train, held_out = recipe.load_rows(args)
    assert len(train) == 7 and len(held_out) == 3
    assert sorted(r["prompt"] for r in train + held_out) == sorted(r["prompt"] for r in good)
    # the same seed gives the same hold-out; KTO gets each pair as a desirable and an undesirable row, on one side
    args.loss = "kto"
    kto_train, kto_held_out = recipe.load_rows(args)
    assert {r["prompt"] for r in kto_held_out} == {r["prompt"] for r in held_out}
    assert len(kto_train) == 14 and len(kto_held_out) == 6
    for row in kto_held_out:
        pair = next(p for p in good if p["prompt"] == row["prompt"])
        assert row["completion"] == (pair["chosen"] if row["label"] else pair["rejected"])


def test_spin_pairs_render_through_chat_e_dialogue(recipe, chat_tokenizer):
    turns = ["I went hiking this weekend.", "Oh nice, where did you go?", "Up the canyon behind my house!"]
    rows = [{"texts": format_context(turns, "topic", "Outdoors"), "labels": "That  sounds fun, was it steep?"}]
    args = recipe.PreferenceDataArguments(max_source_length=40, max_target_length=8)
    (pair,), drops = recipe.spin_pairs(rows, ["no no no no no no no no no no no no no no"], chat_tokenizer, args)
    assert not drops
    # the oracle: what Chat-E feeds the model for this chat (chat_e.data.dialogue's serving entry point) ...
    served = encode_history(chat_tokenizer, turns, "topic", "Outdoors", max_length=40, family="causal")
    # ... and what the chat template makes a chat model end an assistant message with, cut to the reply budget
    human = chat_reply_ids(chat_tokenizer, "That sounds fun, was it steep?", max_length=8)
    generated = chat_reply_ids(chat_tokenizer, "no no no no no no no no no no no no no no", max_length=8)
    assert len(served) <= 40 and human[-1] == generated[-1] == chat_tokenizer.eos_token_id
    # TRL tokenizes the rows' text again (default special tokens): it must give back exactly those ids
    assert chat_tokenizer(pair["prompt"])["input_ids"] == served
    assert chat_tokenizer(pair["prompt"] + pair["chosen"])["input_ids"] == served + human
    assert chat_tokenizer(pair["prompt"] + pair["rejected"])["input_ids"] == served + generated


def test_spin_pairs_drop_empty_and_copied_model_replies(recipe, chat_tokenizer):
    rows = [{"texts": format_context(["Hi."], "topic", "x"), "labels": "Hello there!"}] * 3
    args = recipe.PreferenceDataArguments()
    pairs, drops = recipe.spin_pairs(rows, ["", "Hello   there!", "What?"], chat_tokenizer, args)
    assert len(pairs) == 1 and chat_tokenizer.decode(chat_reply_ids(chat_tokenizer, "What?")) == pairs[0]["rejected"]
    assert drops == {"empty model reply": 1, "model reply equals the human one": 1}


def test_kto_rows_of_spin_pairs_label_the_human_reply_true(recipe):
    pairs = [{"prompt": "p", "chosen": "human", "rejected": "model"}]
    assert recipe.to_unpaired(pairs) == [
        {"prompt": "p", "completion": "human", "label": True},
        {"prompt": "p", "completion": "model", "label": False},
    ]


def test_a_held_out_set_truncated_away_stops_the_run_in_one_line(recipe):
    """TRL drops a row whose prompt fills max_length; a run with training rows left but no held-out row stops (it
    could measure nothing), and so does one with no training row; rows on both sides go on."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(train_dataset=[{}] * 3, eval_dataset=[])
    with pytest.raises(SystemExit, match=r"^chat-e training stopped: no held-out row left of 4, so nothing can be "
                                         r"measured: every prompt is at least max_length=64 tokens long: raise "
                                         r"--max_length\.$"):  # fmt: skip
        recipe.check_rows_left(trainer, 5, 4, 64)
    with pytest.raises(SystemExit, match="no training row left of 5"):
        recipe.check_rows_left(SimpleNamespace(train_dataset=[], eval_dataset=[{}]), 5, 4, 64)
    recipe.check_rows_left(SimpleNamespace(train_dataset=[{}], eval_dataset=[{}]), 5, 4, 64)
    recipe.check_rows_left(SimpleNamespace(train_dataset=[{}], eval_dataset=None), 5, 0, 64)  # nothing held out
