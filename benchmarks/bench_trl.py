"""TRL's trainers with hf-ext (``hf_ext.trl``) against stock TRL: training throughput of SFT and DPO, and rank 0's
memory during a ZeRO-3 ``save_model``.

    python -m benchmarks.bench_trl throughput --trainers sft dpo --size chat-6m --steps 20 --repeats 6 \
        --out runs/bench/trl_throughput.json
    python -m benchmarks.bench_trl save --size chat-200m --max_shard_size 200MB --out runs/bench/trl_save.json
    python -m benchmarks.bench_trl pool runs/bench/trl_throughput.json runs/bench/trl_throughput_run2.json

``throughput`` and ``save`` first resolve the DeepSpeed preset once with hf-ext
(``hf_ext.resolve_deepspeed_config`` against the trainer's hf-ext config, the model and 2 ranks) and write the
resolved JSON: both paths get that same dict, no "auto" left, so stock TRL and hf-ext start the same engine. Both train fp32 (``bf16=False``: TRL's configs default
it on) and otherwise keep TRL's defaults (activation checkpointing on, as TRL's configs set it).

``throughput``: for each trainer (``sft``: ``trl.SFTTrainer`` vs ``hf_ext.trl.SFTTrainer``; ``dpo``:
``trl.DPOTrainer`` vs ``hf_ext.trl.DPOTrainer``) one 2-rank ZeRO-2 launch (``deepspeed --num_gpus 2``) in which the
two paths take turns, segment by segment (stock, hf-ext, hf-ext, stock, …; ``2 × --repeats`` segments of ``--steps``
steps), each segment building and dropping its own config, model, trainer and engines: benchmarks.worker's
interleaved segments (the engine of ``bench_train --interleave``) with TRL's trainers in them. SFT trains on
pre-tokenized rows of ``--seq_len`` random token ids; DPO on prompt / chosen / rejected texts decoded from random ids
(``--seq_len`` ids per row, half prompt), its reference model loaded by TRL from the same checkpoint. Throughput is
bench_train's: steady-state samples/s (a DPO sample is one preference pair) from the end of step ``--warmup`` on;
the summary is bench_train's (medians, ratio hf-ext ÷ stock, per-pair ratios, geometric mean with its 95% interval).

``pool``: the throughput summary over the segments of several throughput runs' JSON (pairs stay within their run).

``save``: bench_save's full-model measurement with TRL's SFT trainer under ZeRO-3 on 2 ranks
(``stage3_gather_16bit_weights_on_model_save`` on): one fresh launch per path, each measured as soon as the engine
exists, glibc returning freed memory to the OS, rank 0's peak extra RSS and the profiler's peak live tensor bytes
during ``save_model``: stock ``trl.SFTTrainer.save_model`` (gathers the whole 16-bit state dict on rank 0) against
``hf_ext.trl.SFTTrainer.save_model`` (streams bounded groups into shards). Both saved models are then loaded with
``from_pretrained`` and compared tensor by tensor, with each other and with the checkpoint they started from.

The models are random-init decoder-only chat models (``chat_e.data.models.build_chat_model``, SmolLM2's layout) of the
shapes in :data:`CHAT_BENCH_SIZES`, or chat_e's own ``chat-tiny``. JSON goes to ``--out``; tables are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import bench_save, bench_train, harness

MODULE = "benchmarks.bench_trl"
TRAINERS = {"sft": "SFT", "dpo": "DPO"}  # --trainers name -> TRL's class prefix

#: decoder-only shapes this bench builds beyond chat_e's ``chat-tiny`` (keys of ``chat_e.data.models.CHAT_SIZES``)
CHAT_BENCH_SIZES = {
    # on one core per rank a step long enough to time, and short enough for many steps per segment
    "chat-6m": dict(vocab=4096, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, max_positions=512),
    # about 0.8 GB of fp32 weights: stock's whole-model gather stands far out of the noise of a shard-sized one
    "chat-200m": dict(vocab=8192, hidden=1024, layers=12, heads=16, kv_heads=4, intermediate=4096, max_positions=512),
}


def ensure_chat_model(size: str, model_dir: str | Path | None = None) -> Path:
    """The random-init chat model ``size`` (``chat-<chat_e CHAT_SIZES name>`` or one of :data:`CHAT_BENCH_SIZES`) in
    ``model_dir`` (default ``runs/models/<size>``), built there (seed 0) if it holds no model."""
    from chat_e.data import models

    model = Path(model_dir) if model_dir else harness.ROOT / "runs" / "models" / size
    if (model / "config.json").exists():
        return model
    name = size.removeprefix("chat-")
    if size in CHAT_BENCH_SIZES:
        models.CHAT_SIZES.setdefault(name, CHAT_BENCH_SIZES[size])
    if name not in models.CHAT_SIZES:
        raise SystemExit(f"unknown chat model size {size!r}: chat-tiny or one of {', '.join(CHAT_BENCH_SIZES)}")
    return models.build_chat_model(model, name, seed=0)


# --- data ---------------------------------------------------------------------------------------------------------


def sft_rows(n: int, vocab: int, seq_len: int) -> list[dict]:
    """Pre-tokenized language-modelling rows (TRL's SFT takes ``input_ids`` as processed): ``seq_len`` random ids."""
    return [{"input_ids": row["input_ids"]} for row in harness.synthetic_dataset(n, vocab, seq_len)]


def preference_rows(n: int, tokenizer, seq_len: int) -> list[dict]:
    """Preference rows (prompt, chosen, rejected as text) decoded from harness's random ids: a row's first
    ``seq_len // 2`` input ids make the prompt, its other input ids the chosen completion, the same span of its
    labels the rejected one. Seeded, so every segment and both paths get the same rows."""
    half = seq_len // 2
    return [
        {
            "prompt": tokenizer.decode(row["input_ids"][:half]),
            "chosen": tokenizer.decode(row["input_ids"][half:]),
            "rejected": tokenizer.decode(row["labels"][half:]),
        }
        for row in harness.synthetic_dataset(n, len(tokenizer), seq_len)
    ]


# --- both paths' configs and trainers -----------------------------------------------------------------------------


def trl_arguments(trainer: str, path: str, output_dir: str, opts, deepspeed, prepare: bool = True, **extra):
    """The config and trainer class of ``trainer`` (sft, dpo) on ``path`` (stock: TRL's own; hf-ext: hf_ext.trl's),
    with the settings both paths share, and the seconds building the config took (with ``prepare``, hf-ext's
    process set-up included, as in a run). fp32 on both (TRL's configs default bf16 on); everything else TRL's
    defaults."""
    import torch
    import trl

    import hf_ext

    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=opts.batch,
        max_steps=opts.steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        bf16=False,
        deepspeed=deepspeed,
        # SFT rows are exactly seq_len ids; a DPO row re-tokenized from text can come out a little longer
        max_length=opts.seq_len if trainer == "sft" else 2 * opts.seq_len,
    )
    name = TRAINERS[trainer]
    started = time.perf_counter()
    if path == "stock":
        args = getattr(trl, f"{name}Config")(use_cpu=not torch.cuda.is_available(), **common)
        trainer_class = getattr(trl, f"{name}Trainer")
    else:
        from hf_ext import trl as hf_trl

        args = getattr(hf_trl, f"{name}Config")(**common, **extra)
        if prepare:  # as the recipe does: threads and malloc set before the model loads
            hf_ext.prepare_run(args)
        trainer_class = getattr(hf_trl, f"{name}Trainer")
    return args, trainer_class, time.perf_counter() - started


