"""The DeepSpeed config's trainer side: the hidden-size based ``"auto"`` keys filled once the trainer has its model,
the step-count keys reopened after an evaluation consumed them, and the resolved config written at train start."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import TrainerCallback

from ..atomic import write_text_atomically
from .fill import STEP_KEYS, node_of, walk
from .resolve import RESOLVED_CONFIG_NAME, fill_model_keys

logger = logging.getLogger(__name__)


def write_resolved_config(config: dict, output_dir: str | Path, reference: dict | None = None) -> Path:
    """Write ``config`` as ``output_dir/deepspeed_config.resolved.json``.

    Non-finite numbers (accelerate sets ``steps_per_print`` to infinity to mute DeepSpeed) are not JSON: they are
    replaced by the value in ``reference`` (the resolved config before accelerate touched it), or left out.
    """
    clean = json.loads(json.dumps(config, default=str), parse_constant=lambda _: None)
    for key, value in list(clean.items()):
        if value is None and key in config:
            if reference is not None and key in reference:
                clean[key] = reference[key]
            else:
                clean.pop(key)
    path = Path(output_dir) / RESOLVED_CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(clean, indent=2) + "\n")
    return path


class ResolvedDeepSpeedConfigCallback(TrainerCallback):
    """Writes the DeepSpeed config the engine was started with to ``output_dir/deepspeed_config.resolved.json``.

    Runs at train start on the main process only, after transformers has filled the last values that need the
    model and the number of steps. Usable with the stock :class:`transformers.Trainer` too.
    """

    def on_train_begin(self, args, state, control, **kwargs):
        hf_config = getattr(args, "hf_deepspeed_config", None)
        if hf_config is None or not state.is_world_process_zero:
            return
        reference = getattr(getattr(args, "deepspeed_resolution", None), "config", None)
        path = write_resolved_config(hf_config.config, args.output_dir, reference)
        left = [key for key, value in walk(hf_config.config) if value == "auto"]
        if left:
            logger.error(f'DeepSpeed started with "auto" left in: {", ".join(left)}')
        logger.info(f"Resolved DeepSpeed config written to {path}")


def _plugin(trainer):
    return getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)


def fill_model_keys_on_trainer(trainer) -> None:
    """Fill the hidden-size based ``"auto"`` keys (integers) of an hf-ext resolved config in the config the engines
    will start from, once the trainer has its model and its accelerator.

    Called where the accelerator is created, before a Trainer subclass can start an engine of its own from that config
    (TRL's ``DPOTrainer`` prepares its reference model in ``__init__``), and again after ``__init__`` for a model from
    ``model_init``. Only ``"auto"`` values are filled, so a second call changes nothing.
    """
    resolution = getattr(trainer.args, "deepspeed_resolution", None)
    plugin = _plugin(trainer)
    if resolution is None or plugin is None or getattr(trainer, "model", None) is None:
        return
    changes = fill_model_keys(plugin.hf_ds_config.config, trainer.model)
    resolution.changes += changes
    for change in changes:
        logger.info(f"DeepSpeed {change.key} = {change.value} ({change.source})")


def add_resolved_config_callback(trainer) -> None:
    """Finish an hf-ext resolved config on a built trainer: the model keys (a ``model_init`` model), and the resolved
    file written at train start."""
    if getattr(trainer.args, "deepspeed_resolution", None) is None or _plugin(trainer) is None:
        return
    fill_model_keys_on_trainer(trainer)
    if not any(isinstance(cb, ResolvedDeepSpeedConfigCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(ResolvedDeepSpeedConfigCallback())


def reopen_step_keys(trainer) -> None:
    """Put back the ``"auto"`` of the step-count keys before training, if an evaluation consumed them.

    Stock ``evaluate()`` before ``train()`` under ZeRO-3 starts an inference engine and, on the way, fills the
    deferred scheduler keys with 0 training steps in the shared config; ``train()`` then refuses its own step count
    ("ds scheduler.params.total_num_steps=0 vs hf num_training_steps=8"). Only keys hf-ext deferred are reopened:
    explicit values are never touched.
    """
    resolution = getattr(trainer.args, "deepspeed_resolution", None)
    plugin = _plugin(trainer)
    if resolution is None or plugin is None:
        return
    config = plugin.hf_ds_config.config
    for change in resolution.changes:
        if change.action == "deferred" and change.key in STEP_KEYS:
            node, leaf = node_of(config, change.key)
            if node is not None and node.get(leaf) != "auto":
                node[leaf] = "auto"
