"""Chat-E, the product on top of hf-ext: the dialogue format, the corpora, the models a recipe builds, the chat engine
and its Gradio app (``chat-e``)."""
