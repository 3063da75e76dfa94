"""Does the chat model do what it is asked? Prompts whose answer a rule can check, the rules, and a few statistics of
the replies: an offline evaluation of a small chat model (SmolLM2-135M-Instruct, whose replies run to about 60
tokens) that needs no judge model and no network.

* Verifiable instructions, in the manner of IFEval (Zhou et al. 2023, "Instruction-Following Evaluation for Large
  Language Models"), with Chat-E's own prompts and checkers: :data:`PROMPTS` are short user messages that each state
  one or two instructions a rule can check (at most N words, no commas, end with a question...), :data:`INSTRUCTIONS`
  the checkers, :func:`follows` and :func:`score_instructions` the strict and loose scores IFEval defines. Counts
  and lengths are kept within what a 60-token reply can do.
* Mode adherence: :data:`MODE_PROBES` ask something under a persona, an emotion, a domain or a topic (the chat app's
  context modes) and :data:`MODE_CHECKS` check that the reply used that context: the persona's name or hobby given
  back, the emotion acknowledged, the domain or topic kept. A probe's message alone never passes its check, so a
  reply that only echoes the user scores nothing: the check measures the context, not the question.
* :func:`reply_stats`: length, distinct-2 (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural
  Conversation Models"), empty and runaway replies: what a small model's failures look like before any rule applies.

Pure functions over strings, standard library only: the replies come from whichever engine generated them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# --------------------------------------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------------------------------------

#: a word: letters or digits, with inner apostrophes (``don't`` is one word)
_WORD = re.compile(r"\w+(?:['’]\w+)*")
#: the endings a keyword may carry and still count as that word (``tomato``/``tomatoes``, ``love``/``loved``,
#: ``restaurant``/``restaurants``): inflections only, so ``star`` does not match ``start``
STEM_SUFFIXES: tuple[str, ...] = ("s", "es", "d", "ed", "ing", "r", "er", "rs", "ers")
_SUFFIX_GROUP = "(?:" + "|".join(STEM_SUFFIXES) + ")?"
#: a markdown bullet line: ``* `` or ``- `` then text (``**bold**`` and ``---`` are not bullets)
_BULLET = re.compile(r"^[ \t]*[*-][ \t]+\S", re.MULTILINE)
#: where a sentence ends: a run of ``.!?`` before whitespace or the end, or a line break
_SENTENCE_BREAK = re.compile(r"[.!?]+(?=\s|$)|\n+")
#: a reply wrapped in a fenced code block, as models often write JSON
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def _normalize(text: str) -> str:
    """Lowercase, curly apostrophes made straight, runs of whitespace made one space: the form phrases match in."""
    return " ".join(text.replace("’", "'").lower().split())


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def _has_word(text: str, word: str) -> bool:
    """``word`` (or phrase) occurs in ``text`` as a whole word, in any case."""
    return re.search(rf"(?<!\w){re.escape(_normalize(word))}(?!\w)", _normalize(text)) is not None


def _has_stem(text: str, word: str) -> bool:
    """``word`` occurs in ``text`` in any case, bare or with one of :data:`STEM_SUFFIXES`."""
    pattern = rf"(?<!\w){re.escape(_normalize(word))}{_SUFFIX_GROUP}(?!\w)"
    return re.search(pattern, _normalize(text)) is not None


def _share(k: int, n: int) -> float | None:
    return k / n if n else None


# --------------------------------------------------------------------------------------------------------------------
# 1. Verifiable instructions
# --------------------------------------------------------------------------------------------------------------------


def max_words(reply: str, *, n: int) -> bool:
    """At most ``n`` words."""
    return len(_words(reply)) <= n


def min_words(reply: str, *, n: int) -> bool:
    """At least ``n`` words."""
    return len(_words(reply)) >= n


def no_comma(reply: str) -> bool:
    """No comma anywhere."""
    return "," not in reply


def lowercase(reply: str) -> bool:
    """Every letter lowercase (and at least one letter)."""
    return reply.islower()


def uppercase(reply: str) -> bool:
    """Every letter uppercase (and at least one letter)."""
    return reply.isupper()


def include_keywords(reply: str, *, words: Sequence[str]) -> bool:
    """Every one of ``words`` used, in any case, bare or inflected."""
    return all(_has_stem(reply, word) for word in words)


def exclude_keywords(reply: str, *, words: Sequence[str]) -> bool:
    """None of ``words`` used, in any case, bare or inflected."""
    return not any(_has_stem(reply, word) for word in words)


def bullets(reply: str, *, n: int) -> bool:
    """Exactly ``n`` markdown bullet lines (``* item`` or ``- item``)."""
    return len(_BULLET.findall(reply)) == n


def is_json(reply: str) -> bool:
    """The whole reply parses as JSON, bare or in a ```` ```json ```` fenced block (as IFEval allows)."""
    text = reply.strip()
    fenced = _FENCED.fullmatch(text)
    try:
        json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return False
    return True


def ends_with_question(reply: str) -> bool:
    """The last character (trailing whitespace aside) is ``?``."""
    return reply.rstrip().endswith("?")


def ends_with_phrase(reply: str, *, phrase: str) -> bool:
    """Ends with ``phrase`` exactly, case aside (IFEval's end checker), trailing whitespace aside."""
    return reply.strip().lower().endswith(phrase.strip().lower())


def starts_with_word(reply: str, *, word: str) -> bool:
    """The first word is ``word``, case aside (leading punctuation and markup skipped)."""
    found = _words(reply)
    return bool(found) and found[0].lower() == word.lower()


def max_sentences(reply: str, *, n: int) -> bool:
    """At most ``n`` sentences (a sentence ends at ``.``, ``!``, ``?`` before a space, or at a line break)."""
    return sum(1 for piece in _SENTENCE_BREAK.split(reply) if re.search(r"\w", piece)) <= n


def quoted(reply: str) -> bool:
    """The whole reply wrapped in double quotes (straight or curly)."""
    text = reply.strip()
    return len(text) > 1 and text[0] in '"“' and text[-1] in '"”'


def letter_count(reply: str, *, letter: str, n: int) -> bool:
    """The letter ``letter`` appears at least ``n`` times, case aside."""
    return reply.lower().count(letter.lower()) >= n


#: instruction id (IFEval's ``group:name`` form) -> checker ``(reply, **kwargs) -> bool``
INSTRUCTIONS: dict[str, Callable[..., bool]] = {
    "length:max_words": max_words,
    "length:min_words": min_words,
    "punctuation:no_comma": no_comma,
    "case:lowercase": lowercase,
    "case:uppercase": uppercase,
    "keywords:include": include_keywords,
    "keywords:exclude": exclude_keywords,
    "format:bullets": bullets,
    "format:json": is_json,
    "format:quotation": quoted,
    "ending:question": ends_with_question,
    "ending:phrase": ends_with_phrase,
    "start:word": starts_with_word,
    "count:sentences_max": max_sentences,
    "letters:count": letter_count,
}


@dataclass(frozen=True)
class InstructionPrompt:
    """A user message and the instructions it states, each an id of :data:`INSTRUCTIONS` with its kwargs."""

    id: str
    message: str
    checks: tuple[tuple[str, dict], ...]


def _p(id: str, message: str, *checks: tuple[str, dict]) -> InstructionPrompt:
    return InstructionPrompt(id, message, tuple(checks))


#: every instruction the message states is checked, and every check is stated in the message
PROMPTS: tuple[InstructionPrompt, ...] = (
    # length:max_words
    _p("weekend-short", "Tell me about your weekend in at most 20 words.", ("length:max_words", {"n": 20})),
    _p("coffee-short", "In 10 words or fewer, tell me why people like coffee.", ("length:max_words", {"n": 10})),
    _p("rain-short", "Describe a rainy day in no more than 15 words.", ("length:max_words", {"n": 15})),
    _p("hello-short", "Say hello to me using at most 5 words.", ("length:max_words", {"n": 5})),
    _p(
        "interview-short",
        "Give me one piece of advice for a job interview, 12 words at most.",
        ("length:max_words", {"n": 12}),
    ),
    # length:min_words
    _p("animal-long", "Tell me about your favorite animal in at least 25 words.", ("length:min_words", {"n": 25})),
    _p(
        "city-long",
        "Describe the city you would most like to visit, using at least 20 words.",
        ("length:min_words", {"n": 20}),
    ),
    _p(
        "breakfast-long",
        "What makes a good breakfast? Answer with at least 15 words.",
        ("length:min_words", {"n": 15}),
    ),
    _p("movie-long", "Tell me about a movie you enjoyed. Write 30 words or more.", ("length:min_words", {"n": 30})),
    # punctuation:no_comma
    _p("morning-no-comma", "Describe your morning routine without using any commas.", ("punctuation:no_comma", {})),
    _p(
        "friend-no-comma",
        "What do you look for in a friend? Do not use any commas in your reply.",
        ("punctuation:no_comma", {}),
    ),
    _p(
        "season-no-comma",
        "Name your favorite season and say why, with no commas at all.",
        ("punctuation:no_comma", {}),
    ),
    _p(
        "toppings-no-comma",
        "Tell me three pizza toppings you like, but don't use a single comma.",
        ("punctuation:no_comma", {}),
    ),
    # case:lowercase
    _p(
        "music-lower",
        "Tell me what kind of music you like. Write your whole reply in lowercase letters only.",
        ("case:lowercase", {}),
    ),
    _p("beach-lower", "Describe a day at the beach, all in lowercase, no capital letters.", ("case:lowercase", {})),
    _p("cook-lower", "What is your favorite thing to cook? Answer entirely in lowercase.", ("case:lowercase", {})),
    _p("sleep-lower", "Give me a tip for sleeping better, using only lowercase letters.", ("case:lowercase", {})),
    # case:uppercase
    _p(
        "exam-upper",
        "Cheer me up before my exam! Write your reply in all capital letters.",
        ("case:uppercase", {}),
    ),
    _p("birthday-upper", "Wish my sister a happy birthday, in ALL CAPS.", ("case:uppercase", {})),
    _p(
        "team-upper",
        "Tell me why people love their home team, entirely in uppercase.",
        ("case:uppercase", {}),
    ),
    _p("office-upper", "Say good morning to the whole office, using only capital letters.", ("case:uppercase", {})),
    # keywords:include
    _p(
        "garden-include",
        "Tell me about your garden and mention the word 'tomato'.",
        ("keywords:include", {"words": ["tomato"]}),
    ),
    _p(
        "travel-include",
        "What is the best way to travel? Include the words 'train' and 'window'.",
        ("keywords:include", {"words": ["train", "window"]}),
    ),
    _p(
        "pet-include",
        "Describe a perfect day for a pet. Use the word 'sunshine' somewhere in your answer.",
        ("keywords:include", {"words": ["sunshine"]}),
    ),
    _p(
        "snack-include",
        "Suggest a snack for a movie night and make sure to say 'popcorn'.",
        ("keywords:include", {"words": ["popcorn"]}),
    ),
    _p(
        "hobby-include",
        "Tell me about a hobby you would like to try, mentioning 'guitar' and 'practice'.",
        ("keywords:include", {"words": ["guitar", "practice"]}),
    ),
    # keywords:exclude
    _p("summer-exclude", "Describe summer without using the word 'hot'.", ("keywords:exclude", {"words": ["hot"]})),
    _p(
        "happy-exclude",
        "Tell me what makes you happy, but don't use the words 'love' or 'like'.",
        ("keywords:exclude", {"words": ["love", "like"]}),
    ),
    _p(
        "food-exclude",
        "What is your favorite food? Don't say 'pizza'.",
        ("keywords:exclude", {"words": ["pizza"]}),
    ),
    _p(
        "weather-exclude",
        "Tell me about today's weather without the word 'sunny'.",
        ("keywords:exclude", {"words": ["sunny"]}),
    ),
    _p(
        "relax-exclude",
        "Describe your favorite place to relax, avoiding the word 'home'.",
        ("keywords:exclude", {"words": ["home"]}),
    ),
    # format:bullets
    _p(
        "picnic-bullets",
        "What should I pack for a picnic? Answer with exactly 3 markdown bullet points.",
        ("format:bullets", {"n": 3}),
    ),
    _p("study-bullets", "Give me exactly 2 study tips as markdown bullet points.", ("format:bullets", {"n": 2})),
    _p("fruit-bullets", "List exactly 4 fruits as markdown bullet points.", ("format:bullets", {"n": 4})),
    _p(
        "habits-bullets",
        "Name exactly three healthy habits, formatted as markdown bullet points.",
        ("format:bullets", {"n": 3}),
    ),
    # format:json
    _p(
        "profile-json",
        "Give me your name and your favorite color. Reply with JSON only.",
        ("format:json", {}),
    ),
    _p("paris-json", "Describe a sunny day in Paris. Your entire reply must be valid JSON.", ("format:json", {})),
    _p("pet-json", "Tell me about an imaginary pet, wrapping your whole answer in JSON.", ("format:json", {})),
    _p("todo-json", "Write my to-do list for tomorrow, and format your entire output as JSON.", ("format:json", {})),
    # format:quotation
    _p(
        "motivate-quote",
        "Give me a motivational line and wrap your entire reply in double quotation marks.",
        ("format:quotation", {}),
    ),
    _p(
        "moving-quote",
        "What would you say to a friend who is moving away? Put your whole answer inside double quotes.",
        ("format:quotation", {}),
    ),
    _p(
        "slogan-quote",
        "Invent a slogan for a lemonade stand, with the whole reply wrapped in double quotes.",
        ("format:quotation", {}),
    ),
    _p(
        "toast-quote",
        "Write a short wedding toast, with your entire response enclosed in double quotation marks.",
        ("format:quotation", {}),
    ),
    # ending:question
    _p(
        "yourself-question",
        "Tell me something about yourself and end your reply with a question.",
        ("ending:question", {}),
    ),
    _p("book-question", "Recommend a book, then finish your message with a question.", ("ending:question", {})),
    _p("greet-question", "Greet me and end with a question mark.", ("ending:question", {})),
    _p("today-question", "Say what you did today. Your last sentence must be a question.", ("ending:question", {})),
    # ending:phrase
    _p(
        "goodnight-phrase",
        'Wish me a good night and end your reply with the exact phrase "Sweet dreams!"',
        ("ending:phrase", {"phrase": "Sweet dreams!"}),
    ),
    _p(
        "gift-phrase",
        'Thank me for the gift and finish with the words "See you soon."',
        ("ending:phrase", {"phrase": "See you soon."}),
    ),
    _p(
        "story-phrase",
        'Tell me a very short story that ends with the exact words "The end."',
        ("ending:phrase", {"phrase": "The end."}),
    ),
    _p(
        "saturday-phrase",
        'Suggest a plan for Saturday. End your reply with "Have fun!"',
        ("ending:phrase", {"phrase": "Have fun!"}),
    ),
    # start:word
    _p("rain-start", "Do you like rainy days? Start your reply with the word 'Yes'.", ("start:word", {"word": "Yes"})),
    _p("day-start", "How was your day? Begin your answer with the word 'Well'.", ("start:word", {"word": "Well"})),
    _p("intro-start", "Introduce yourself, starting your reply with 'Hello'.", ("start:word", {"word": "Hello"})),
    _p(
        "pineapple-start",
        "What do you think of pineapple on pizza? Your first word must be 'Honestly'.",
        ("start:word", {"word": "Honestly"}),
    ),
    # count:sentences_max
    _p("sky-sentences", "Explain why the sky is blue in at most two sentences.", ("count:sentences_max", {"n": 2})),
    _p("breed-sentences", "Tell me about your favorite dog breed in one sentence.", ("count:sentences_max", {"n": 1})),
    _p(
        "tea-sentences",
        "Why do people drink tea? Answer in no more than 3 sentences.",
        ("count:sentences_max", {"n": 3}),
    ),
    _p(
        "tonight-sentences",
        "What are your plans for tonight? Keep it to two sentences or fewer.",
        ("count:sentences_max", {"n": 2}),
    ),
    # letters:count
    _p(
        "zoo-letters",
        "Describe a zoo visit, using the letter 'z' at least 3 times.",
        ("letters:count", {"letter": "z", "n": 3}),
    ),
    _p(
        "queen-letters",
        "Tell me about a queen, with the letter 'q' appearing at least twice.",
        ("letters:count", {"letter": "q", "n": 2}),
    ),
    _p(
        "kitchen-letters",
        "Talk about your kitchen and use the letter 'k' at least 4 times.",
        ("letters:count", {"letter": "k", "n": 4}),
    ),
    _p(
        "fox-letters",
        "Tell me about a fox in a box, using the letter 'x' at least 3 times.",
        ("letters:count", {"letter": "x", "n": 3}),
    ),
    # two instructions at once
    _p(
        "weekend-lower-short",
        "Tell me about your weekend in lowercase only and in at most 15 words.",
        ("case:lowercase", {}),
        ("length:max_words", {"n": 15}),
    ),
    _p(
        "cats-short-question",
        "Describe cats in at most 20 words and end with a question.",
        ("length:max_words", {"n": 20}),
        ("ending:question", {}),
    ),
    _p(
        "trip-include-no-comma",
        "Tell me about a road trip, mention the word 'map', and do not use any commas.",
        ("keywords:include", {"words": ["map"]}),
        ("punctuation:no_comma", {}),
    ),
    _p(
        "dinner-bullets-exclude",
        "Give exactly 3 markdown bullet points of dinner ideas without using the word 'chicken'.",
        ("format:bullets", {"n": 3}),
        ("keywords:exclude", {"words": ["chicken"]}),
    ),
    _p(
        "greet-start-upper",
        "Start your reply with the word 'HELLO' and write everything in capital letters.",
        ("start:word", {"word": "HELLO"}),
        ("case:uppercase", {}),
    ),
    _p(
        "joke-sentences-quote",
        "Tell me a joke in at most 2 sentences, wrapped in double quotes.",
        ("count:sentences_max", {"n": 2}),
        ("format:quotation", {}),
    ),
    _p(
        "saving-long-phrase",
        'Give me advice on saving money in at least 15 words, and end with the exact phrase "Good luck!"',
        ("length:min_words", {"n": 15}),
        ("ending:phrase", {"phrase": "Good luck!"}),
    ),
    _p(
        "moon-lower-question",
        "Ask me something about the moon, all in lowercase, ending with a question mark.",
        ("case:lowercase", {}),
        ("ending:question", {}),
    ),
    _p(
        "ocean-sentences-include",
        "Describe the ocean in at most 2 sentences and use the word 'blue'.",
        ("count:sentences_max", {"n": 2}),
        ("keywords:include", {"words": ["blue"]}),
    ),
    _p(
        "bee-short-letters",
        "Describe a buzzing bee in at most 25 words, using the letter 'z' at least twice.",
        ("length:max_words", {"n": 25}),
        ("letters:count", {"letter": "z", "n": 2}),
    ),
    _p(
        "hobby-start-long",
        "Begin with the word 'Personally' and tell me about your hobby in at least 20 words.",
        ("start:word", {"word": "Personally"}),
        ("length:min_words", {"n": 20}),
    ),
    _p(
        "night-exclude-lower",
        "Write a tiny poem about the night without the word 'star', all in lowercase.",
        ("keywords:exclude", {"words": ["star"]}),
        ("case:lowercase", {}),
    ),
    _p(
        "film-json-exclude",
        "Tell me your favorite movie in JSON format only, without the word 'film'.",
        ("format:json", {}),
        ("keywords:exclude", {"words": ["film"]}),
    ),
    _p(
        "teacher-upper-phrase",
        'Thank your teacher in all capital letters and end with the exact phrase "THANK YOU!"',
        ("case:uppercase", {}),
        ("ending:phrase", {"phrase": "THANK YOU!"}),
    ),
)


def loose_variants(reply: str) -> tuple[str, ...]:
    """IFEval's eight readings of a reply for its loose score: {as is, without the first line, without the last line,
    without both} x {as is, with every ``*`` removed}: a preamble ("Sure! Here it is:"), a sign-off or markdown
    emphasis then does not hide an instruction followed."""
    lines = reply.split("\n")
    trimmed = (
        reply,
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    )
    return (*trimmed, *(text.replace("*", "") for text in trimmed))


def follows(reply: str, checks: Sequence[tuple[str, dict]], loose: bool = False) -> list[bool]:
    """One bool per check: does ``reply`` follow it? Strict reads the reply as is; loose passes a check that any of
    :func:`loose_variants` passes. A blank reading follows nothing (as in IFEval): saying nothing would otherwise
    pass "no commas" or "at most 20 words"."""
    readings = loose_variants(reply) if loose else (reply,)
    results = []
    for instruction, kwargs in checks:
        if instruction not in INSTRUCTIONS:
            raise ValueError(f"Unknown instruction {instruction!r}; known: {', '.join(INSTRUCTIONS)}.")
        checker = INSTRUCTIONS[instruction]
        results.append(any(text.strip() and checker(text, **kwargs) for text in readings))
    return results


def score_instructions(replies: Sequence[str], prompts: Sequence[InstructionPrompt] = PROMPTS) -> dict:
    """Score ``replies[i]`` against ``prompts[i]``.

    Returns:
        ``prompts``: per prompt ``{id, strict, loose, checks: {instruction: {"strict", "loose"}}}`` (a prompt is
        followed when all its checks pass); ``prompt_strict``/``prompt_loose``: the share of prompts followed;
        ``instruction_strict``/``instruction_loose``: the share of single checks passed; ``by_instruction``: per
        instruction id its ``strict`` and ``loose`` shares and its number of checks ``n``; ``n_prompts`` and
        ``n_instructions``. A share over nothing is None.
    """
    if len(replies) != len(prompts):
        raise ValueError(f"{len(replies)} replies for {len(prompts)} prompts: give one reply per prompt, in order.")
    rows = []
    tally: dict[str, list[int]] = {}  # instruction id -> [checks, strict passes, loose passes]
    for reply, prompt in zip(replies, prompts):
        strict = follows(reply, prompt.checks)
        loose = follows(reply, prompt.checks, loose=True)
        checks = {}
        for (instruction, _), s, lo in zip(prompt.checks, strict, loose):
            checks[instruction] = {"strict": s, "loose": lo}
            counts = tally.setdefault(instruction, [0, 0, 0])
            counts[0] += 1
            counts[1] += s
            counts[2] += lo
        rows.append({"id": prompt.id, "strict": all(strict), "loose": all(loose), "checks": checks})
    n_checks = sum(counts[0] for counts in tally.values())
    return {
        "prompts": rows,
        "prompt_strict": _share(sum(row["strict"] for row in rows), len(rows)),
        "prompt_loose": _share(sum(row["loose"] for row in rows), len(rows)),
        "instruction_strict": _share(sum(counts[1] for counts in tally.values()), n_checks),
        "instruction_loose": _share(sum(counts[2] for counts in tally.values()), n_checks),
        "by_instruction": {
            instruction: {"strict": s / n, "loose": lo / n, "n": n}
            for instruction, (n, s, lo) in sorted(tally.items())
        },
        "n_prompts": len(rows),
        "n_instructions": n_checks,
    }


# --------------------------------------------------------------------------------------------------------------------
# 2. Mode-adherence probes
# --------------------------------------------------------------------------------------------------------------------

#: the context modes a probe tests (free chat, ``none``, has no context to keep)
PROBE_MODES: tuple[str, ...] = ("persona", "emotion", "domain", "topic")

#: emotion family -> phrases that acknowledge a feeling of that family; ``any`` holds those that fit every family.
#: Matched as whole words or phrases, case aside, curly apostrophes made straight.
ACKNOWLEDGEMENTS: dict[str, tuple[str, ...]] = {
    "any": (
        "i understand",
        "i can imagine",
        "i can only imagine",
        "i hear you",
        "i feel you",
        "i know how you feel",
        "how do you feel",
        "how are you feeling",
        "that must be",
        "that must have been",
        "must be so",
        "i'm here for you",
    ),
    "happy": (
        "that's great",
        "that is great",
        "that's wonderful",
        "that's awesome",
        "that's amazing",
        "that's fantastic",
        "that's so nice",
        "that's nice",
        "how nice",
        "how wonderful",
        "how exciting",
        "that's exciting",
        "so exciting",
        "so kind",
        "congratulations",
        "congrats",
        "good for you",
        "well done",
        "happy for you",
        "glad to hear",
        "proud of",
        "have fun",
        "enjoy",
    ),
    "sad": (
        "oh no",
        "sorry to hear",
        "i'm sorry",
        "i am sorry",
        "i'm so sorry",
        "so sorry",
        "that's too bad",
        "too bad",
        "that's sad",
        "how sad",
        "that's rough",
        "that sucks",
        "hard time",
        "must be hard",
        "that's awful",
        "that's terrible",
        "hang in there",
        "condolences",
        "my heart goes out",
    ),
    "fear": (
        "oh no",
        "that sounds scary",
        "sounds scary",
        "that's scary",
        "scary",
        "scared",
        "frightening",
        "terrifying",
        "don't worry",
        "do not worry",
        "try not to worry",
        "worried",
        "nervous",
        "stay safe",
        "be careful",
        "you'll be fine",
        "you will be fine",
        "you'll do great",
        "it's normal to",
        "it's okay to",
        "deep breath",
    ),
    "anger": (
        "oh no",
        "that's annoying",
        "how annoying",
        "annoying",
        "frustrating",
        "frustrated",
        "that's not fair",
        "unfair",
        "that's rude",
        "how rude",
        "that's awful",
        "that's terrible",
        "that sucks",
        "upset",
        "mad",
        "sorry to hear",
        "i'm sorry",
    ),
}


def persona_fact(reply: str, *, name: str, hobby: Sequence[str]) -> bool:
    """The persona's ``name`` (a whole word) or one of its ``hobby`` words (whole words), case aside."""
    return _has_word(reply, name) or any(_has_word(reply, word) for word in hobby)


def keeps_context(reply: str, *, keywords: Sequence[str]) -> bool:
    """One of the domain's or topic's ``keywords`` used, case aside, bare or inflected."""
    return any(_has_stem(reply, word) for word in keywords)


def acknowledges(reply: str, *, emotion: str, family: str) -> bool:
    """The ``emotion`` word (bare or inflected) or an acknowledgement of its ``family`` (or of any family)."""
    phrases = (*ACKNOWLEDGEMENTS[family], *ACKNOWLEDGEMENTS["any"])
    return _has_stem(reply, emotion) or any(_has_word(reply, phrase) for phrase in phrases)


#: mode check id -> checker ``(reply, **kwargs) -> bool``
MODE_CHECKS: dict[str, Callable[..., bool]] = {
    "persona:fact": persona_fact,
    "context:keywords": keeps_context,
    "emotion:acknowledged": acknowledges,
}


@dataclass(frozen=True)
class ModeProbe:
    """A message sent under ``mode`` with its ``context``, and the :data:`MODE_CHECKS` check (with kwargs) that the
    reply used the context."""

    id: str
    mode: str
    context: str
    message: str
    check: str
    kwargs: dict


def _persona(id: str, context: str, message: str, name: str, *hobby: str) -> ModeProbe:
    return ModeProbe(id, "persona", context, message, "persona:fact", {"name": name, "hobby": hobby})


def _emotion(id: str, emotion: str, family: str, message: str) -> ModeProbe:
    return ModeProbe(id, "emotion", emotion, message, "emotion:acknowledged", {"emotion": emotion, "family": family})


def _kept(id: str, mode: str, context: str, message: str, *keywords: str) -> ModeProbe:
    return ModeProbe(id, mode, context, message, "context:keywords", {"keywords": keywords})


MODE_PROBES: tuple[ModeProbe, ...] = (
    # persona: a name and a hobby stated, one of them asked back
    _persona(
        "persona-maya-name",
        "My name is Maya. I love hiking in the mountains. I have two cats.",
        "What's your name?",
        "Maya",
        *("hike", "hikes", "hiking", "hiked"),
    ),
    _persona(
        "persona-leo-fun",
        "My name is Leo. I play the guitar every evening.",
        "What do you like to do for fun?",
        "Leo",
        *("guitar", "guitars"),
    ),
    _persona(
        "persona-priya-who",
        "I'm Priya. I spend my weekends painting landscapes.",
        "Who am I talking to?",
        "Priya",
        *("paint", "painting", "paintings", "painter", "landscapes"),
    ),
    _persona(
        "persona-tom-hobby",
        "My name is Tom. I love fishing at the lake near my house.",
        "What's your favorite hobby?",
        "Tom",
        *("fish", "fishing", "lake"),
    ),
    _persona(
        "persona-aiko-name",
        "My name is Aiko. Baking bread is my passion. I work in an office.",
        "Tell me your name.",
        "Aiko",
        *("bake", "baking", "bread", "baker"),
    ),
    _persona(
        "persona-carlos-mornings",
        "I am Carlos. I go surfing every morning before work.",
        "How do you spend your mornings?",
        "Carlos",
        *("surf", "surfing", "surfer", "surfboard"),
    ),
    _persona(
        "persona-elena-free-time",
        "My name is Elena. I am a big fan of chess and play it every day.",
        "What do you do in your free time?",
        "Elena",
        "chess",
    ),
    _persona(
        "persona-sam-hobbies",
        "My name is Sam. I love gardening and growing tomatoes.",
        "Do you have any hobbies?",
        "Sam",
        *("garden", "gardening", "tomato", "tomatoes"),
    ),
    _persona(
        "persona-noah-name",
        "I'm Noah. I read science fiction novels. My favorite color is green.",
        "Sorry, what was your name again?",
        "Noah",
        *("read", "reading", "novel", "novels", "science fiction"),
    ),
    _persona(
        "persona-zara-happy",
        "My name is Zara. Dancing salsa makes me happy.",
        "What makes you smile?",
        "Zara",
        *("dance", "dancing", "salsa"),
    ),
    # emotion: a user in that situation; the reply acknowledges the feeling
    _emotion("emotion-grateful-lawn", "grateful", "happy", "My neighbor mowed my lawn while I was sick last week."),
    _emotion("emotion-afraid-noises", "afraid", "fear", "I heard strange noises outside my window last night."),
    _emotion("emotion-sad-dog", "sad", "sad", "My dog passed away yesterday."),
    _emotion("emotion-excited-band", "excited", "happy", "I'm going to see my favorite band next week!"),
    _emotion("emotion-angry-car", "angry", "anger", "Someone scratched my car in the parking lot and drove off."),
    _emotion(
        "emotion-lonely-dinner", "lonely", "sad", "All my friends moved away and I eat dinner alone most nights."
    ),
    _emotion("emotion-proud-graduate", "proud", "happy", "My daughter just graduated from college!"),
    _emotion("emotion-anxious-interview", "anxious", "fear", "I have a big job interview tomorrow morning."),
    _emotion("emotion-disappointed-promotion", "disappointed", "sad", "I didn't get the promotion I worked hard for."),
    _emotion("emotion-annoyed-neighbor", "annoyed", "anger", "My upstairs neighbor plays loud music every night."),
    _emotion("emotion-terrified-flight", "terrified", "fear", "I have to fly on a plane for the first time."),
    _emotion("emotion-joyful-baby", "joyful", "happy", "We just found out we're having a baby!"),
    # domain: a message that does not name the domain; the reply stays in it
    _kept(
        "domain-restaurant",
        "domain",
        "restaurant booking",
        "Hi, I need some help for tonight.",
        *("restaurant", "table", "book", "booking", "reservation", "reserve", "dinner", "menu", "cuisine", "food"),
    ),
    _kept(
        "domain-vacation",
        "domain",
        "vacation ideas",
        "I have two weeks off in July. Any thoughts?",
        *("vacation", "holiday", "trip", "travel", "visit", "beach", "destination", "explore", "island", "tour"),
        *("relax", "mountain", "city", "country", "europe", "hike", "sightseeing"),
    ),
    _kept(
        "domain-hotel",
        "domain",
        "hotel booking",
        "I'll be in Boston for three nights.",
        *("hotel", "room", "book", "booking", "reservation", "reserve", "stay", "check-in", "suite", "bed"),
        "accommodation",
    ),
    _kept(
        "domain-flight",
        "domain",
        "flight booking",
        "I need to be in Chicago on Friday morning.",
        *("flight", "fly", "flies", "airline", "airport", "ticket", "book", "booking", "depart", "plane", "seat"),
    ),
    _kept(
        "domain-pizza",
        "domain",
        "pizza ordering",
        "I'm hungry, what do you have?",
        *("pizza", "topping", "cheese", "pepperoni", "crust", "order", "deliver", "delivery", "slice", "margherita"),
        "vegetarian",
    ),
    _kept(
        "domain-movie-tickets",
        "domain",
        "movie tickets",
        "What's good this weekend?",
        *("movie", "film", "ticket", "seat", "showtime", "cinema", "theater", "theatre", "screening"),
    ),
    _kept(
        "domain-coffee",
        "domain",
        "coffee ordering",
        "Good morning! I'll have my usual.",
        *("coffee", "latte", "espresso", "cappuccino", "mocha", "tea", "drink", "cup", "brew", "order", "milk"),
    ),
    _kept(
        "domain-weather",
        "domain",
        "weather forecast",
        "Should I bring an umbrella?",
        *("weather", "rain", "rainy", "sunny", "cloud", "cloudy", "forecast", "temperature", "degree", "wind"),
        *("storm", "snow", "cold", "warm", "hot", "shower"),
    ),
    _kept(
        "domain-car-repair",
        "domain",
        "car repair",
        "It's making a strange noise again.",
        *("car", "engine", "mechanic", "repair", "brake", "tire", "tyre", "oil", "garage", "fix", "service"),
    ),
    _kept(
        "domain-recipes",
        "domain",
        "recipe suggestions",
        "What should I make tonight?",
        *("recipe", "cook", "bake", "ingredient", "pasta", "chicken", "salad", "soup", "oven", "dish", "meal"),
        "dinner",
    ),
    # topic: a message that does not name the topic; the reply stays on it
    _kept(
        "topic-chess",
        "topic",
        "chess",
        "What should I learn next?",
        *("chess", "pawn", "knight", "bishop", "rook", "queen", "king", "checkmate", "opening", "grandmaster"),
    ),
    _kept(
        "topic-cooking",
        "topic",
        "cooking",
        "Tell me something interesting.",
        *("cook", "recipe", "food", "kitchen", "dish", "ingredient", "bake", "meal", "chef", "flavor", "flavour"),
        *("spice", "oven"),
    ),
    _kept(
        "topic-space",
        "topic",
        "space",
        "What's on your mind today?",
        *("space", "star", "planet", "moon", "galaxy", "galaxies", "universe", "astronaut", "rocket", "orbit"),
        *("solar", "mars", "nasa", "telescope"),
    ),
    _kept(
        "topic-football",
        "topic",
        "football",
        "Did you catch it last night?",
        *("football", "soccer", "goal", "team", "player", "match", "league", "score", "kick", "striker"),
        *("world cup", "game"),
    ),
    _kept(
        "topic-music",
        "topic",
        "music",
        "What do you do on a lazy Sunday?",
        *("music", "song", "band", "album", "listen", "guitar", "piano", "sing", "concert", "jazz", "rock"),
        *("melody", "playlist", "artist"),
    ),
    _kept(
        "topic-dogs",
        "topic",
        "dogs",
        "Any tips for me?",
        *("dog", "puppy", "puppies", "pup", "walk", "train", "training", "leash", "breed", "bark", "vet", "treat"),
        "fetch",
    ),
    _kept(
        "topic-gardening",
        "topic",
        "gardening",
        "What should I do this spring?",
        *("garden", "plant", "flower", "seed", "soil", "grow", "vegetable", "weed", "prune", "bloom", "compost"),
    ),
    _kept(
        "topic-photography",
        "topic",
        "photography",
        "I just got a new gadget!",
        *("photo", "photography", "camera", "lens", "picture", "shot", "shoot", "focus", "image", "portrait"),
        *("exposure", "photographer"),
    ),
    _kept(
        "topic-video-games",
        "topic",
        "video games",
        "How should I spend my evening?",
        *("game", "gaming", "gamer", "console", "play", "level", "controller", "nintendo", "xbox", "playstation"),
        *("zelda", "minecraft", "mario"),
    ),
    _kept(
        "topic-history",
        "topic",
        "history",
        "Tell me a fun fact.",
        *("history", "historical", "historian", "ancient", "empire", "century", "centuries", "revolution"),
        *("roman", "rome", "egypt", "egyptian", "medieval", "king", "queen", "war", "wars", "pharaoh"),
    ),
)


def score_modes(replies: Sequence[str], probes: Sequence[ModeProbe] = MODE_PROBES) -> dict:
    """Score ``replies[i]`` against ``probes[i]``.

    Returns:
        ``probes``: per probe ``{id, mode, passed}``; ``by_mode``: per mode (in :data:`PROBE_MODES` order, then any
        other) the share passed; ``overall``: the share of all probes passed (None over nothing); ``n``: probes.
    """
    if len(replies) != len(probes):
        raise ValueError(f"{len(replies)} replies for {len(probes)} probes: give one reply per probe, in order.")
    rows = [
        {"id": probe.id, "mode": probe.mode, "passed": bool(MODE_CHECKS[probe.check](reply, **probe.kwargs))}
        for reply, probe in zip(replies, probes)
    ]
    seen = {row["mode"] for row in rows}
    modes = [mode for mode in PROBE_MODES if mode in seen] + sorted(seen - set(PROBE_MODES))
    by_mode = {}
    for mode in modes:
        passed = [row["passed"] for row in rows if row["mode"] == mode]
        by_mode[mode] = sum(passed) / len(passed)
    return {
        "probes": rows,
        "by_mode": by_mode,
        "overall": _share(sum(row["passed"] for row in rows), len(rows)),
        "n": len(rows),
    }


# --------------------------------------------------------------------------------------------------------------------
# 3. Reply statistics
# --------------------------------------------------------------------------------------------------------------------

#: a reply repeating one 4-gram this many times has run away (a generation loop)
RUNAWAY_NGRAM = 4
RUNAWAY_REPEATS = 3


def _ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repeats_ngram(reply: str, n: int = RUNAWAY_NGRAM, times: int = RUNAWAY_REPEATS) -> bool:
    """Some ``n``-gram of lowercased whitespace tokens occurs ``times`` or more times (occurrences may overlap)."""
    counts = Counter(_ngrams(reply.lower().split(), n))
    return bool(counts) and max(counts.values()) >= times


def is_runaway(reply: str, hit_limit: bool) -> bool:
    """A reply that ran away: it hit its length limit, or it loops (:func:`repeats_ngram`)."""
    return bool(hit_limit) or repeats_ngram(reply)


def reply_stats(replies: Sequence[str], max_new_tokens_hit: Sequence[bool] | None = None) -> dict:
    """Length, diversity and failure counts of a set of replies.

    Args:
        replies: the generated replies.
        max_new_tokens_hit: per reply, whether generation stopped at its length limit (None: unknown, not counted).

    Returns:
        ``n``; ``mean_words`` (whitespace tokens per reply); ``distinct_2`` (distinct bigrams over all bigrams, both
        within replies, on lowercased whitespace tokens; Li et al. 2016) with ``bigrams`` and ``distinct_bigrams``;
        ``empty`` and ``empty_share`` (replies of nothing but whitespace); ``runaway`` and ``runaway_share``
        (replies that hit the length limit or repeat a 4-gram 3 or more times). A share over nothing is None.
    """
    if max_new_tokens_hit is not None and len(max_new_tokens_hit) != len(replies):
        raise ValueError(
            f"{len(max_new_tokens_hit)} max_new_tokens_hit flags for {len(replies)} replies: give one per reply."
        )
    hit = list(max_new_tokens_hit) if max_new_tokens_hit is not None else [False] * len(replies)
    tokens = [reply.lower().split() for reply in replies]
    bigrams = [gram for reply_tokens in tokens for gram in _ngrams(reply_tokens, 2)]
    empty = sum(not reply.strip() for reply in replies)
    runaway = sum(is_runaway(reply, flag) for reply, flag in zip(replies, hit))
    return {
        "n": len(replies),
        "mean_words": _share(sum(len(t) for t in tokens), len(replies)),
        "distinct_2": _share(len(set(bigrams)), len(bigrams)),
        "bigrams": len(bigrams),
        "distinct_bigrams": len(set(bigrams)),
        "empty": empty,
        "empty_share": _share(empty, len(replies)),
        "runaway": runaway,
        "runaway_share": _share(runaway, len(replies)),
    }
