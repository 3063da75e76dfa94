"""Saving benchmark: stock ``Trainer.save_model`` vs hf-ext's streaming save, and LoRA checkpoints stock vs hf-ext.

    python -m benchmarks.bench_save --size 400m --max_shard_size 200MB --out runs/bench/save_400m.json
    python -m benchmarks.bench_save --size 1b --max_shard_size 200MB --no_lora --out runs/bench/save_1b.json
    python -m benchmarks.bench_save --engine fsdp --size 400m --max_shard_size 200MB --no_lora --out runs/bench/save_fsdp_400m.json

Builds a random-init BlenderBot of the given shape (chat_e.data.models; ``1b``: :data:`BENCH_SIZES`), then
runs 2-rank ZeRO-3 jobs under ``deepspeed --num_gpus 2`` (``--engine fsdp``: FSDP2 full shard under ``torchrun``,
stock's own default ``FULL_STATE_DICT`` for its save):

* full model, one fresh launch per save path (stock ``transformers.Trainer.save_model``, hf-ext's ``save_model``),
  each from the same checkpoint, measured as soon as the DeepSpeed engine exists. glibc runs with
  :data:`harness.FREED_MEMORY_TO_OS_ENV` and the heap is trimmed right before the call, so rank 0's resident set
  tracks its live bytes. Per path: rank-0 peak extra RSS (sampled every 2 ms above the RSS just before the call), the
  peak live bytes of the tensors rank 0 allocates during the call (torch.profiler's memory events, a cross-check that
  does not depend on pages), wall time and the files written;
* LoRA (r=8 on q/v, one optimizer step, then both checkpoints in the same launch): bytes and wall time of a checkpoint
  written by the stock ``Trainer._save_checkpoint`` and by hf-ext's.

``--glibc_defaults`` launches without those glibc settings (the heap is still trimmed before each call), to show what
freed memory that glibc keeps does to the RSS numbers. Prints Markdown tables and writes the numbers as JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import types
from pathlib import Path

from benchmarks import harness
from hf_ext.sizes import dir_bytes

MODULE = "benchmarks.bench_save"
PATHS = ("stock", "hf_ext")

#: shapes this bench builds beyond chat_e's own sizes (same keys as ``chat_e.data.models.SIZES``)
BENCH_SIZES = {
    # facebook/blenderbot-1B-distill's widths with 8 decoder layers instead of 12: 1.02B parameters, 3.8 GiB in fp32,
    # so that the two ZeRO-3 ranks and stock's full gather on rank 0 fit a 24 GiB host together
    "1b": dict(vocab=8008, d_model=2560, encoder_layers=2, decoder_layers=8, heads=32, ffn=10240),
}


def ensure_size(size: str, model_dir: Path) -> Path:
    """The random-init model of ``size`` in ``model_dir``: a chat_e size, or one of :data:`BENCH_SIZES` built by
    chat_e's BlenderBot builder with that shape registered."""
    if size not in BENCH_SIZES:
        return harness.ensure_model(size, model_dir)
    if not (model_dir / "config.json").exists():
        from chat_e.data import models

        models.SIZES.setdefault(size, BENCH_SIZES[size])
        models.build(str(model_dir), size, seed=0)
    return model_dir


# --- the worker side: one 2-rank launch ---------------------------------------------------------------------------


def worker(opts) -> None:
    import transformers
    from transformers import BlenderbotForConditionalGeneration, default_data_collator

    import hf_ext
    from hf_ext.deepspeed.resolve import load_deepspeed_config

    config = load_deepspeed_config("zero3")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    fsdp = opts.engine == "fsdp"
    engine = dict(fsdp="full_shard", fsdp_config={"state_dict_type": "FULL_STATE_DICT"}) if fsdp else {}
    args = hf_ext.Seq2SeqTrainingArguments(
        **engine,
        output_dir=opts.workdir,
        per_device_train_batch_size=1,
        max_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed=None if fsdp else config,
        disable_tqdm=True,
        save_max_shard_size=opts.max_shard_size,
    )
    model = BlenderbotForConditionalGeneration.from_pretrained(opts.model)
    if opts.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    data = [{"input_ids": [5] * 8, "attention_mask": [1] * 8, "labels": [6] * 4 + [2]}] * 2
    trainer = hf_ext.Seq2SeqTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    work = Path(opts.workdir)
    result = {}
    if opts.mode == "full":
        if opts.path == "hf_ext":
            save = trainer.save_model
        else:
            save = lambda out: transformers.Seq2SeqTrainer.save_model(trainer, str(out))  # noqa: E731
        measure_save_at_train_begin(trainer, args, save, work / opts.path, result)
    else:
        trainer.train()
        measure_lora(trainer, args, work, result)
    if args.process_index == 0:
        harness.write_json(opts.result, result)
    hf_ext.end_distributed()


def measure_save_at_train_begin(trainer, args, save, out: Path, result: dict) -> None:
    """Train ``trainer`` only as far as train begin (the engine exists, no optimizer step yet), measure
    :func:`measure_full` of ``save`` there, and stop."""
    trainer.add_callback(_MeasureAtTrainBegin(lambda: measure_full(trainer, args, save, out, result)))
    try:
        trainer.train()
    except _Measured:
        pass