def resolved_config(trainer: str, preset: str, model_dir: Path, opts, out: Path, **overrides) -> Path:
    """``preset`` resolved once by hf-ext for ``trainer``'s hf-ext config, the model in ``model_dir`` and 2 ranks,
    with ``overrides`` (dotted keys) set, written as JSON to ``out``: the one config both paths get."""
    import hf_ext

    args, _, _ = trl_arguments(trainer, "hf-ext", str(out.with_suffix("")), opts, None, prepare=False)
    config = hf_ext.resolve_deepspeed_config(preset, args, model=model_dir, world_size=2)
    for dotted, value in overrides.items():
        *parents, key = dotted.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[key] = value
    return harness.write_json(out, config)


def trl_trainer(opts, args, trainer_class, *callbacks):
    """``trainer_class`` on the seeded model in ``opts.model`` with its tokenizer and ``opts.trainer``'s rows."""
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(opts.model)  # after the config: under ZeRO-3 built partitioned
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    n = max(64, opts.batch * args.world_size * opts.steps)  # full micro-batches on every rank at every step
    if opts.trainer == "sft":
        rows = sft_rows(n, len(tokenizer), opts.seq_len)
    else:
        rows = preference_rows(n, tokenizer, opts.seq_len)
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


# --- the worker side: one 2-rank launch ---------------------------------------------------------------------------


