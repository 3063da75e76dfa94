"""Saving: the streaming safetensors writer (``writer``), ZeRO fp32 consolidation and the trainer's save (``zero``),
crash-safe checkpoints (``checkpoints``), serving-ready exports (``export``) and the model-directory classifier
(``model_dir``)."""
