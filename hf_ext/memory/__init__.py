"""Memory planning: the ZeRO formulas with DeepSpeed's buffers (``formulas``, pure), the activation probe
(``probe``), the ``"auto"`` choices (``auto``) and the measured peak beside the plan (``measure``)."""
