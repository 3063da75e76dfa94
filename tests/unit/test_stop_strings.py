"""The OpenAI API's ``stop`` over a streamed reply (chat_e.http.openai_api.StopScanner): the text a client is shown
is the reply cut before the first stop string, however the reply is split into pieces. Oracle: ``str.find`` on the
whole reply."""

from __future__ import annotations

import pytest

from chat_e.http.openai_api import StopScanner

REPLY = "I love hiking. Do you? I hike every weekend."


def shown(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    scanner = StopScanner(stops)
    text = "".join(scanner.feed(p) for p in pieces) + scanner.flush()
    return text, scanner.stopped


def cut(text: str, stops: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


@pytest.mark.parametrize("stops", [["Do you"], ["?", "weekend"], ["weekend", "hiking."], ["absent"], ["I"]])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_any_split_shows_the_reply_up_to_the_first_stop_string(stops, size):
    pieces = [REPLY[i : i + size] for i in range(0, len(REPLY), size)]
    assert shown(pieces, stops) == (cut(REPLY, stops), cut(REPLY, stops) != REPLY)


def test_nothing_is_shown_after_a_stop():
    scanner = StopScanner(["?"])
    assert scanner.feed("Really? Yes") == "Really"
    assert scanner.feed(" more") == "" and scanner.flush() == ""
