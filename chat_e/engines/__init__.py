"""Chat-E's engines behind one protocol (:class:`chat_e.engines.base.ChatEngine`): a model in this process
(``local``), a remote OpenAI-compatible server (``remote``), and either with a limit on the replies generated at once
(``gate``). No Gradio, FastAPI or SQLAlchemy here."""
