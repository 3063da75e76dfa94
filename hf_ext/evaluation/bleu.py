"""Generation eval during training: corpus sacreBLEU and chrF, sample generations, length-bucketed batches.

:class:`BleuEvalCallback` works with the stock :class:`transformers.Seq2SeqTrainer` (add it to ``callbacks=``, keep
``predict_with_generate=False``) and is switched on by default in :class:`hf_ext.Seq2SeqTrainer`. After each
evaluation's loss pass it:

* sorts the eval set into length buckets (padding cut), shards the batches across ranks, generates, gathers the
  generations back in the original order;
* computes corpus BLEU and chrF with ``sacrebleu`` and the mean generation length, and adds ``eval_bleu``,
  ``eval_chrf``, ``eval_gen_len`` (and ``eval_gen_runtime``) to the evaluation's metrics, its ``log_history`` entry
  and so to ``metric_for_best_model``;
* prints the first ``log_samples`` (context, generation, reference) rows, writes every row to
  ``output_dir/generations/step-{N}.jsonl`` and logs a table to TensorBoard / trackio when they are in ``report_to``.

Decoder-only models work the same way. An eval row then holds the prompt followed by the reference (``labels`` is
``-100`` over the prompt, as for training with the loss on the reply only): generation starts from the tokens before
the first label, left-padded, and only the new tokens are decoded. ``generation_max_length`` /
``generation_min_length`` count new tokens for such a model, as they count decoder tokens for an encoder-decoder.

Under ZeRO-3 with more than one rank, ``generate`` runs with ``synced_gpus=True`` and every rank runs the same number
of ``generate`` calls (a rank out of batches repeats one and discards it), so ranks never wait on each other forever.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import sacrebleu
import torch
from transformers import TrainerCallback
from transformers.distributed.fsdp import is_fsdp_managed_module
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from ..gather import root_unsharded
from ..ranks import shared_outcome
from ..runtime import local_world_size
from .gathered import GenerationPath, choose_generation_path, gathered_copy, is_partitioned_model
from .settings import GenerationEvalArguments

logger = logging.getLogger(__name__)

#: the generate() kwarg each generation setting of the arguments sets
GENERATION_KWARGS = {
    "generation_num_beams": "num_beams",
    "generation_max_length": "max_length",
    "generation_min_length": "min_length",
    "generation_no_repeat_ngram_size": "no_repeat_ngram_size",
}


@dataclass(kw_only=True)
class BleuEvalConfig(GenerationEvalArguments):
    """The settings of the BLEU evaluation, under the names :class:`hf_ext.Seq2SeqTrainingArguments` gives them
    (``generation_num_beams``, ``generation_max_length``, ``generation_min_length``,
    ``generation_no_repeat_ngram_size``, ``generation_batch_size``, ``generation_bucket_by_length``, ``log_samples``,
    ``save_generations``). Unset generation settings fall back to the training arguments of the run, then to the
    model's ``generation_config``.
    """

    generation_num_beams: int | None = field(default=None, metadata={"help": "Beams for eval generation."})
    generation_max_length: int | None = field(default=None, metadata={"help": "Max length of eval generations."})

    def __post_init__(self):
        self._validate_generation_eval()

    @classmethod
    def from_args(cls, args) -> BleuEvalConfig:
        """The settings ``args`` carry under the same names (absent ones keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.init and hasattr(args, f.name)})


