"""Evaluation: BLEU/chrF generation eval (``bleu``) and evaluation without a DeepSpeed engine on ZeRO-1/2
(``zero_eval``)."""