class _Measured(Exception):
    pass


class _MeasureAtTrainBegin:
    def __init__(self, measure):
        self.measure = measure

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, *args, **kwargs):
        self.measure()
        raise _Measured


def peak_without_file_maps(events, out: Path) -> int:
    """:func:`harness.peak_live_bytes` of ``events`` less those of storages that map a ``.safetensors`` file under
    ``out`` whole: the allocations and frees whose size is exactly one such file's. safetensors' ``safe_open`` (the
    check after hf-ext's save reads each shard's header with it) maps the whole file as one storage; the profiler
    counts its size, but only the header's pages are ever read."""
    sizes = {p.stat().st_size for p in Path(out).rglob("*.safetensors")}
    return harness.peak_live_bytes([(t, nbytes) for t, nbytes in events if abs(nbytes) not in sizes])


def timed(trainer, args, fn, out, cross_check: bool = False) -> dict:
    """Wall time and rank-0 peak extra RSS of ``fn(out)`` on every rank; with ``cross_check``, also the peak live
    bytes of the tensors rank 0 allocates inside it; on a GPU, also rank 0's peak allocated device memory above the
    level before the call."""
    import torch

    from hf_ext.runtime import trim_heap

    trainer.accelerator.wait_for_everyone()
    gc.collect()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    device_base = torch.cuda.memory_allocated() if cuda else 0
    with harness.PeakTensorBytes(enabled=cross_check and args.process_index == 0) as tensors:
        trim_heap()  # what is free in the heap now goes back to the OS: the baseline holds only live bytes
        parts = rss_parts()
        with harness.PeakRSS() as rss:
            start = time.perf_counter()
            fn(out)
            if cuda:
                torch.cuda.synchronize()
            trainer.accelerator.wait_for_everyone()
            seconds = time.perf_counter() - start
    result = {"seconds": round(seconds, 3), "rank0_extra_rss_bytes": rss.extra, "rank0_base_rss_bytes": rss.base}
    if cuda:
        result["rank0_device_base_bytes"] = device_base
        result["rank0_device_extra_bytes"] = torch.cuda.max_memory_allocated() - device_base
    result["rank0_base_rss_parts"] = parts
    if tensors.peak is not None:
        result.update(rank0_peak_tensor_bytes=tensors.peak, profiler_memory_events=len(tensors.events))
        result["rank0_peak_tensor_bytes_without_file_maps"] = peak_without_file_maps(tensors.events, out)
    if args.process_index == 0:
        result["bytes"] = dir_bytes(out)
    return result


