"""A two-parameter regression model (``y = a·x + b``) and its data: small enough that every expected value in the
peer tier can be worked out by hand, real enough to go through the whole Trainer (saving, loading, resuming)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel, TrainerCallback


class RegressionData(torch.utils.data.Dataset):
    """``length`` rows of ``y = 2x + 3 + noise``, the same rows for the same seed."""

    def __init__(self, length: int = 64, seed: int = 42):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=length).astype(np.float32)
        self.y = (2 * self.x + 3 + rng.normal(scale=0.1, size=length)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionStream(torch.utils.data.IterableDataset):
    """The same rows as :class:`RegressionData`, as a stream with no length."""

    def __init__(self, length: int = 64, seed: int = 42):
        self.rows = RegressionData(length, seed)

    def __iter__(self):
        return (self.rows[i] for i in range(len(self.rows)))


class RegressionConfig(PreTrainedConfig):
    model_type = "peer-regression"

    def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b = a, b


class RegressionModel(PreTrainedModel):
    config_class = RegressionConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionConfig):
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(float(config.a)))
        self.b = nn.Parameter(torch.tensor(float(config.b)))
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


def regression_model(a: float = 0.0, b: float = 0.0) -> RegressionModel:
    return RegressionModel(RegressionConfig(a=a, b=b))


def weights(model) -> tuple[float, float]:
    return model.a.item(), model.b.item()


class EventLog(TrainerCallback):
    """Every event a callback receives, in order, with the names of the keyword arguments it came with."""

    EVENTS = tuple(name for name in vars(TrainerCallback) if name.startswith("on_"))

    def __init__(self):
        self.events: list[tuple[str, tuple[str, ...]]] = []
        self.steps_at_train_begin: list[int] = []
        for name in self.EVENTS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def record(args, state, control, **kwargs):
            self.events.append((name, tuple(sorted(kwargs))))
            if name == "on_train_begin":
                self.steps_at_train_begin.append(state.global_step)

        return record

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


def trainer(peer, output_dir, model=None, train_dataset=None, eval_dataset=None, callbacks=None, trainer_class=None,
            model_init=None, **kwargs):  # fmt: skip
    """``peer.Trainer`` (or ``trainer_class``) on the regression model and data with these ``TrainingArguments``."""
    kwargs = {"report_to": [], "learning_rate": 0.1, "disable_tqdm": True, "dataloader_pin_memory": False, **kwargs}
    args = peer.TrainingArguments(str(output_dir), **kwargs)
    if model is None and model_init is None:
        model = regression_model()
    return (trainer_class or peer.Trainer)(
        model,
        args,
        model_init=model_init,
        train_dataset=RegressionData() if train_dataset is None else train_dataset,
        eval_dataset=RegressionData(32, seed=7) if eval_dataset is None else eval_dataset,
        callbacks=callbacks,
    )