def segment_trainer(opts, path: str, output_dir: str, *callbacks):
    """A segment of the interleaved throughput launch (benchmarks.worker.segment's ``build``)."""
    from hf_ext.runtime import start_deepspeed_comm

    deepspeed = json.loads(Path(opts.config).read_text())
    # hf-ext's release of freed memory off: stock runs in the same processes (as bench_train --interleave)
    args, trainer_class, args_seconds = trl_arguments(
        opts.trainer, path, output_dir, opts, deepspeed, release_freed_memory=False
    )
    start_deepspeed_comm()  # on CPU stock's config starts torch.distributed but not DeepSpeed's comm
    return args, trl_trainer(opts, args, trainer_class, *callbacks), args_seconds


def save_worker(opts) -> None:
    """One path's ZeRO-3 save, measured as bench_save measures it (rank 0 writes the result)."""
    import hf_ext
    from hf_ext.runtime import start_deepspeed_comm

    deepspeed = json.loads(Path(opts.config).read_text())
    extra = {"save_max_shard_size": opts.max_shard_size}  # hf-ext's shard size; stock writes one file
    path = "stock" if opts.path == "stock" else "hf-ext"
    args, trainer_class, _ = trl_arguments("sft", path, opts.workdir, opts, deepspeed, **extra)
    start_deepspeed_comm()
    trainer = trl_trainer(opts, args, trainer_class)
    result: dict = {}
    bench_save.measure_save_at_train_begin(trainer, args, trainer.save_model, Path(opts.workdir) / opts.path, result)
    if args.process_index == 0:
        harness.write_json(opts.result, result)
    hf_ext.end_distributed()


def worker(argv: list[str]) -> None:
    from benchmarks import worker as training_worker

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", choices=["segments", "full"], required=True)
    parser.add_argument("--trainer", choices=list(TRAINERS), default="sft")
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True, help="the resolved DeepSpeed config both paths get (JSON)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--out", help="segments: results go to OUT.rank<N>.json")
    # bench_save.launch's arguments
    parser.add_argument("--engine", default="zero3")
    parser.add_argument("--workdir")
    parser.add_argument("--result")
    parser.add_argument("--max_shard_size", default="200MB")
    parser.add_argument("--path", default="hf_ext", choices=bench_save.PATHS)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args(argv)
    if opts.mode == "full":
        return save_worker(opts)
    import hf_ext

    opts.trace = False  # benchmarks.worker's --trace: not here
    training_worker.interleaved_runs(opts, build=segment_trainer)
    hf_ext.end_distributed()


# --- the launching side -------------------------------------------------------------------------------------------


