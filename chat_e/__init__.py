"""Chat-E, the product on top of hf-ext, in layers: ``data`` (the dialogue format, corpora, models, a chat made
plain, settings and limits), ``engines`` (local, remote and gated, behind one protocol), ``feedback`` (the database,
its exports and the leaderboard), ``web`` (the Gradio UI and arena) and ``http`` (the OpenAI-compatible API and the
guard); ``server`` and ``chat-e`` (``__main__``) put them together."""
