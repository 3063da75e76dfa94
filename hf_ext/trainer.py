"""``Trainer`` / ``Seq2SeqTrainer`` that accept ``deepspeed=`` and compose hf-ext's features.

Each feature lives in its own package and is a callback or a function a stock ``Trainer`` user can add alone; these
classes switch them all on. Public hooks are overridden (``train``, ``evaluate``, ``predict``, ``save_model``), plus
three private methods with no public counterpart, ``_save_checkpoint``, ``_load_optimizer_and_scheduler`` and
``_get_train_sampler``: ``tests/unit/test_private_surface.py`` fails when transformers changes any of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging

from transformers import Seq2SeqTrainer as _Seq2SeqTrainer
from transformers import Trainer as _Trainer

from . import fsdp, packing, peft, preemption, runtime
from . import loss as losses
from .batching import args_layout
from .deepspeed import callbacks as deepspeed_callbacks
from .deepspeed import versions as deepspeed_versions
from .evaluation.bleu import BleuEvalCallback, BleuEvalConfig
from .evaluation.zero_eval import plain_eval_without_engine
from .memory.measure import MemoryPlanCallback, loaded_whole_under_zero3
from .saving import checkpoints, resume
from .saving import zero as saving
from .schedule import ResumedScheduleCallback
from .training_args import Seq2SeqTrainingArguments, TrainingArguments

logger = logging.getLogger(__name__)


def as_hf_ext_args(args, args_class, deepspeed=None):
    """``args`` as hf-ext's arguments class (stock ones are converted), with ``deepspeed`` set when given.

    Arguments that already resolved this very ``deepspeed`` are kept as they are: the config is resolved (and the
    memory planned) once, whichever of ``TrainingArguments(deepspeed=...)`` and ``Trainer(deepspeed=...)`` says it.
    """
    if args is None:
        return args_class(deepspeed=deepspeed) if deepspeed is not None else None
    resolution = getattr(args, "deepspeed_resolution", None)
    already = deepspeed is None or (resolution is not None and resolution.given == deepspeed)
    if isinstance(args, args_class) and already:
        return args
    init_fields = {f.name for f in dataclasses.fields(args_class) if f.init}
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in init_fields}
    if deepspeed is not None:
        if values.get("deepspeed") not in (None, deepspeed):
            logger.warning("`deepspeed=` passed to the trainer overrides `TrainingArguments.deepspeed`.")
        values["deepspeed"] = deepspeed
    return args_class(**values)


def _bind_trainer_args(init, args: tuple, kwargs: dict, args_class, deepspeed):
    """``(args, kwargs)`` for the next ``__init__`` with its ``args`` parameter converted by :func:`as_hf_ext_args`.

    ``args`` is found by name in that ``__init__``'s signature, so any Trainer subclass works whatever comes before it
    (``Trainer(model, args)``, TRL's ``DPOTrainer(model, ref_model, args)``).
    """
    names = [
        p.name
        for p in inspect.signature(init).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    position = names.index("args") if "args" in names else None
    if position is not None and position < len(args):
        args = (*args[:position], as_hf_ext_args(args[position], args_class, deepspeed), *args[position + 1 :])
    else:
        kwargs["args"] = as_hf_ext_args(kwargs.get("args"), args_class, deepspeed)
    return args, kwargs


class TrainerMixin:
    """hf-ext's features for any :class:`transformers.Trainer` subclass: put it first among the bases.

    ``class MyTrainer(hf_ext.TrainerMixin, SomeTrainer): args_class = MyConfig`` gives ``SomeTrainer`` the
    ``deepspeed=`` keyword (a preset name, a path, a dict), every ``"auto"`` resolved, the memory plan, streaming
    16-bit saves under ZeRO-3, adapter-only checkpoints that resume on any world size, FSDP2 on CPU ranks, the
    one-line failures, padding-free batches when its arguments have ``padding_free`` on (:mod:`hf_ext.packing`) and,
    when they have ``generation_eval`` on, the BLEU eval. ``args_class`` is the
    arguments class stock arguments are converted to: ``SomeConfig`` with :class:`hf_ext.TrainingArgumentsMixin`
    (:mod:`hf_ext.trl` has the classes for TRL's trainers).
    """

    args_class = TrainingArguments

    #: whether ``padding_free`` makes this trainer flatten its batches (TRL's trainers do it themselves)
    collates_padding_free = True

    #: methods the mixin replaces without calling the next class's: atomic checkpoints, streaming saves
    REPLACED_METHODS = ("_save_checkpoint", "save_model")

    def __init_subclass__(cls, **kwargs):
        # a Trainer subclass that adds work to a replaced method would silently lose it: refuse the class instead
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        front, behind = mro[: mro.index(TrainerMixin)], mro[mro.index(TrainerMixin) + 1 :]
        for name in cls.REPLACED_METHODS:
            if any(name in vars(k) for k in front):
                continue  # the subclass merges both itself
            base = next((k for k in behind if name in vars(k) and not k.__module__.startswith("transformers.")), None)
            if base is not None:
                raise TypeError(
                    f"{cls.__name__}: {base.__name__}.{name} would be skipped, as hf-ext's TrainerMixin replaces "
                    f"{name}. Define {name} on {cls.__name__}: do what {base.__name__}'s adds, then call super()."
                )

    def __init__(self, *args, deepspeed=None, **kwargs):
        args, kwargs = _bind_trainer_args(super().__init__, args, kwargs, self.args_class, deepspeed)
        super().__init__(*args, **kwargs)
        deepspeed_callbacks.add_resolved_config_callback(self)  # the resolved config file at train start
        self.add_callback(MemoryPlanCallback())  # plan at train start, measured peak at train end
        self.add_callback(ResumedScheduleCallback())  # a resumed run starts at its own schedule's learning rate
        self.add_callback(preemption.PreemptionCallback())  # a signal: one agreed checkpoint, then exit 75
        preemption.combine_jit_checkpoint(self)  # enable_jit_checkpoint=True: SIGTERM stays stock's JIT checkpoint's
        if runtime.LAUNCHER == "ray":
            from .ray import RayCheckpointCallback  # noqa: PLC0415 (the ray extra: only under Ray)

            self.add_callback(RayCheckpointCallback())  # every rank's share of each checkpoint, as one Ray checkpoint
        self._normalize_own_mean_loss()
        self._ulysses_gradient_factor = self._ulysses_correction()  # read in every step: decided here, not there
        self.bleu_eval_callback = self._attach_generation_eval()
        packing.enable_on_trainer(self)  # padding_free: DataCollatorWithFlattening
        loaded_whole = loaded_whole_under_zero3(self.model, self.args.world_size, runtime.local_world_size())
        if loaded_whole and self.args.should_log:
            logger.warning(loaded_whole)

    def _normalize_own_mean_loss(self) -> None:
        """A model that averages its own micro-batch (BlenderBot) gets its loss over the whole global batch instead
        (:mod:`hf_ext.loss`), unless a loss of the user's own (``compute_loss_func``, label smoothing) is in place."""
        if not losses.loss_ignores_num_items(self.model):
            return
        name = type(self.model).__name__
        if (
            losses.takes_global_token_mean(self.model)
            and self.compute_loss_func is None
            and self.label_smoother is None
        ):
            self.compute_loss_func = losses.global_token_mean_loss
            self._decoder_inputs_from_labels = losses.decoder_inputs_from_labels(self.model)  # before any wrapping
            logger.info(
                f"{name} averages its own micro-batch: its loss is taken from its logits over the labelled "
                "tokens of the whole global batch, as for other models."
            )
        elif self.model_accepts_loss_kwargs:
            logger.info(f"{name} averages its own loss: not rescaling it by the global token count.")
        self.model_accepts_loss_kwargs = False  # nothing to pass to a forward that ignores it

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.compute_loss_func is losses.global_token_mean_loss:  # the forward gets no labels: decoder inputs
            inputs = losses.with_decoder_inputs(self._decoder_inputs_from_labels, inputs)
        result = super().compute_loss(model, inputs, *args, **kwargs)
        factor = self._ulysses_gradient_factor
        if factor == 1 or not model.training:
            return result
        if isinstance(result, tuple):  # (loss, outputs)
            return (losses.with_gradient_divided(result[0], factor), *result[1:])
        return losses.with_gradient_divided(result, factor)

    def _ulysses_correction(self) -> int:
        """:func:`hf_ext.loss.ulysses_gradient_factor`, said once when it is not 1."""
        factor = losses.ulysses_gradient_factor(self.args, deepspeed_versions.installed())
        if factor > 1 and self.args.should_log:
            logger.info(losses.ulysses_rule(factor))
        return factor

    def _attach_generation_eval(self):
        """The BLEU eval's callback: the one given in ``callbacks``, else a new one when ``generation_eval`` is on."""
        callback = next((cb for cb in self.callback_handler.callbacks if isinstance(cb, BleuEvalCallback)), None)
        if callback is None and getattr(self.args, "generation_eval", False):
            callback = BleuEvalCallback(BleuEvalConfig.from_args(self.args))
            self.add_callback(callback)
        return callback

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # the hidden-size "auto" keys, before anything (TRL's reference model) starts an engine from the config
        deepspeed_callbacks.fill_model_keys_on_trainer(self)
        fsdp.enable_on_trainer(self)  # real FSDP2 on CPU ranks too, and hybrid sharding's device mesh

    def _get_train_sampler(self, train_dataset=None):
        # Private override: stock builds its BatchRebalanceSampler with a fixed seed and a padded cost model, and no
        # public hook sees the sampler before the dataloader holds it (hf_ext.packing.run_sampler)
        return packing.run_sampler(self.args, super()._get_train_sampler(train_dataset))

    def _track_num_input_tokens(self, inputs):
        # Private override: stock sums every rank's tokens, but the ranks of a tensor-parallel group train on the same
        # micro-batch; sequence- and context-parallel ranks each count their own part of it
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        tp = getattr(self, "_tensor_parallel", 1)  # read once per train() call
        if tp > 1:
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // tp

    # --- training, saving and resume (hf_ext.saving, hf_ext.peft) ---
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        runtime.prepare_run(self.args)
        self._tensor_parallel = args_layout(self.args).tp
        if self.deepspeed is not None and self.optimizer is None:  # an engine from evaluate(): inference only
            self._drop_inference_engine()
        deepspeed_callbacks.reopen_step_keys(self)  # an evaluate() before train() may have filled them for inference
        fsdp.reshard(self.model)  # FSDP2 after an evaluation: the optimizer must see the sharded parameters
        if runtime.LAUNCHER == "ray" and checkpoints.resume_word(resume_from_checkpoint):
            from .ray import restore_latest_checkpoint  # noqa: PLC0415 (the ray extra: only under Ray)

            restore_latest_checkpoint(self.args.output_dir)  # a restarted worker group goes on from Ray's checkpoint
        self.resume_plan = plan = resume.plan_resume(self, resume_from_checkpoint)  # decided once, on every rank
        resume.apply_resume_plan(self, plan)
        try:
            with resume.peft_state_under_deepspeed(self, plan):
                output = super().train(plan.resume_from_checkpoint, *args, **kwargs)
        except BaseException:  # on_train_end never ran: the preemption signals get their handlers back
            preemption.release_signals(self)
            raise
        preemption.exit_if_preempted(self)
        return output

    # --- evaluation (hf_ext.evaluation) ---
    def _generation_kwargs(self, kwargs: dict) -> dict:
        """The ``generate()`` keywords of an ``evaluate()``/``predict()`` call (a plain Trainer's take none)."""
        return {}

    def evaluate(self, *args, **kwargs):
        runtime.prepare_run(self.args)
        callback = getattr(self, "bleu_eval_callback", None)
        # the BLEU eval sees this call's generate() kwargs; under ZeRO-3 it holds one gathered copy for the whole call
        gen_kwargs = self._generation_kwargs(kwargs)
        call = callback.evaluation_call(self.args, self.model, gen_kwargs) if callback else contextlib.nullcontext()
        with plain_eval_without_engine(self), call as self._evaluation_call:
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self._evaluation_call = None

    def predict(self, *args, **kwargs):
        runtime.prepare_run(self.args)
        self._generation_kwargs(kwargs)
        with plain_eval_without_engine(self):
            return super().predict(*args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        fsdp.shard_for_evaluation(self)  # FSDP2 before any training: stock would refuse to prepare the model alone
        return super().evaluation_loop(*args, **kwargs)

    def _drop_inference_engine(self) -> None:
        """Forget the engine a stock ``evaluate()`` started before ``train()`` under ZeRO-3.

        That engine has no optimizer. Stock ``train()`` releases it (``accelerator.free_memory()``) but keeps it as
        ``model_wrapped``, so it never starts a training engine and fails at the first backward ("'NoneType' object
        has no attribute 'backward'"). The (still partitioned) model goes back to the trainer, which then starts a
        training engine as usual.
        """
        logger.info("Evaluated before training under DeepSpeed: training starts its own engine.")
        self.model_wrapped = self.model
        self.deepspeed = None

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Private override: the stock loader only knows per-rank optimizer files; an hf-ext PEFT checkpoint holds
        # the trainable state by parameter name, loadable on any world size (hf_ext.peft). The resume plan says which.
        plan = getattr(self, "resume_plan", None)
        if plan is not None and plan.kind == "peft" and checkpoint is not None:
            return peft.load_trainable_state(self, checkpoint)
        return super()._load_optimizer_and_scheduler(checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not saving.handles(self):
            return super().save_model(output_dir, _internal_call)
        saving.save_trainer_model(self, output_dir or self.args.output_dir, checkpoint=_internal_call)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial):
        # Private override: stock writes into checkpoint-N and, on rank 0, rotates older checkpoints away before the
        # other ranks have finished writing theirs; both happen before any public hook runs, so a crash there can
        # lose the newest complete checkpoint. hf-ext writes tmp-checkpoint-N and renames it once every rank is done
        # (hf_ext.saving.checkpoints keeps the stock steps, in order).
        checkpoints.save_checkpoint_atomically(self, model, trial)


class Trainer(TrainerMixin, _Trainer):
    """:class:`transformers.Trainer` plus ``deepspeed=`` (a path, a dict or a preset name)."""


class Seq2SeqTrainer(TrainerMixin, _Seq2SeqTrainer):
    """:class:`transformers.Seq2SeqTrainer` plus ``deepspeed=``, ``generation_min_length`` and the BLEU eval.

    Every evaluation also generates and logs ``eval_bleu``, ``eval_chrf``, ``eval_gen_len`` and sample generations
    (:class:`~hf_ext.evaluation.bleu.BleuEvalCallback`, switched off by ``generation_eval=False``). Eval-only runs work on
    ZeRO-1/2 too.
    """

    args_class = Seq2SeqTrainingArguments

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (
            self.bleu_eval_callback is not None
            and self.args.predict_with_generate
            and self.compute_metrics is not None
        ):
            logger.warning(
                "predict_with_generate=True with compute_metrics makes every evaluation generate twice (once in the "
                "stock loop, once for BLEU). Set predict_with_generate=False, or generation_eval=False to keep only "
                "your compute_metrics."
            )

    def _generation_kwargs(self, kwargs: dict) -> dict:
        # Seq2SeqTrainer's evaluate()/predict() pass their extra keywords to generate(): min_length joins them here
        min_length = getattr(self.args, "generation_min_length", None)
        if min_length is not None and "min_length" not in kwargs and "min_new_tokens" not in kwargs:
            kwargs["min_length"] = min_length
        return kwargs

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        # under ZeRO-3 the loss pass runs on the BLEU eval's gathered copy when it holds one: one gather per evaluation
        call = getattr(self, "_evaluation_call", None)
        plain = call.model if call is not None else None
        return super().prediction_step(
            plain if plain is not None else model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs
        )
