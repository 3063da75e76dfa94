"""The generation eval's settings: the fields :class:`hf_ext.Seq2SeqTrainingArguments` carries for it, and the ones
:class:`~hf_ext.evaluation.bleu.BleuEvalConfig` adds for a stock ``Trainer`` user. The evaluation reads its settings
from here, never from the training arguments' module."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class GenerationEvalArguments:
    """The generation-eval fields of :class:`Seq2SeqTrainingArguments` (BLEU/chrF at every evaluation).

    Args:
        generation_eval (`bool`, defaults to `True`):
            Generate at each evaluation and log ``eval_bleu``, ``eval_chrf``, ``eval_gen_len`` and samples.
        generation_min_length (`int`, *optional*):
            ``min_length`` of eval generations (default: the model's generation config).
        generation_no_repeat_ngram_size (`int`, *optional*):
            ``no_repeat_ngram_size`` of eval generations (default: the model's).
        generation_batch_size (`int`, *optional*):
            Examples per ``generate()`` call and rank (default: ``per_device_eval_batch_size``).
        generation_bucket_by_length (`bool`, defaults to `True`):
            Sort eval examples by length before batching (the output keeps the original order).
        log_samples (`int`, defaults to 5):
            (context, generation, reference) rows printed and logged at each evaluation.
        save_generations (`bool`, defaults to `True`):
            Write every row to ``output_dir/generations/step-N.jsonl``.
        generation_gather_weights (`str`, defaults to `"auto"`):
            Under ZeRO-3: gather the weights once per evaluation and generate on a plain local copy (``"true"``), or
            generate on the partitioned model, which gathers every layer at every decoding step (``"false"``).
            ``"auto"`` gathers once when the copy fits beside the training state (the memory plan, else the memory
            free on each rank).
    """

    generation_eval: bool = field(
        default=True,
        metadata={"help": "Generate at each evaluation and log eval_bleu/eval_chrf/eval_gen_len and samples."},
    )
    generation_min_length: int | None = field(
        default=None,
        metadata={"help": "min_length for generation during evaluation/prediction (default: the model's)."},
    )
    generation_no_repeat_ngram_size: int | None = field(
        default=None, metadata={"help": "no_repeat_ngram_size for eval generation (default: the model's)."}
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Examples per generate() call and rank (default: per_device_eval_batch_size)."},
    )
    generation_bucket_by_length: bool = field(
        default=True,
        metadata={"help": "Sort eval examples into length buckets before generating (output order is kept)."},
    )
    log_samples: int = field(
        default=5,
        metadata={"help": "(context, generation, reference) rows printed and logged at each evaluation."},
    )
    save_generations: bool = field(
        default=True, metadata={"help": "Write every generation row to output_dir/generations/step-N.jsonl."}
    )
    generation_gather_weights: str = field(
        default="auto",
        metadata={
            "help": "ZeRO-3 generation eval: gather the weights once per evaluation (true), per decoding step "
            "(false), or once when the copy fits the memory (auto).",
            "choices": ["auto", "true", "false"],
        },
    )

    def _validate_generation_eval(self) -> None:
        if self.generation_batch_size is not None and self.generation_batch_size < 1:
            raise ValueError(f"`generation_batch_size` must be >= 1 or None, got {self.generation_batch_size}.")
        if self.log_samples < 0:
            raise ValueError(f"`log_samples` must be >= 0, got {self.log_samples}.")
        self.generation_gather_weights = str(self.generation_gather_weights).strip().lower()
        if self.generation_gather_weights not in ("auto", "true", "false"):
            raise ValueError(
                f"`generation_gather_weights` must be auto, true or false, got {self.generation_gather_weights!r}."
            )
