"""Chat-E's seams without a model: a chat's shapes made plain turns (chat_e.data.messages), the mode names, and each
generation setting declared once (the CLI flags and the UI controls are built from the declaration)."""

from __future__ import annotations

import argparse

import pytest

from chat_e.__main__ import build_parser, parse
from chat_e.data.dialogue import MODES, normalize_mode
from chat_e.data.limits import ChatLimits, check_request
from chat_e.data.messages import (
    MAX_HISTORY_TURNS,
    MAX_MESSAGE_CHARS,
    history_turns,
    message_text,
    plain_turn,
    stripped_pieces,
)
from chat_e.data.settings import SETTING_NAMES, GenerationSettings, setting_ranges

HISTORY = ["hello, who are you?", "I am a bot. And you?", "a person who likes cats"]
#: the generation settings, written out: a setting added to (or dropped from) the declaration must show up here
DECLARED = ["num_beams", "do_sample", "temperature", "top_p", "max_new_tokens", "min_new_tokens"]


# ---- a chat's shapes -> plain turns ---------------------------------------------------------------------------------


def test_history_formats_give_the_same_turns():
    as_messages = [
        {"role": "system", "content": "not a turn"},
        {"role": "user", "content": HISTORY[0]},
        {"role": "assistant", "content": [{"type": "text", "text": HISTORY[1]}]},  # gradio 6's normalized content
        {"role": "user", "content": "a person"},
        {"role": "user", "content": "who likes  cats"},  # same speaker twice: one MuDoConv turn
        {"role": "assistant", "content": "   "},
    ]
    assert history_turns(as_messages) == [HISTORY[0], HISTORY[1], "a person who likes cats"]
    assert history_turns([[HISTORY[0], HISTORY[1]], [HISTORY[2], None]]) == HISTORY
    assert history_turns(HISTORY) == HISTORY
    assert history_turns(None) == []


def test_turns_are_cleaned_cut_and_the_newest_kept():
    assert plain_turn("  what\n do you\tlike? ") == "what do you like?"
    assert history_turns([" hi ", {"role": "user", "content": "x" * 3000}]) == ["hi", "x" * MAX_MESSAGE_CHARS]
    assert plain_turn("y" * 2500) == "y" * MAX_MESSAGE_CHARS
    # the newest message is a turn of its own, even after a user's message (never joined with the history)
    assert (plain_turn("again"), history_turns([{"role": "user", "content": "first"}])) == ("again", ["first"])
    many = [f"turn {i}" for i in range(MAX_HISTORY_TURNS + 5)]
    assert history_turns(many) == many[-MAX_HISTORY_TURNS:]
    assert message_text([{"type": "text", "text": "a"}, {"file": "x.png"}, "b"]) == "a b"


def test_nul_characters_are_dropped_from_what_users_send_and_models_reply():
    """PostgreSQL's text cannot hold NUL (psycopg: "PostgreSQL text fields cannot contain NUL (0x00) bytes"), and a
    random-init model's byte tokens decode to it: neither a user's text nor a reply keeps it."""
    checked = check_request(ChatLimits(), message="hi\x00 there", context="a\x00b", history=["x\x00y"])
    assert (checked.message, checked.context, checked.history) == ("hi there", "ab", ["xy"])
    assert "".join(stripped_pieces([" \x00", "ok\x00", "\x00 fine", "\x00"])) == "ok fine"
    assert "".join(stripped_pieces(["\x00 x \x00"])) == "x"


@pytest.mark.parametrize(
    "name, mode",
    [("persona", "persona"), ("Emotion", "emotion"), (" domain ", "domain"), ("topic", "topic")]
    + [("free", "none"), ("none", "none"), ("", "none"), (None, "none")],
)
def test_mode_names(name, mode):
    assert normalize_mode(name) == mode in MODES
    assert normalize_mode(mode) == mode  # a normalized name stays


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="Unknown context mode 'pirate'; choose one of persona, emotion, domain"):
        normalize_mode("pirate")


# ---- each generation setting declared once ---------------------------------------------------------------------------


def test_the_declaration_is_the_settings():
    assert list(SETTING_NAMES) == DECLARED
    defaults = GenerationSettings()
    assert defaults.replace(num_beams=1, top_p=None) == GenerationSettings(num_beams=1)
    with pytest.raises(TypeError, match="Unknown generation setting"):
        defaults.replace(beams=3)
    # every slider has a range; the reply lengths' highest is the model's
    assert setting_ranges(127) == {
        "num_beams": (1, 10),
        "temperature": (0.05, 2.0),
        "top_p": (0.05, 1.0),
        "max_new_tokens": (1, 127),
        "min_new_tokens": (0, 127),
    }