def rss_parts() -> dict:
    """This process's resident set by kind (bytes): anonymous memory, mapped files, shared memory (Linux)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                parts[key] = int(value.split()[0]) * 1024
    return parts


def optimizer_state_bytes(trainer) -> int:
    """Bytes of the optimizer state tensors this rank holds (DeepSpeed's wrapped optimizer, or the trainer's)."""
    import torch

    optimizer = getattr(trainer.model_wrapped, "optimizer", None) or trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
    states = getattr(optimizer, "state", {}) or {}
    return sum(
        t.numel() * t.element_size() for s in states.values() for t in s.values() if isinstance(t, torch.Tensor)
    )


def measure_full(trainer, args, save, out: Path, result: dict) -> None:
    """:func:`timed` of ``save(out)`` (the profiler's cross-check on), the optimizer state rank 0 holds then, and on
    rank 0 the files written and the model's parameter count, into ``result``."""
    import torch

    result.update(timed(trainer, args, save, out, cross_check=True))
    result["rank0_optimizer_state_bytes"] = optimizer_state_bytes(trainer)
    if args.process_index == 0:
        files = sorted(out.glob("*.safetensors"))
        result["files"] = len(files)
        result["largest_file_bytes"] = max(p.stat().st_size for p in files)
        result["index"] = (out / "model.safetensors.index.json").exists()
        result["parameters"] = sum(
            int(torch.tensor(getattr(p, "ds_shape", p.shape)).prod()) for p in trainer.model.parameters()
        )


def measure_lora(trainer, args, work, result):
    import transformers

    step = trainer.state.global_step

    def checkpoint(save, out):
        trainer.args.output_dir = str(out)
        save(trainer.model_wrapped, None)
        return out / f"checkpoint-{step}"

    hf_ext_checkpoint = lambda out: checkpoint(trainer._save_checkpoint, out)  # noqa: E731
    result["hf_ext_lora_checkpoint"] = timed(trainer, args, hf_ext_checkpoint, work / "lora_hf_ext")
    # the stock checkpoint, with the stock save_model inside it
    trainer.save_model = types.MethodType(transformers.Seq2SeqTrainer.save_model, trainer)
    stock = lambda out: checkpoint(lambda m, t: transformers.Trainer._save_checkpoint(trainer, m, t), out)  # noqa: E731
    result["stock_lora_checkpoint"] = timed(trainer, args, stock, work / "lora_stock")
    result["rank0_optimizer_state_bytes"] = optimizer_state_bytes(trainer)


# --- the launching side -------------------------------------------------------------------------------------------


def launch(
    model: Path,
    mode: str,
    workdir: Path,
    max_shard_size: str,
    path: str = "",
    env: dict | None = None,
    engine: str = "zero3",
    module: str = MODULE,
    extra: list[str] | None = None,
) -> dict:
    """One fresh 2-rank launch (ZeRO-3 or FSDP2) of ``module``'s worker side (this module's by default; another
    bench's worker takes the same arguments, and ``extra`` ones), with ``env`` added to its environment; rank 0's
    measurements."""
    name = f"{engine}_{mode}_{path}" if path else f"{engine}_{mode}"
    result = workdir / f"{name}.json"
    result.unlink(missing_ok=True)
    launcher = "torchrun" if engine == "fsdp" else "deepspeed"
    cmd = harness.launcher_cmd(launcher, module) + ["--worker", "--mode", mode, "--model", str(model)]
    cmd += ["--engine", engine]
    cmd += ["--workdir", str(workdir / name), "--result", str(result), "--max_shard_size", max_shard_size]
    cmd += ["--path", path] * bool(path) + list(extra or [])
    log = workdir / f"{name}.log"
    if harness.run(cmd, log, env):
        raise SystemExit(f"{name} launch failed (see {log}):\n{log.read_text()[-3000:]}")
    return json.loads(result.read_text())


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


#: the two saves' names in the table
LABELS = {"stock": "stock `Trainer.save_model`", "hf_ext": "hf-ext streaming save"}


def table(report: dict, labels: dict | None = None) -> str:
    full, shard = report["full"], report["largest_shard_bytes"]
    rows = []
    for path, label in (labels or LABELS).items():
        r = full[path]
        files = "1 file" if r["files"] == 1 else f"{r['files']} shards + index"
        tensors = _mib(r["rank0_peak_tensor_bytes"])
        if r["rank0_peak_tensor_bytes_without_file_maps"] != r["rank0_peak_tensor_bytes"]:
            tensors += f" ({_mib(r['rank0_peak_tensor_bytes_without_file_maps'])} without file maps)"
        rows.append(
            [
                label,
                _mib(r["rank0_extra_rss_bytes"]),
                tensors,
                f"{r['rank0_extra_rss_bytes'] / shard:.2f} / {r['rank0_peak_tensor_bytes'] / shard:.2f}",
                f"{r['seconds']:.1f} s",
                f"{files}, {_mib(r['bytes'])}",
            ]
        )
    header = [
        "save",
        "rank-0 peak extra RSS",
        "cross-check: peak live tensor bytes",
        f"× largest shard ({shard / 2**20:.1f} MiB): RSS / cross-check",
        "wall time",
        "output",
    ]
    text = harness.markdown_table(header, rows)
    lora = report.get("lora")
    if lora:
        rows = [
            [label, f"{lora[key]['seconds']:.1f} s", f"{lora[key]['bytes'] / 2**20:.1f} MiB"]
            for key, label in (("stock_lora_checkpoint", "stock"), ("hf_ext_lora_checkpoint", "hf-ext"))
        ]
        text += "\n\n" + harness.markdown_table(["LoRA checkpoint", "wall time", "bytes"], rows)
    return text


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="400m", help="model shape: a chat_e.data.models.SIZES name, or 1b")
    parser.add_argument("--max_shard_size", default="200MB")
    parser.add_argument("--no_lora", action="store_true", help="skip the LoRA checkpoint launch")
    parser.add_argument("--engine", default="zero3", choices=["zero3", "fsdp"], help="what shards the model")
    parser.add_argument(
        "--glibc_defaults",
        action="store_true",
        help="launch without harness.FREED_MEMORY_TO_OS_ENV: glibc keeps freed memory, RSS no longer tracks live bytes",
    )
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: runs/bench/save)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="hf_ext", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        return worker(opts)

    workdir = Path(opts.workdir or harness.ROOT / "runs" / "bench" / "save")
    workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_size(opts.size, workdir / f"model-{opts.size}")
    report = {"command": harness.command(MODULE, argv), "size": opts.size, "world_size": 2, "engine": opts.engine}
    env = {} if opts.glibc_defaults else harness.FREED_MEMORY_TO_OS_ENV
    report.update(max_shard_size=opts.max_shard_size, malloc_env=env)
    report["host"] = harness.host_info()
    report["full"] = {
        path: launch(model, "full", workdir, opts.max_shard_size, path, env, opts.engine) for path in PATHS
    }
    report["parameters"] = report["full"]["hf_ext"]["parameters"]
    report["largest_shard_bytes"] = report["full"]["hf_ext"]["largest_file_bytes"]
    if not opts.no_lora:
        report["lora"] = launch(model, "lora", workdir, opts.max_shard_size, env=env, engine=opts.engine)
    report["load_average_after"] = harness.load_average()
    return harness.finish(report, table(report), opts.out)


if __name__ == "__main__":
    main()
