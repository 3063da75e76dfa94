"""Chat-E's Gradio UI: the chat (``ui``) and the blind arena (``arena``). Never imports the HTTP API."""