def throughput(opts, argv) -> dict:
    model = ensure_chat_model(opts.size)
    parameters = harness.parameter_count(model)
    out = Path(opts.out)
    work = out.with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    host_before = harness.host_info()
    rows, launches = [], {}
    for trainer in opts.trainers:
        config = resolved_config(trainer, opts.config, model, opts, Path(f"{work}_{trainer}_{opts.config}.json"))
        args = ["--worker", "--mode", "segments", "--trainer", trainer, "--model", str(model), "--config", str(config)]
        args += ["--batch", str(opts.batch), "--seq_len", str(opts.seq_len), "--steps", str(opts.steps)]
        args += ["--segments", str(2 * opts.repeats)]
        started = time.time()
        result = harness.launch_worker(args, Path(f"{work}_{trainer}"), target=MODULE)
        if isinstance(result, str):
            raise SystemExit(f"{trainer}: {result}")
        segments = next(r for r in result if r["rank"] == 0)["segments"]
        launches[trainer] = {
            "wall_s": round(time.time() - started, 1),
            "same_engine_config": same_engine_config(segments),
            "engines_alive": [s["engines_alive"] for s in segments],
            "rss_after_bytes": [s["rss_after_bytes"] for s in segments],
        }
        for seg in segments:
            row = bench_train.measured_row(
                opts.size, opts.config, seg["path"], seg["segment"] // 2, seg, parameters, opts.warmup
            )
            row.update(trainer=trainer, segment=seg["segment"], hf_ext_hook_us_per_step=1e6 * seg["hf_ext_hook_seconds_per_step"])  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = bench_train.summarize(rows, keys=("trainer", "size", "config"))
    report = {
        "command": harness.command(MODULE, argv),
        "batch": opts.batch, "seq_len": opts.seq_len, "steps": opts.steps, "warmup": opts.warmup,
        "repeats": opts.repeats, "world_size": 2, "precision": "fp32",
        "host_before": host_before, "load_average_after": harness.load_average(),
        "launches": launches, "rows": rows, "summary": summary,
    }  # fmt: skip
    return harness.finish(report, throughput_table(summary, launches), opts.out)


def pool(reports: list[dict]) -> tuple[list[dict], dict]:
    """The throughput summary over the rows of several throughput ``reports`` (each run's pairs stay its own: a
    run's stock and hf-ext rows are in segment order and equal in number), and whether each trainer's engine config
    was the same in all of them' segments."""
    rows = [row for report in reports for row in report["rows"]]
    launches = {
        trainer: {"same_engine_config": all(r["launches"][trainer]["same_engine_config"] for r in reports)}
        for trainer in dict.fromkeys(row["trainer"] for row in rows)
    }
    return bench_train.summarize(rows, keys=("trainer", "size", "config")), launches


def same_engine_config(segments: list[dict]) -> bool:
    """Whether every segment's engine, stock's and hf-ext's, ran with the same config."""
    return all(s["engine_config"] == segments[0]["engine_config"] for s in segments)


def throughput_table(summary: list[dict], launches: dict) -> str:
    header = [
        "trainer", "model", "pairs of", "stock samples/s", "hf-ext samples/s", "hf-ext ÷ stock (medians)",
        "per-pair ratios", "geometric mean (95% interval)", "CPU s / step, user + system (stock / hf-ext)",
        "engine start s (stock / hf-ext)",
        "hf-ext callbacks µs / step (share of a step)", "same engine config",
    ]  # fmt: skip
    rows = []
    for s in summary:
        st, hf = s["stock"], s["hf-ext"]
        rows.append([
            f"{TRAINERS[s['trainer']]}Trainer", f"{s['size']} ({s['parameters'] / 1e6:.1f}M)", s["pairs_of"],
            f"{st['samples_per_s']:.2f}", f"{hf['samples_per_s']:.2f}", f"**{s['ratio']:.3f}**",
            ", ".join(f"{r:.3f}" for r in s["per_launch_ratios"]),
            f"{s['geomean_ratio']:.3f} ({s['ratio_ci95'][0]:.3f}–{s['ratio_ci95'][1]:.3f})",
            f"{st['user_s_per_step'] + st['system_s_per_step']:.3f} / {hf['user_s_per_step'] + hf['system_s_per_step']:.3f}",
            f"{st['engine_start_s']:.1f} / {hf['engine_start_s']:.1f}",
            f"{s['hf_ext_hook_us_per_step']:.0f} ({s['hf_ext_hook_share_of_step']:.1e})",
            "yes" if launches[s["trainer"]]["same_engine_config"] else "**no**",
        ])  # fmt: skip
    return harness.markdown_table(header, rows)


def compare_saved(a: Path, b: Path, source: Path) -> dict:
    """Load the models saved in ``a`` and ``b`` and the checkpoint in ``source`` with ``from_pretrained``; whether
    the two saved ones are equal tensor by tensor, and each equal to ``source``."""
    import torch
    from transformers import AutoModelForCausalLM

    def state(model_dir):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()

    first, second, original = state(a), state(b), state(source)

    def equal(x, y):
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    return {"tensors": len(first), "saved_equal": equal(first, second),
            "equal_to_source": [equal(first, original), equal(second, original)]}  # fmt: skip


