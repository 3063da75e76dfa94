"""LoRA in Chat-E's recipes: the settings, declared once for every recipe's command line and YAML, and the peft config
they make."""

from __future__ import annotations

from dataclasses import dataclass, field

from peft import LoraConfig


@dataclass
class LoraArguments:
    """Full fine-tuning, or LoRA adapters (saved alone and merged)."""

    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules that get adapters (default: all-linear, the attention and MLP projections)."},
    )
    merge_adapter: bool = field(
        default=True,
        metadata={
            "help": "With use_peft: save the adapter in OUTPUT_DIR/adapter and the merged model in OUTPUT_DIR "
            "(what chat-e --model OUTPUT_DIR serves)."
        },
    )

    def lora_config(self, task_type: str) -> LoraConfig | None:
        """The adapters these settings ask for (``task_type``: ``CAUSAL_LM`` or ``SEQ_2_SEQ_LM``), or ``None``."""
        if not self.use_peft:
            return None
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.lora_target_modules or "all-linear",
            task_type=task_type,
        )
