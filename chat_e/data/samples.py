"""Chat-E's example contexts and opening messages: what the UI offers a newcomer and what the recipe prints replies
to. No Gradio here (the recipe imports it)."""

from __future__ import annotations

#: one example context per mode (free chat has none): the UI's context examples
EXAMPLES: dict[str, str] = {
    "persona": "My name is Chat-E. I'm helpful, creative, clever, sarcastic and very friendly.",
    "emotion": "happy",
    "domain": "vacation ideas",
    "topic": "favorite foods",
}
#: one opening message per mode, with the mode's example context: what a newcomer would try first (the recipe prints
#: the base and the fine-tuned model's replies to them)
SAMPLE_CHATS: tuple[tuple[str, str | None, str], ...] = (
    ("persona", EXAMPLES["persona"], "Hi! Who are you?"),
    ("emotion", EXAMPLES["emotion"], "I just got the job I wanted!"),
    ("domain", EXAMPLES["domain"], "Where should I go this summer?"),
    ("topic", EXAMPLES["topic"], "What's the best thing you've ever eaten?"),
    ("free", None, "Do you have any pets?"),
)