SAVE_LABELS = {"stock": "stock `trl.SFTTrainer.save_model`", "hf_ext": "`hf_ext.trl.SFTTrainer.save_model`"}


def save(opts, argv) -> dict:
    workdir = Path(opts.workdir or harness.ROOT / "runs" / "bench" / "trl_save")
    workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_chat_model(opts.size, workdir / f"model-{opts.size}")
    config = resolved_config(
        "sft", "zero3", model, opts, workdir / "zero3_resolved.json",
        **{"zero_optimization.stage3_gather_16bit_weights_on_model_save": True},
    )  # fmt: skip
    report = {"command": harness.command(MODULE, argv), "size": opts.size, "world_size": 2, "engine": "zero3"}
    env = harness.FREED_MEMORY_TO_OS_ENV
    report.update(max_shard_size=opts.max_shard_size, malloc_env=env, host=harness.host_info())
    extra = ["--config", str(config), "--batch", str(opts.batch), "--seq_len", str(opts.seq_len)]
    report["full"] = {
        path: bench_save.launch(model, "full", workdir, opts.max_shard_size, path, env, module=MODULE, extra=extra)
        for path in bench_save.PATHS
    }
    report["parameters"] = report["full"]["hf_ext"]["parameters"]
    report["largest_shard_bytes"] = report["full"]["hf_ext"]["largest_file_bytes"]
    saved = [workdir / f"zero3_full_{path}" / path for path in bench_save.PATHS]
    report["loaded"] = compare_saved(*saved, model)
    report["load_average_after"] = harness.load_average()
    loaded = report["loaded"]
    text = bench_save.table(report, SAVE_LABELS) + (
        f"\n\nloaded with from_pretrained: {loaded['tensors']} tensors, saved models equal: {loaded['saved_equal']}, "
        f"equal to the checkpoint they started from: {loaded['equal_to_source']}"
    )
    return harness.finish(report, text, opts.out)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    run = sub.add_parser("throughput", help="samples/s of stock TRL and hf_ext.trl, interleaved in one launch")
    run.add_argument("--trainers", nargs="+", choices=list(TRAINERS), default=list(TRAINERS))
    run.add_argument("--size", default="chat-6m", help="chat-tiny or a CHAT_BENCH_SIZES name")
    run.add_argument("--config", default="zero2", help="the DeepSpeed preset hf-ext resolves for both paths")
    run.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    run.add_argument("--seq_len", type=int, default=64, help="token ids per row")
    run.add_argument("--steps", type=int, default=20, help="optimizer steps per segment")
    run.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    run.add_argument("--repeats", type=int, default=6, help="stock / hf-ext pairs (2 × segments) per trainer")
    run.add_argument("--out", default="runs/bench/trl_throughput.json")
    pooled = sub.add_parser("pool", help="the throughput summary over several throughput runs' JSON")
    pooled.add_argument("reports", nargs="+", help="JSON files of throughput runs")
    pooled.add_argument("--out", default=None, help="JSON file for the pooled summary")
    saving = sub.add_parser("save", help="rank 0's memory in a ZeRO-3 save_model, stock TRL vs hf_ext.trl")
    saving.add_argument("--size", default="chat-200m", help="chat-tiny or a CHAT_BENCH_SIZES name")
    saving.add_argument("--max_shard_size", default="200MB")
    saving.add_argument("--batch", type=int, default=1)
    saving.add_argument("--seq_len", type=int, default=16)
    saving.add_argument("--workdir", default=None, help="scratch directory (default: runs/bench/trl_save)")
    saving.add_argument("--out", default=None, help="JSON file for the results")
    opts = parser.parse_args(argv)
    if opts.bench == "throughput":
        return throughput(opts, argv)
    if opts.bench == "pool":
        reports = [json.loads(Path(path).read_text()) for path in opts.reports]
        summary, launches = pool(reports)
        report = {"command": harness.command(MODULE, argv), "runs": [r["command"] for r in reports]}
        report.update(dates=[r["host_before"]["date"] for r in reports], summary=summary)
        return harness.finish(report, throughput_table(summary, launches), opts.out)
    opts.steps = 1  # a save is measured before the first step
    return save(opts, argv)


if __name__ == "__main__":
    main()