# ---------------------------------------------------------------------------------------------- pure helpers
def compute_bleu_chrf(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """Corpus sacreBLEU and chrF of ``hypotheses`` against one reference each (``None``/empty hypotheses count as "")."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references.")
    if not hypotheses:
        return {"bleu": 0.0, "chrf": 0.0}
    hyps = [h if isinstance(h, str) else "" for h in hypotheses]
    refs = [[r if isinstance(r, str) else "" for r in references]]
    return {"bleu": sacrebleu.corpus_bleu(hyps, refs).score, "chrf": sacrebleu.corpus_chrf(hyps, refs).score}


def length_batches(lengths: list[int], batch_size: int, bucket: bool = True) -> list[list[int]]:
    """Indices grouped into batches: longest inputs first when ``bucket`` (stable for ties), else in order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if bucket else list(range(len(lengths)))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def shard_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """The batches of ``rank``: round-robin, so every rank gets long and short buckets alike."""
    return batches[rank::world_size]


def format_samples_table(rows: list[dict], width: int = 60) -> str:
    """A plain-text table of (context, generation, reference); the context keeps its end (the newest turns)."""

    def cell(text: str, keep_end: bool = False) -> str:
        text = " ".join(str(text).split())
        if len(text) <= width:
            return text.ljust(width)
        return ("…" + text[-(width - 1) :]) if keep_end else (text[: width - 1] + "…")

    header = f"| # | {'context'.ljust(width)} | {'generation'.ljust(width)} | {'reference'.ljust(width)} |"
    rule = "|---|" + "|".join("-" * (width + 2) for _ in range(3)) + "|"
    lines = [header, rule]
    for row in rows:
        lines.append(
            f"| {row['index']} | {cell(row['context'], keep_end=True)} | {cell(row['generation'])} "
            f"| {cell(row['reference'])} |"
        )
    return "\n".join(lines)


def samples_markdown(rows: list[dict]) -> str:
    """The sample rows as a Markdown table (TensorBoard's text plugin renders it)."""

    def esc(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| # | context | generation | reference |", "|---|---|---|---|"]
    lines += [f"| {r['index']} | {esc(r['context'])} | {esc(r['generation'])} | {esc(r['reference'])} |" for r in rows]
    return "\n".join(lines)


def metric_prefix(metrics: dict) -> str:
    """``eval`` (or ``eval_<name>`` for a dict of eval sets) from the metrics of one evaluation."""
    for key in metrics:
        if key.endswith("_runtime") and not key.endswith("_gen_runtime"):
            return key[: -len("_runtime")]
    for key in metrics:
        if key.endswith("_loss"):
            return key[: -len("_loss")]
    return "eval"


# ---------------------------------------------------------------------------------------------- distributed
def _dist_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _zero3_or_fsdp(model) -> bool:
    if is_deepspeed_zero3_enabled():
        return True
    return bool(is_fsdp_managed_module(model))


def _gather(local: list) -> list:
    rank, world = _dist_world()
    if world == 1:
        return local
    parts = [None] * world
    torch.distributed.all_gather_object(parts, local)
    return [item for part in parts for item in part]


# ---------------------------------------------------------------------------------------------- generation
def _rows(dataset) -> list[dict]:
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "input_ids" in columns:  # datasets.Dataset: column access is much faster
        data = {c: dataset[c] for c in ("input_ids", "attention_mask", "labels") if c in columns}
        return [{c: data[c][i] for c in data} for i in range(len(dataset))]
    return [dict(dataset[i]) for i in range(len(dataset))]


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _decode_labels(tokenizer, labels) -> str:
    return tokenizer.decode([t for t in _as_list(labels) if t >= 0], skip_special_tokens=True).strip()


def _is_encoder_decoder(model) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def prompt_ids(row: dict, is_encoder_decoder: bool) -> list[int]:
    """What generation starts from: an encoder-decoder's whole input; for a decoder-only model whose row holds the
    prompt and the reference (``labels`` aligned with ``input_ids``, ``-100`` over the prompt), the tokens before the
    first label."""
    ids = _as_list(row["input_ids"])
    if is_encoder_decoder or row.get("labels") is None:
        return ids
    labels = _as_list(row["labels"])
    if len(labels) != len(ids):
        return ids
    first = next((i for i, label in enumerate(labels) if label >= 0), len(ids))
    return ids[:first]


def generate_in_order(
    model,
    tokenizer,
    rows: list[dict],
    gen_kwargs: dict,
    batch_size: int,
    bucket: bool = True,
    device: torch.device | str | None = None,
    synced_gpus: bool | None = None,
) -> tuple[list[str], list[int], dict]:
    """Generate for every row (sharded over the ranks) and return texts and lengths for *all* rows, in row order.

    ``rows`` hold ``input_ids`` (and ``labels``, which for a decoder-only model mark where its prompt ends). ``synced_gpus`` defaults to ZeRO-3/FSDP with
    more than one rank; then every rank makes the same number of ``generate`` calls. Also returns per-rank stats.
    """
    rank, world = _dist_world()
    if synced_gpus is None:
        synced_gpus = world > 1 and _zero3_or_fsdp(model)
    device = device if device is not None else next(model.parameters()).device
    is_encoder_decoder = _is_encoder_decoder(model)
    prompts = [prompt_ids(r, is_encoder_decoder) for r in rows]
    lengths = [len(p) for p in prompts]
    batches = length_batches(lengths, batch_size, bucket)
    mine = shard_batches(batches, rank, world)
    steps = -(-len(batches) // world) if synced_gpus else len(mine)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    local, widths = [], []
    # the gather below waits for every rank: one that failed on its own part (a decode, a batch) says so first,
    # so that every rank stops instead of waiting for it
    with shared_outcome("generating for the evaluation"):
        for step in range(steps):
            indices = mine[step] if step < len(mine) else None
            batch = indices if indices is not None else batches[0][:1]
            features = [
                {
                    "input_ids": prompts[i],
                    "attention_mask": _as_list(rows[i]["attention_mask"])[: len(prompts[i])]
                    if rows[i].get("attention_mask") is not None
                    else [1] * len(prompts[i]),
                }
                for i in batch
            ]
            # a decoder-only model continues its prompt: padding goes on the left so every prompt ends at the same place
            side = "right" if is_encoder_decoder else "left"
            inputs = tokenizer.pad(features, return_tensors="pt", padding_side=side).to(device)
            with torch.no_grad():
                out = model.generate(**inputs, **gen_kwargs, synced_gpus=synced_gpus)
            if indices is None:
                continue  # a step only taken so that the other ranks' gathers have a partner
            if not is_encoder_decoder:
                out = out[:, inputs["input_ids"].shape[1] :]
            widths.append(int(out.shape[1]))
            texts = tokenizer.batch_decode(out, skip_special_tokens=True)
            for i, seq, text in zip(indices, out, texts):
                local.append((i, text.strip(), int((seq != pad_id).sum())))

    gathered = sorted(_gather(local))
    if [i for i, _, _ in gathered] != list(range(len(rows))):
        raise RuntimeError("Generation results are missing or duplicated after the gather across ranks.")
    stats = {"rank": rank, "world_size": world, "calls": steps, "batches": len(mine), "widths": widths}
    return [t for _, t, _ in gathered], [n for _, _, n in gathered], stats


# ---------------------------------------------------------------------------------------------- the callback
@dataclass
class EvaluationCall:
    """One ``evaluate()`` call in progress: its generate() kwargs and, under ZeRO-3, the gathered copy held for it
    (``None`` when the model is not partitioned or the copy does not fit), its path and the seconds it took."""

    gen_kwargs: dict
    model: torch.nn.Module | None = None
    path: GenerationPath | None = None
    gather_seconds: float = 0.0


@dataclass(frozen=True)
class GenerationReport:
    """What one evaluation generated: its metrics, every row (index, context (main process), generation, reference)
    and this rank's generation stats (``calls``, ``batches``, ``widths``, ``path``, ``gather_seconds``)."""

    metrics: dict
    rows: list[dict]
    stats: dict


class BleuEvalCallback(TrainerCallback):
    """Generation eval at every evaluation: ``eval_bleu``, ``eval_chrf``, ``eval_gen_len`` and sample generations.

    Args:
        config (:class:`BleuEvalConfig`, *optional*): generation and logging settings.
        tokenizer (*optional*): used to pad and decode; defaults to the trainer's ``processing_class``.
        **overrides: fields of :class:`BleuEvalConfig` (``BleuEvalCallback(generation_num_beams=4, log_samples=3)``).

    Example with the stock trainer::

        trainer = transformers.Seq2SeqTrainer(model, args, eval_dataset=..., processing_class=tokenizer,
                                              callbacks=[BleuEvalCallback()])
        trainer.evaluate()["eval_bleu"]
    """

    def __init__(self, config: BleuEvalConfig | None = None, tokenizer=None, **overrides):
        self.config = replace(config or BleuEvalConfig(), **overrides)
        self.tokenizer = tokenizer
        #: what the last evaluation generated and how (:class:`GenerationReport`), ``None`` before the first
        self.last_evaluation: GenerationReport | None = None
        self._tb_writer = None
        self._logged_path = None
        self._call: EvaluationCall | None = None  # the evaluate() call in progress (evaluation_call)

    # --------------------------------------------------------------------------------- settings
    def generation_kwargs(self, args, model=None, call: dict | None = None) -> dict:
        """generate() kwargs: the ``evaluate(**gen_kwargs)`` call's (``call``) > the config > the training arguments >
        the model's generation_config."""
        kwargs = {}
        for name, kwarg in GENERATION_KWARGS.items():
            value = getattr(self.config, name)
            if value is None:
                value = getattr(args, name, None)
            if value is not None:
                kwargs[kwarg] = value
        call = {k: v for k, v in (call or {}).items() if v is not None}
        if "max_new_tokens" in call:
            kwargs.pop("max_length", None)
        if "min_new_tokens" in call:
            kwargs.pop("min_length", None)
        kwargs.update(call)
        if model is not None and not _is_encoder_decoder(model):  # lengths of the reply, not of prompt + reply
            for total, new in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
                if total in kwargs:
                    kwargs.setdefault(new, kwargs.pop(total))
        kwargs.pop("synced_gpus", None)  # decided per run, see generate_in_order
        return kwargs

    @contextmanager
    def generation_model(self, args, model):
        """``(module, path, gather_seconds)`` to generate with: under ZeRO-3 a gathered copy when :meth:`zero3_path`
        says so (the one the current :meth:`evaluation_call` holds, else one built here), otherwise ``model``."""
        if self._call is not None and self._call.model is not None:
            yield self._call.model, self._call.path, self._call.gather_seconds
            return
        start = time.time()
        path = self.zero3_path(args, model)
        if path is not None and path.gathered:
            with gathered_copy(model) as plain:
                yield plain, path, time.time() - start
        else:
            with root_unsharded(model):  # FSDP2: generate() enters the model below its root unit
                yield model, path, 0.0

    @contextmanager
    def evaluation_call(self, args, model, gen_kwargs: dict | None = None):
        """One ``evaluate(**gen_kwargs)`` call, as :class:`hf_ext.Seq2SeqTrainer` makes it: the call's generate()
        kwargs reach the generation, and under ZeRO-3 one gathered copy is held for the whole call, so that the loss
        pass runs on it too (``EvaluationCall.model``) and the weights are gathered once per evaluation, not once per
        loss batch and again per decoding step. Yields the :class:`EvaluationCall`."""
        with self.generation_model(args, model) as (plain, path, seconds):
            self._call = EvaluationCall(dict(gen_kwargs or {}), plain if plain is not model else None, path, seconds)
            try:
                yield self._call
            finally:
                self._call = None

    def zero3_path(self, args, model) -> GenerationPath | None:
        """For a ZeRO-3 model: gather the weights once or per decoding step (the same choice on every rank, logged
        when it changes); ``None`` otherwise."""
        if not is_partitioned_model(model):
            return None
        plan = getattr(args, "memory_plan", None)
        setting = self.config.generation_gather_weights
        path = choose_generation_path(model, setting, plan, args.device, local_world_size())
        if path.gathered and not all(_gather([path.gathered])):  # every rank must take part in the gathers
            path = GenerationPath(False, "another rank has no room for the gathered copy")
        if (path.gathered, path.reason) != self._logged_path:
            self._logged_path = (path.gathered, path.reason)
            if _dist_world()[0] == 0:  # a fallback the user did not ask for costs time: a warning
                level = logging.WARNING if not path.gathered and setting == "auto" else logging.INFO
                logger.log(level, f"Generation eval under ZeRO-3: {path.name} ({path.reason})")
        return path

    def batch_size(self, args) -> int:
        size = self.config.generation_batch_size or getattr(args, "generation_batch_size", None)
        return int(size or args.per_device_eval_batch_size)

    # --------------------------------------------------------------------------------- the event
    def on_evaluate(self, args, state, control, metrics=None, model=None, eval_dataloader=None, **kwargs):
        tokenizer = self.tokenizer or kwargs.get("processing_class")
        if metrics is None or model is None or eval_dataloader is None:
            return
        if tokenizer is None or not hasattr(tokenizer, "pad"):
            logger.warning(
                "BLEU eval skipped: pass a tokenizer (processing_class=... or BleuEvalCallback(tokenizer=...))."
            )
            return
        dataset = getattr(eval_dataloader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__"):
            logger.warning("BLEU eval skipped: the eval dataloader has no sized dataset.")
            return
        prefix = metric_prefix(metrics)
        new = self.evaluate_generations(args, state, model, tokenizer, dataset, prefix)
        metrics.update(new)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and any(k.startswith(prefix) for k in last):
            last.update(new)

    def evaluate_generations(self, args, state, model, tokenizer, dataset, prefix: str = "eval") -> dict:
        """Generate for ``dataset``, score, log the samples; returns the ``{prefix}_*`` metrics (the whole record:
        :attr:`last_evaluation`)."""
        rows = _rows(dataset)
        if not rows:
            return {}
        was_training = model.training
        model.eval()
        start = time.time()
        call = self._call.gen_kwargs if self._call is not None else None
        generate = partial(
            generate_in_order,
            tokenizer=tokenizer,
            rows=rows,
            gen_kwargs=self.generation_kwargs(args, model, call),
            batch_size=self.batch_size(args),
            bucket=self.config.generation_bucket_by_length,
            device=args.device,
        )
        try:
            with self.generation_model(args, model) as (plain, path, seconds):
                hyps, gen_lens, stats = generate(plain, synced_gpus=False if plain is not model else None)
        finally:
            model.train(was_training)
        runtime = time.time() - start
        stats["path"] = path.name if path is not None else "plain"
        if path is not None and path.gathered:
            stats["gather_seconds"] = round(seconds, 3)
        refs = [_decode_labels(tokenizer, r["labels"]) if "labels" in r else "" for r in rows]
        scores = compute_bleu_chrf(hyps, refs)
        new = {
            f"{prefix}_bleu": scores["bleu"],
            f"{prefix}_chrf": scores["chrf"],
            f"{prefix}_gen_len": sum(gen_lens) / len(gen_lens),
            f"{prefix}_gen_runtime": round(runtime, 4),
        }
        shown = [
            {"index": i, "context": None, "generation": h, "reference": r} for i, (h, r) in enumerate(zip(hyps, refs))
        ]
        self.last_evaluation = GenerationReport(new, shown, stats)
        if state.is_world_process_zero:
            encoder_decoder = _is_encoder_decoder(model)
            for row, r in zip(shown, rows):
                row["context"] = tokenizer.decode(prompt_ids(r, encoder_decoder), skip_special_tokens=True).strip()
            self.log_samples(args, state, prefix, new)
        return new

    # --------------------------------------------------------------------------------- outputs (rank 0)
    def log_samples(self, args, state, prefix: str, new_metrics: dict) -> None:
        step = state.global_step
        rows = self.last_evaluation.rows
        shown = rows[: self.config.log_samples]
        if shown:
            scores = f"bleu {new_metrics[f'{prefix}_bleu']:.2f}, chrf {new_metrics[f'{prefix}_chrf']:.2f}"
            logger.info(f"{prefix} generations at step {step} ({scores}):\n{format_samples_table(shown)}")
        if self.config.save_generations and args.output_dir:
            suffix = "" if prefix == "eval" else f"-{prefix}"
            path = Path(args.output_dir) / "generations" / f"step-{step}{suffix}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")
        report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
        if "tensorboard" in report_to or "all" in report_to:
            self._log_tensorboard(args, step, prefix, new_metrics, shown)
        if "trackio" in report_to or "all" in report_to:
            self._log_trackio(step, prefix, new_metrics, shown)

    def _log_tensorboard(self, args, step, prefix, new_metrics, shown) -> None:
        try:
            if self._tb_writer is None:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (optional: only with report_to tensorboard)

                self._tb_writer = SummaryWriter(log_dir=args.logging_dir)
        except ImportError:
            logger.warning("report_to has tensorboard but it is not installed: `pip install tensorboard`.")
            return
        for key, value in new_metrics.items():
            self._tb_writer.add_scalar(key.replace(f"{prefix}_", f"{prefix}/", 1), value, step)
        if shown:
            self._tb_writer.add_text(f"{prefix}/generations", samples_markdown(shown), step)
        self._tb_writer.flush()

    def _log_trackio(self, step, prefix, new_metrics, shown) -> None:
        try:
            import trackio  # noqa: PLC0415 (optional: only with report_to trackio)
        except ImportError:
            logger.warning("report_to has trackio but it is not installed: `pip install trackio`.")
            return
        logs = {key.replace(f"{prefix}_", f"{prefix}/", 1): value for key, value in new_metrics.items()}
        if shown:
            columns = ["index", "context", "generation", "reference"]
            logs[f"{prefix}/generations"] = trackio.Table(
                columns=columns, data=[[r[c] for c in columns] for r in shown]
            )
        try:
            trackio.log(logs, step=step)
        except Exception as err:  # a tracker problem must not stop training
            logger.warning(f"Could not log generations to trackio: {err}")

    def on_train_end(self, args, state, control, **kwargs):
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
