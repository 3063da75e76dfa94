"""Chat-E's generation settings, each declared once: :class:`GenerationSettings`' fields.

A field's type, default and metadata say everything the rest of Chat-E needs: ``chat-e``'s flags
(:func:`chat_e.__main__.build_parser`), the UI's controls and their order, the ``respond`` endpoint's parameters
(:func:`chat_e.web.ui.build_app`) and the ranges a request's settings are checked against
(:func:`chat_e.data.limits.check_request`). A setting added here appears in all of them; how it reaches ``generate``
is the engine's to say (``LocalEngine._generation_config``), and how a model's defaults fill it,
:meth:`GenerationSettings.from_generation_config`'s.

No torch and no Gradio here: ``chat-e --help`` and the UI's module import it.
"""

from __future__ import annotations

import typing
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any

#: the highest of a reply length's UI range: the model's longest reply (its position window less the start token),
#: known once a model is loaded
MODEL_LIMIT = None


def setting(default: Any, help: str, ui: tuple[float, float | None, float] | None = None) -> Any:
    """A generation setting's field: ``help`` for ``chat-e --help``; ``ui`` the UI slider's ``(lowest, highest,
    step)`` (``highest`` :data:`MODEL_LIMIT`: the model's), None for a bool (a checkbox)."""
    return field(default=default, metadata={"help": help, "ui": ui})


@dataclass
class GenerationSettings:
    """Per-reply generation settings; :meth:`chat_e.engines.base.ChatEngine.default_settings` fills them from the model's
    defaults. The fields' order is the UI's and the ``respond`` endpoint's."""

    num_beams: int = setting(10, "Beams for beam search; 1 streams token by token.", ui=(1, 10, 1))
    do_sample: bool = setting(False, "Sample instead of searching for the likeliest reply.")
    temperature: float = setting(1.0, "Sampling temperature (only with do_sample).", ui=(0.05, 2.0, 0.05))
    top_p: float = setting(1.0, "Nucleus sampling mass (only with do_sample).", ui=(0.05, 1.0, 0.05))
    max_new_tokens: int = setting(59, "Longest reply in tokens.", ui=(1, MODEL_LIMIT, 1))
    min_new_tokens: int = setting(19, "Shortest reply in tokens.", ui=(0, MODEL_LIMIT, 1))

    @classmethod
    def from_generation_config(cls, config, is_encoder_decoder: bool = True) -> GenerationSettings:
        """A model's defaults as settings. An encoder-decoder's ``max_length`` counts the decoder start token; a
        decoder-only model's counts the prompt too, so only its ``max_new_tokens`` / ``min_new_tokens`` apply."""
        if is_encoder_decoder:
            max_new = config.max_new_tokens or max(int(config.max_length or 60) - 1, 1)
            min_new = (
                config.min_new_tokens if config.min_new_tokens is not None else max(int(config.min_length or 0) - 1, 0)
            )
        else:
            max_new, min_new = config.max_new_tokens or 48, config.min_new_tokens or 0
        return cls(
            num_beams=int(config.num_beams or 1),
            do_sample=bool(config.do_sample),
            temperature=float(config.temperature if config.temperature is not None else 1.0),
            top_p=float(config.top_p if config.top_p is not None else 1.0),
            max_new_tokens=int(max_new),
            min_new_tokens=int(min_new),
        )

    def replace(self, **overrides) -> GenerationSettings:
        """These settings with ``overrides`` (None: keep); an unknown name is a ``TypeError``."""
        unknown = sorted(set(overrides) - set(SETTING_NAMES))
        if unknown:
            raise TypeError(f"Unknown generation setting(s) {unknown}; choose from {sorted(SETTING_NAMES)}.")
        return GenerationSettings(**{**asdict(self), **{k: v for k, v in overrides.items() if v is not None}})


#: the declared settings, in order
SETTINGS: tuple[Field, ...] = fields(GenerationSettings)
SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in SETTINGS)
_TYPES = typing.get_type_hints(GenerationSettings)


def setting_type(setting: Field) -> type:
    """A setting's Python type (``int``, ``float`` or ``bool``), as declared."""
    return _TYPES[setting.name]


def setting_ranges(model_limit: int) -> dict[str, tuple[float, float]]:
    """The UI's ``(lowest, highest)`` for each setting with a slider; :data:`MODEL_LIMIT` becomes ``model_limit``.
    A bool setting has none."""
    return {
        f.name: (f.metadata["ui"][0], model_limit if f.metadata["ui"][1] is MODEL_LIMIT else f.metadata["ui"][1])
        for f in SETTINGS
        if f.metadata["ui"] is not None
    }


def resolve_quantize(choice: str, dtype: str) -> str:
    """``--quantize auto`` (``chat-e serve``'s and ``chat-e eval``'s default): int8 when the weights are fp32 (the CLI
    serves on the CPU), else none."""
    if choice != "auto":
        return choice
    return "int8" if dtype == "fp32" else "none"


#: why a reply ended, in OpenAI's words: the model said it was done, or it reached the reply's length limit
STOP, LENGTH = "stop", "length"


@dataclass(frozen=True)
class Reply:
    """What an engine makes of a :class:`~chat_e.data.limits.Request`: the reply's text and what is known of it."""

    text: str
    #: the name of the model that made it (the served one can change while replies are under way: the Train page's
    #: Promote)
    model: str
    #: why it ended: :data:`STOP` (the model was done) or :data:`LENGTH` (it reached the reply's length limit)
    finish_reason: str = STOP
    #: the reply's tokens, where the engine counts them (None: not known)
    tokens: int | None = None
    #: the prompt's tokens, where the engine counts them (None: not known)
    prompt_tokens: int | None = None


#: OpenAI's range of presence_penalty and frequency_penalty
PENALTY_RANGE = (-2.0, 2.0)


@dataclass(frozen=True)
class RequestSampling:
    """What an OpenAI request adds to a reply's settings (a :class:`~chat_e.data.limits.Request`'s ``sampling``):
    ``seed`` makes a sampled reply repeatable (the engine draws from its own generator seeded with
    it, whatever else runs); ``presence_penalty`` and ``frequency_penalty`` as OpenAI defines them, each token's logit
    lowered by ``presence_penalty`` once it is in the reply and by ``frequency_penalty`` per time it is there."""

    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def for_choice(self, index: int) -> RequestSampling:
        """The sampling of a request's ``index``-th choice (``n`` above 1): its own seed, ``seed + index``."""
        return replace(self, seed=None if self.seed is None else self.seed + index)
