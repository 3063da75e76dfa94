"""Saving: the streaming safetensors writer (``writer``), ZeRO gather and fp32 consolidation (``gather``, ``zero``),
crash-safe checkpoints (``checkpoints``), serving-ready exports (``export``) and the model-directory classifier
(``model_dir``)."""
