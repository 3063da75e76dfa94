"""chat_e.data.adherence: every checker on hand-written replies that pass and fail, strict against loose, the prompt
and probe sets well formed, and the scores and reply statistics on small cases computed by hand."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from chat_e.data.adherence import (
    INSTRUCTIONS,
    MODE_CHECKS,
    MODE_PROBES,
    PROBE_MODES,
    PROMPTS,
    InstructionPrompt,
    ModeProbe,
    follows,
    reply_stats,
    score_instructions,
    score_modes,
)

#: how a prompt may state a count in words
NUMBER_WORDS = {1: ("one", "once"), 2: ("two", "twice"), 3: ("three",), 4: ("four",), 5: ("five",)}


# --------------------------------------------------------------------------------------------------------------------
# Instruction checkers
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instruction", "kwargs", "reply", "expected"),
    [
        ("length:max_words", {"n": 5}, "I don't like rainy days.", True),  # "don't" is one word: 5
        ("length:max_words", {"n": 4}, "I don't like rainy days.", False),
        ("length:min_words", {"n": 3}, "One two three.", True),
        ("length:min_words", {"n": 4}, "One two three.", False),
        ("punctuation:no_comma", {}, "Coffee then a walk.", True),
        ("punctuation:no_comma", {}, "Coffee, then a walk.", False),
        ("case:lowercase", {}, "i like tea, 2 cups!", True),
        ("case:lowercase", {}, "i like Tea.", False),
        ("case:lowercase", {}, "123 !", False),  # no letter at all
        ("case:uppercase", {}, "GOOD LUCK ON YOUR EXAM 2!", True),
        ("case:uppercase", {}, "GOOD LUCK on your exam!", False),
        ("keywords:include", {"words": ["tomato", "garden"]}, "My Garden grows tomatoes.", True),
        ("keywords:include", {"words": ["tomato", "garden"]}, "My garden grows peppers.", False),
        ("keywords:include", {"words": ["star"]}, "Let's start.", False),  # an inflection, not any continuation
        ("keywords:exclude", {"words": ["love"]}, "I adore gloves.", True),  # whole words only
        ("keywords:exclude", {"words": ["love"]}, "I Loved it.", False),
        ("format:bullets", {"n": 2}, "Tips:\n* Sleep well\n- Eat **breakfast**", True),
        ("format:bullets", {"n": 2}, "* one\n* two\n* three", False),
        ("format:bullets", {"n": 1}, "**Bold** start\n---\n* only one", True),  # bold and rules are not bullets
        ("format:json", {}, '{"name": "Chat-E", "color": "blue"}', True),
        ("format:json", {}, '```json\n{"todo": ["shop", "call mom"]}\n```', True),
        ("format:json", {}, 'Sure! {"name": "Chat-E"}', False),
        ("format:quotation", {}, '"Keep going!"', True),
        ("format:quotation", {}, "“Keep going!”", True),
        ("format:quotation", {}, '"Keep going!" you said.', False),
        ("ending:question", {}, "I like books. Do you?  ", True),
        ("ending:question", {}, "Do you like books? I do.", False),
        ("ending:phrase", {"phrase": "Sweet dreams!"}, "Good night, sweet dreams!", True),
        ("ending:phrase", {"phrase": "Sweet dreams!"}, "Sweet dreams! Good night.", False),
        ("start:word", {"word": "Yes"}, '"Yes, I do!"', True),  # leading punctuation skipped
        ("start:word", {"word": "Yes"}, "Yesterday was rainy.", False),
        ("count:sentences_max", {"n": 2}, "The sky is blue. It scatters 3.5 times more light!", True),
        ("count:sentences_max", {"n": 2}, "One. Two! Three?", False),
        ("count:sentences_max", {"n": 1}, "A line\nAnother line", False),  # a line break ends a sentence
        ("letters:count", {"letter": "z", "n": 3}, "Zebras zigzag at the zoo.", True),
        ("letters:count", {"letter": "z", "n": 3}, "Zebras at the zoo.", False),
    ],
)
def test_instruction_checker(instruction, kwargs, reply, expected):
    assert INSTRUCTIONS[instruction](reply, **kwargs) is expected


@pytest.mark.parametrize(
    ("checks", "reply", "strict", "loose"),
    [
        # a preamble line hides the first word, the loose reading without the first line finds it
        ([("start:word", {"word": "Yes"})], "Sure! Here it is:\nYes, I love rainy days.", [False], [True]),
        # a sign-off line after the question
        ([("ending:question", {})], "Do you like tea?\nLet me know!", [False], [True]),
        # markdown emphasis around the closing phrase
        ([("ending:phrase", {"phrase": "Sweet dreams!"})], "Good night. **Sweet dreams!**", [False], [True]),
        # a blank reading follows nothing: dropping the only line must not pass "no commas"
        ([("punctuation:no_comma", {})], "Well, hello.", [False], [False]),
        # each check read on its own: the loose pass of one does not carry the other
        (
            [("start:word", {"word": "Yes"}), ("case:lowercase", {})],
            "Sure!\nYes I Do.",
            [False, False],
            [True, False],
        ),
    ],
)
def test_strict_and_loose(checks, reply, strict, loose):
    assert follows(reply, checks) == strict
    assert follows(reply, checks, loose=True) == loose


def test_blank_reply_follows_nothing():
    assert follows("  \n ", [("punctuation:no_comma", {}), ("length:max_words", {"n": 5})], loose=True) == [False] * 2


def test_unknown_instruction_is_refused():
    with pytest.raises(ValueError, match="Unknown instruction 'length:words'"):
        follows("hi", [("length:words", {"n": 3})])


# --------------------------------------------------------------------------------------------------------------------
# The prompt set
# --------------------------------------------------------------------------------------------------------------------


def test_prompt_checks_are_registered_and_take_their_kwargs():
    for prompt in PROMPTS:
        for instruction, kwargs in prompt.checks:
            assert isinstance(INSTRUCTIONS[instruction]("A dummy reply.", **kwargs), bool), prompt.id


def test_prompt_ids_unique():
    assert len({prompt.id for prompt in PROMPTS}) == len(PROMPTS)


def test_prompt_checks_distinct_within_a_prompt():
    # score_instructions keys a prompt's checks by instruction id
    for prompt in PROMPTS:
        assert len({instruction for instruction, _ in prompt.checks}) == len(prompt.checks), prompt.id


def test_prompt_counts():
    uses = Counter(instruction for prompt in PROMPTS for instruction, _ in prompt.checks)
    assert len(PROMPTS) >= 72
    assert len(INSTRUCTIONS) >= 12
    assert set(uses) == set(INSTRUCTIONS)
    assert min(uses.values()) >= 4, uses


def test_prompt_states_its_kwargs():
    # every word, phrase, letter and count a check uses is written in the message
    for prompt in PROMPTS:
        message = prompt.message.lower()
        for _, kwargs in prompt.checks:
            for value in kwargs.values():
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, int):
                        spelled = (str(item), *NUMBER_WORDS.get(item, ()))
                        assert any(re.search(rf"\b{word}\b", message) for word in spelled), (prompt.id, item)
                    else:
                        assert item.lower() in message, (prompt.id, item)


# --------------------------------------------------------------------------------------------------------------------
# score_instructions
# --------------------------------------------------------------------------------------------------------------------


def test_score_instructions_by_hand():
    prompts = (
        InstructionPrompt(
            "a", "In at most 3 words, lowercase.", (("length:max_words", {"n": 3}), ("case:lowercase", {}))
        ),
        InstructionPrompt("b", "Start with 'Yes'.", (("start:word", {"word": "Yes"}),)),
        InstructionPrompt("c", "No commas.", (("punctuation:no_comma", {}),)),
    )
    replies = [
        "hi there",  # a: both checks pass
        "Sure!\nYes.",  # b: strict fails, loose passes
        "a, b",  # c: fails both ways
    ]
    score = score_instructions(replies, prompts)
    assert [(row["id"], row["strict"], row["loose"]) for row in score["prompts"]] == [
        ("a", True, True),
        ("b", False, True),
        ("c", False, False),
    ]
    assert score["prompts"][1]["checks"] == {"start:word": {"strict": False, "loose": True}}
    assert score["prompt_strict"] == pytest.approx(1 / 3)
    assert score["prompt_loose"] == pytest.approx(2 / 3)
    assert score["instruction_strict"] == pytest.approx(2 / 4)
    assert score["instruction_loose"] == pytest.approx(3 / 4)
    assert score["by_instruction"] == {
        "case:lowercase": {"strict": 1.0, "loose": 1.0, "n": 1},
        "length:max_words": {"strict": 1.0, "loose": 1.0, "n": 1},
        "punctuation:no_comma": {"strict": 0.0, "loose": 0.0, "n": 1},
        "start:word": {"strict": 0.0, "loose": 1.0, "n": 1},
    }
    assert (score["n_prompts"], score["n_instructions"]) == (3, 4)


# --------------------------------------------------------------------------------------------------------------------
# Mode checkers and probes
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "kwargs", "reply", "expected"),
    [
        ("persona:fact", {"name": "Leo", "hobby": ("guitar",)}, "I'm leo, nice to meet you!", True),
        ("persona:fact", {"name": "Leo", "hobby": ("guitar",)}, "I play the Guitar at night.", True),
        ("persona:fact", {"name": "Leo", "hobby": ("guitar",)}, "Call me Leonard. I like guitars.", False),
        ("context:keywords", {"keywords": ("restaurant", "table")}, "Which Restaurants do you like?", True),
        ("context:keywords", {"keywords": ("star",)}, "Let's start over.", False),
        ("context:keywords", {"keywords": ("world cup",)}, "Did you watch the World  Cup?", True),
        ("emotion:acknowledged", {"emotion": "afraid", "family": "fear"}, "Don't be afraid, lock the door.", True),
        ("emotion:acknowledged", {"emotion": "afraid", "family": "fear"}, "That sounds scary!", True),
        ("emotion:acknowledged", {"emotion": "sad", "family": "sad"}, "I’m so sorry for your loss.", True),
        ("emotion:acknowledged", {"emotion": "proud", "family": "happy"}, "I understand, what a day.", True),
        ("emotion:acknowledged", {"emotion": "proud", "family": "happy"}, "What did she study?", False),
    ],
)
def test_mode_checker(check, kwargs, reply, expected):
    assert MODE_CHECKS[check](reply, **kwargs) is expected


def test_probe_checks_are_registered_and_take_their_kwargs():
    for probe in MODE_PROBES:
        assert isinstance(MODE_CHECKS[probe.check]("A dummy reply.", **probe.kwargs), bool), probe.id


def test_probe_ids_unique():
    assert len({probe.id for probe in MODE_PROBES}) == len(MODE_PROBES)


def test_probe_counts():
    per_mode = Counter(probe.mode for probe in MODE_PROBES)
    assert set(per_mode) == set(PROBE_MODES)
    assert min(per_mode.values()) >= 8, per_mode


def test_probe_message_alone_fails_its_check():
    # a reply that only echoes the user scores nothing: the check measures the context
    for probe in MODE_PROBES:
        assert not MODE_CHECKS[probe.check](probe.message, **probe.kwargs), probe.id


def test_score_modes_by_hand():
    probes = (
        ModeProbe("p", "persona", "My name is Ann.", "Name?", "persona:fact", {"name": "Ann", "hobby": ()}),
        ModeProbe("t1", "topic", "chess", "Hi", "context:keywords", {"keywords": ("chess",)}),
        ModeProbe("t2", "topic", "chess", "Hi", "context:keywords", {"keywords": ("chess",)}),
    )
    score = score_modes(["I'm Ann.", "Chess is fun.", "Hello!"], probes)
    assert [row["passed"] for row in score["probes"]] == [True, True, False]
    assert score["by_mode"] == {"persona": 1.0, "topic": 0.5}
    assert score["overall"] == pytest.approx(2 / 3)
    assert score["n"] == 3


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: score_instructions(["one reply"]), r"1 replies for \d+ prompts"),
        (lambda: score_modes([]), r"0 replies for \d+ probes"),
        (lambda: reply_stats(["a", "b"], [True]), "1 max_new_tokens_hit flags for 2 replies"),
    ],
)
def test_length_mismatch_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------------------------------------------------
# reply_stats
# --------------------------------------------------------------------------------------------------------------------


def test_distinct_2():
    # bigrams (a b), (b a), (a b): 2 distinct of 3
    assert reply_stats(["a b a b"])["distinct_2"] == pytest.approx(2 / 3)


def test_reply_stats_by_hand():
    replies = [
        "Hello there",  # 2 words, fine
        "   ",  # empty
        "go go go go go go",  # the 4-gram "go go go go" occurs 3 times: runaway
        "I like it a lot",  # 5 words, hit the length limit: runaway
    ]
    stats = reply_stats(replies, [False, False, False, True])
    assert stats["n"] == 4
    assert stats["mean_words"] == pytest.approx((2 + 0 + 6 + 5) / 4)
    # bigrams: 1 + 0 + 5 (one distinct) + 4 = 10, distinct 1 + 1 + 4 = 6
    assert (stats["bigrams"], stats["distinct_bigrams"]) == (10, 6)
    assert stats["distinct_2"] == pytest.approx(0.6)
    assert (stats["empty"], stats["empty_share"]) == (1, 0.25)
    assert (stats["runaway"], stats["runaway_share"]) == (2, 0.5)


def test_reply_stats_two_repeats_are_not_runaway():
    assert reply_stats(["go go go go go"])["runaway"] == 0  # "go go go go" twice only


def test_reply_stats_of_nothing():
    stats = reply_stats([])
    assert (stats["n"], stats["mean_words"], stats["distinct_2"], stats["empty_share"]) == (0, None, None, None)
