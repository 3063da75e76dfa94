"""Resuming a full fine-tuning checkpoint on another number of ranks: stock transformers against hf-ext.

    python -m benchmarks.bench_resume --size 400m --stage 3 --out runs/bench/resume_400m_zero3.json

Builds a random-init BlenderBot of the given shape (chat_e.data.models), trains one optimizer step on 2 ranks under
``deepspeed --num_gpus 2`` (ZeRO-<stage>, AdamW, full fine-tuning) and writes ``checkpoint-1``. That checkpoint is then
resumed on 1 rank for one more step, in a fresh launch per path: the stock ``Seq2SeqTrainer`` and hf-ext's, same
arguments. Reported: whether each path resumed (and the error when not), the resumed launch's wall time, hf-ext's
conversion time (``ds_to_universal``, from the conversion's own record) and the disk the checkpoint and its
conversion take. Prints a Markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_resume"


def worker(opts) -> None:
    import transformers
    from transformers import BlenderbotForConditionalGeneration, default_data_collator

    import hf_ext
    from hf_ext.deepspeed.resolve import load_deepspeed_config

    stock = opts.path == "stock"
    arguments = dict(
        output_dir=opts.workdir,
        per_device_train_batch_size=1,
        max_steps=opts.max_steps,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        deepspeed=load_deepspeed_config(f"zero{opts.stage}"),
        disable_tqdm=True,
        seed=0,
    )
    args_class, trainer_class = (
        (transformers.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainer)
        if stock
        else (hf_ext.Seq2SeqTrainingArguments, hf_ext.Seq2SeqTrainer)
    )
    args = args_class(**arguments)
    model = BlenderbotForConditionalGeneration.from_pretrained(opts.model)
    data = harness.synthetic_dataset(8, model.config.vocab_size, 16)
    trainer = trainer_class(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=opts.resume)
    hf_ext.end_distributed()


def launch(path: str, ranks: int, model: Path, workdir: Path, stage: int, max_steps: int, resume: Path | None):
    """One fresh launch of this module's worker; ``(exit code, wall seconds, log path)``."""
    name = f"{path}_{ranks}rank" + ("_resume" if resume else "")
    cmd = harness.launcher_cmd("deepspeed", MODULE, nproc=ranks) + ["--worker", "--path", path, "--model", str(model)]
    cmd += ["--workdir", str(workdir / name), "--stage", str(stage), "--max_steps", str(max_steps)]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    log = workdir / f"{name}.log"
    start = time.perf_counter()
    code = harness.run(cmd, log)
    return code, time.perf_counter() - start, log


def last_error(log: Path) -> str:
    """The exception line a failed launch ended with."""
    lines = [line.split("]: ", 1)[-1] for line in log.read_text().splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return errors[-1] if errors else lines[-1]


def table(report: dict) -> str:
    mib = 2**20
    rows = [["path", "resumed on 1 rank", "resumed launch", "conversion", "on disk"]]
    for path in ("stock", "hf-ext"):
        run = report[path]
        outcome = "yes" if run["exit_code"] == 0 else f"no: `{run['error'][:150]}`"
        conversion = run.get("conversion_seconds")
        rows.append([
            path, outcome, f"{run['seconds']:.1f} s",
            f"{conversion:.1f} s" if conversion is not None else "",
            f"+{run['universal_bytes'] / mib:.0f} MiB beside the checkpoint's {report['checkpoint_bytes'] / mib:.0f} MiB"
            if "universal_bytes" in run else "",
        ])  # fmt: skip
    return harness.markdown_table(rows[0], rows[1:])


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="400m", help="model shape from chat_e.data.models.SIZES")
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: runs/bench_resume)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="hf-ext", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max_steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        return worker(opts)

    from hf_ext.saving.resume import UNIVERSAL_MARKER, read_zero_checkpoint
    from hf_ext.sizes import dir_bytes

    workdir = Path(opts.workdir or harness.ROOT / "runs" / "bench_resume")
    workdir.mkdir(parents=True, exist_ok=True)
    model = harness.ensure_model(opts.size, workdir / f"model-{opts.size}")
    code, seconds, log = launch("hf-ext", 2, model, workdir, opts.stage, 1, None)
    if code:
        raise SystemExit(f"the 2-rank training launch failed (see {log}):\n{log.read_text()[-3000:]}")
    checkpoint = workdir / "hf-ext_2rank" / "checkpoint-1"
    found = read_zero_checkpoint(checkpoint)
    report = {"command": harness.command(MODULE, argv), "size": opts.size, "zero_stage": opts.stage,
              "parameters": harness.parameter_count(model), "written_on": found.world_size, "resumed_on": 1,
              "checkpoint_bytes": dir_bytes(checkpoint / found.tag), "train_seconds": seconds,
              "host": harness.host_info()}  # fmt: skip
    for path in ("stock", "hf-ext"):
        code, seconds, log = launch(path, 1, model, workdir, opts.stage, 2, checkpoint)
        run = {"exit_code": code, "seconds": seconds, "log": str(log)}
        if code:
            run["error"] = last_error(log)
        universal = found.universal_path
        if path == "hf-ext" and (universal / UNIVERSAL_MARKER).is_file():
            run["conversion_seconds"] = json.loads((universal / UNIVERSAL_MARKER).read_text())["seconds"]
            run["universal_bytes"] = dir_bytes(universal)
        report[path] = run
    return harness.finish(report, table(report), opts.out)


if __name__ == "__main__":
    main()