def test_cli_flags_are_the_declared_settings():
    parser = build_parser().parse_args(["serve", "--model", "m"]).command_parser
    (group,) = [g for g in parser._action_groups if g.title.startswith("generation defaults")]
    assert [a.dest for a in group._group_actions] == DECLARED
    flags = {a.dest: a.option_strings for a in group._group_actions}
    assert flags == {
        "num_beams": ["--num_beams", "--num-beams"],
        "do_sample": ["--do_sample", "--no-do_sample", "--do-sample", "--no-do-sample"],
        "temperature": ["--temperature"],
        "top_p": ["--top_p", "--top-p"],
        "max_new_tokens": ["--max_new_tokens", "--max-new-tokens"],
        "min_new_tokens": ["--min_new_tokens", "--min-new-tokens"],
    }
    assert isinstance(group._group_actions[1], argparse.BooleanOptionalAction)
    args = parser.parse_args(
        ["--model", "m", "--num-beams", "3", "--no-do_sample", "--temperature", "0.5", "--top-p", "0.9"]
        + ["--max_new_tokens", "20", "--min-new-tokens", "2"]
    )
    given = {name: getattr(args, name) for name in DECLARED}
    assert given == dict(num_beams=3, do_sample=False, temperature=0.5, top_p=0.9, max_new_tokens=20, min_new_tokens=2)
    assert all(type(given[name]) is type(getattr(GenerationSettings(), name)) for name in DECLARED)
    unset = parser.parse_args(["--model", "m"])
    assert all(getattr(unset, name) is None for name in DECLARED)  # the model's own defaults apply


def test_ui_controls_are_the_declared_settings():
    gr = pytest.importorskip("gradio")  # the app extra
    from chat_e.web.ui import RESPOND_PARAMETERS, setting_controls

    settings = GenerationSettings(num_beams=12, max_new_tokens=500)
    with gr.Blocks():
        controls = setting_controls(settings, setting_ranges(127))
    assert [c.label for c in controls] == DECLARED
    assert [type(c).__name__ for c in controls] == ["Slider", "Checkbox", "Slider", "Slider", "Slider", "Slider"]
    sliders = {c.label: (c.minimum, c.maximum, c.step, c.value) for c in controls if isinstance(c, gr.Slider)}
    assert sliders == {
        "num_beams": (1, 10, 1, 10),  # a default outside the range is brought into it
        "temperature": (0.05, 2.0, 0.05, 1.0),
        "top_p": (0.05, 1.0, 0.05, 1.0),
        "max_new_tokens": (1, 127, 1, 127),
        "min_new_tokens": (0, 127, 1, 19),
    }
    assert RESPOND_PARAMETERS == ("chat", "mode", "context", *DECLARED)


def test_chat_e_lists_its_subcommands_and_serves_by_default():
    help_text = build_parser().format_help()
    assert "{serve,arena,feedback,train,eval}" in help_text and "Serve a model (the default command)." in help_text
    assert parse(["--model", "m"])[0].command == "serve"  # chat-e --model DIR, as the docs write it
    args, parser = parse(["arena", "--model", "a", "--model", "b", "--seed", "3"])
    assert (args.command, args.model, args.seed, parser.prog) == ("arena", ["a", "b"], 3, "chat-e arena")
    args, _ = parse(["feedback", "export", "--format", "dpo", "--out", "rows.jsonl"])
    assert (args.command, args.feedback_command, args.format) == ("feedback", "export", "dpo")


# ---- the engines' one interface -------------------------------------------------------------------------------------


def test_every_engine_is_a_chat_engine_and_the_gate_adds_nothing_else():
    from chat_e.engines.base import ChatEngine
    from chat_e.engines.gate import GatedEngine
    from chat_e.engines.local import LocalEngine
    from chat_e.engines.remote import RemoteEngine

    remote = RemoteEngine("http://127.0.0.1:9/v1", "some-model")  # nothing is contacted until a reply
    gated = GatedEngine(remote, concurrency=1)
    assert ChatEngine in LocalEngine.__mro__ and isinstance(remote, ChatEngine) and isinstance(gated, ChatEngine)
    assert (gated.name, gated.max_positions, gated.info, gated.describe()) == (
        remote.name, remote.max_positions, remote.info, remote.describe(),
    )  # fmt: skip
    assert gated.default_settings() == remote.default_settings()
    assert not hasattr(gated, "request_fields")  # the remote engine's own method: the gate forwards the protocol only


# ---- chat-e train ---------------------------------------------------------------------------------------------------


def test_chat_e_train_runs_the_installed_training_under_the_launcher_asked_for():
    from chat_e.training.launch import command, executable

    flags = ["--", "--config", "c.yaml", "--output_dir", "out"]
    assert command("dpo", "torchrun", 2, flags) == [
        executable("torchrun"), "--nproc_per_node", "2", "-m", "chat_e.training.preference",
        "--config", "c.yaml", "--output_dir", "out", "--loss", "dpo",
    ]  # fmt: skip
    assert command("sft", "deepspeed", 2, flags)[:5] == [
        executable("deepspeed"), "--num_gpus", "2", "--module", "chat_e.training.dialogue",
    ]  # fmt: skip
    assert command("kto", "python", 1, flags)[1:4] == ["-m", "chat_e.training.preference", "--config"]
    assert command("kto", "python", 1, flags)[-2:] == ["--loss", "kto"]
    with pytest.raises(ValueError, match="one process"):
        command("sft", "python", 2, flags)
    args, parser = parse(["train", "--method", "sft", "--nproc", "2", "--", "--max_steps", "3"])
    assert (args.method, args.launcher, args.nproc, args.training_args) == (
        "sft",
        "torchrun",
        2,
        flags[:1] + ["--max_steps", "3"],
    )
    assert parser.prog == "chat-e train"
