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


def test_replayed_rows_are_human_replies_of_the_train_split_in_the_rows_format(recipe, chat_tokenizer):
    """Replay (rehearsal): the corpus's train split only (chat-e eval's NLL reads its validation split), the human
    reply as the chosen and rejected one (DPO: only an SFT term learns from it) or desirable (KTO), the prompt
    conversational within max_source_length tokens, or the text SPIN renders."""
    from chat_e.data.corpora import load_offline
    from chat_e.data.dialogue import parse_texts

    corpus = load_offline("chatterbot", seed=42)
    train_pairs = {(parse_texts(r["texts"])[1][-1], r["labels"].strip()) for r in corpus["train"]}
    args = recipe.PreferenceDataArguments(replay=12, replay_dataset="chatterbot", max_source_length=48)
    rows = recipe.replay_rows(args, chat_tokenizer, conversational=True)
    assert len(rows) == 12
    for row in rows:
        assert row["rejected"] == row["chosen"] and [m["role"] for m in row["chosen"]] == ["assistant"]
        assert (row["prompt"][-1]["content"], row["chosen"][0]["content"]) in train_pairs
        assert row["prompt"][-1]["role"] == "user"
        rendered = chat_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        turns = [m for m in row["prompt"] if m["role"] != "system"]
        assert len(chat_tokenizer(rendered)["input_ids"]) <= 48 or len(turns) == 1
    # plain text (rows that join plain-text ones): the same sample, the reply as chat_e.data.dialogue ends it
    for conversational, text in zip(rows, recipe.replay_rows(args, chat_tokenizer, conversational=False), strict=True):
        reply = chat_tokenizer.decode(chat_reply_ids(chat_tokenizer, conversational["chosen"][0]["content"], 32))
        assert text["chosen"] == text["rejected"] == reply
        assert len(chat_tokenizer(text["prompt"])["input_ids"]) <= 48
    args.loss = "kto"
    assert all(r["label"] is True and r["completion"] for r in recipe.replay_rows(args, chat_tokenizer, True))


@pytest.mark.parametrize("loss, loss_types, replay, refused", [
    ("dpo", ["sigmoid"], 8, "only an SFT term learns from it"),
    ("dpo", ["sft"], 8, None),
    ("dpo", ["sigmoid", "sft"], 8, None),
    ("kto", ["kto"], 8, None),
    ("dpo", ["sigmoid"], 0, None),
    ("kto", ["kto"], -1, "replay=-1: give 0"),
])  # fmt: skip
def test_replay_is_refused_where_nothing_would_learn_from_it(loss, loss_types, replay, refused):
    from chat_e.training.launch import replay_problem

    problem = replay_problem(loss, loss_types, replay)
    assert (problem is None) if refused is None else (refused in problem and "\n" not in problem)


def test_the_turns_kept_as_messages_are_the_whole_turns_chat_e_serves(chat_tokenizer):
    """chat_turns_that_fit (rows kept as messages) keeps the whole newest turns that encode_chat_prompt (what
    Chat-E serves) keeps: the same ids where whole turns fit, one older turn more would not fit."""
    from chat_e.data.dialogue import chat_messages, chat_turns_that_fit, encode_chat_prompt

    turns = [f"turn {i}: " + "words " * (3 + 2 * i) for i in range(6)]
    header = "your persona: I like tea."

    def ids(kept):  # the template's rendering, tokenized as TRL does
        text = chat_tokenizer.apply_chat_template(chat_messages(kept, header), add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
        return chat_tokenizer(text)["input_ids"]

    sizes = {k: len(ids([t.strip() for t in turns[-k:]])) for k in range(1, 7)}
    for budget, k in ((sizes[1], 1), (sizes[3] + 1, 3), (sizes[4] - 1, 3), (sizes[6], 6)):
        kept = chat_turns_that_fit(chat_tokenizer, turns, header, budget)
        assert kept == [t.strip() for t in turns[-k:]], budget
        assert ids(kept) == encode_chat_prompt(chat_tokenizer, turns, header, budget), budget
    assert chat_turns_that_fit(chat_tokenizer, turns, header, sizes[1] - 1) == [turns[-1].strip()]  # kept whole
