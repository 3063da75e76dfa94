"""What the browser tests share: Debian's headless Chromium (``make browser``) driven by playwright (no browser
download), the chat page's selectors and waits, and screenshots kept for the docs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BOT = "#chatbot [data-testid='bot']"
USER = "#chatbot [data-testid='user']"

needs_chromium = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason="needs Debian's chromium at /usr/bin/chromium: run `make browser`"
)


def texts(page, selector: str) -> list[str]:
    return [" ".join(t.split()) for t in page.locator(selector).all_inner_texts()]


def wait_for_bot(page, count: int, reply: str | None = None) -> None:
    """Until the chat shows ``count`` bot messages, the last one reading ``reply`` (the stream has finished; None:
    any non-empty text)."""
    page.wait_for_function(
        """([sel, n, want]) => {
            const bots = document.querySelectorAll(sel);
            if (bots.length !== n) return false;
            const text = bots[n - 1].innerText.split(/\\s+/).join(" ").trim();
            return want === null ? text.length > 0 : text === want;
        }""",
        arg=[BOT, count, reply],
        timeout=120_000,
    )


def keep_screenshot(shot: Path, name: str) -> None:
    """``CHAT_E_SCREENSHOTS=DIR`` keeps the test's screenshot as ``DIR/name`` (how the docs' were made)."""
    if os.environ.get("CHAT_E_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["CHAT_E_SCREENSHOTS"]) / name)


def wait_for_reply(page, count: int) -> None:
    """Until the chat's ``count``-th reply is complete: shown, and the message box given back (the UI locks it while
    a reply streams, and a reply can be rated only once it is complete)."""
    wait_for_bot(page, count)
    page.wait_for_function("() => !document.querySelector('#message textarea').disabled", timeout=120_000)
