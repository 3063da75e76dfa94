"""Chat-E over HTTP without its UI: the OpenAI-compatible API (``openai_api``) and the guard in front of every
request (``guard``: login, API key, body size, a full queue). Never imports the web UI."""
