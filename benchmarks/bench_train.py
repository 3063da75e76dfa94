"""Training throughput of hf_ext.Trainer vs the stock transformers.Trainer: the extension must cost nothing.

    python -m benchmarks.bench_train --sizes tiny 400m --configs zero2 zero3 --steps 60 12 --repeats 4 --interleave \
        --out runs/bench/train_interleaved_r4.json
    python -m benchmarks.bench_train --sizes tiny 400m --configs zero2 zero3 --steps 60 10 --repeats 3 --threads 1 \
        --out runs/bench/train.json
    # the decoder-only dialogue model of `make demo`: SmolLM2-135M-Instruct with LoRA, ZeRO-2
    python -m benchmarks.bench_train --sizes smollm2 --configs zero2 --lora --batch 4 --seq_len 128 --steps 8 --threads 1 \
        --repeats 2 --out runs/bench/train_smollm2_lora.json

For each model shape and ZeRO preset, stock and hf-ext train the same model on the same synthetic data with the same
DeepSpeed config on 2 ranks (benchmarks.worker under ``deepspeed --num_gpus 2``), alternating stock / hf-ext launch
by launch (``--repeats`` pairs) so that background load hits both alike. Both paths get the preset's JSON file:
stock hands it to transformers, which fills its "auto"s; hf-ext resolves it. ``--threads N`` gives both paths N
torch threads per rank, which measures the extension's own cost; without it each path places threads its own way
(hf-ext: ``hf_ext.runtime.place_cpu_threads``, stock: accelerate's default), as benchmarks.bench_launchers measures.
``--release_freed_memory`` is passed to hf-ext's TrainingArguments (by default off here: it is on only when the
memory planner plans the run).

``--interleave`` runs each size and config as ONE launch in which the two paths take turns (stock, hf-ext, hf-ext,
stock, …; ``2 × --repeats`` segments of ``--steps`` steps), each segment building and dropping its own
TrainingArguments, model, Trainer and engine. Both paths then share one thread count: ``--threads``, by default the
one hf-ext places.

Reported per run, from rank 0: steady-state samples/s (global batch × steps ÷ time from the end of step
``--warmup`` to the end of the last step: engine start-up and the first steps excluded), the time to build
TrainingArguments, the engine start-up time, and the system CPU seconds and page faults per step. The summary is the
median over repeats, the ratio hf-ext ÷ stock, the geometric mean of the per-pair ratios with its 95% interval, and
the time of hf-ext's config resolution alone (in process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks import harness
from hf_ext.deepspeed.resolve import load_deepspeed_config

MODULE = "benchmarks.bench_train"


def steady_samples_per_second(rank0: dict, warmup: int) -> float:
    ends = rank0["step_end_times"]
    if len(ends) <= warmup:
        raise SystemExit(f"need more than --warmup {warmup} steps, got {len(ends)}")
    return rank0["global_batch"] * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])


def per_step_usage(rank0: dict, warmup: int) -> dict:
    """Mean CPU seconds (user, system) and minor page faults per measured step, for telling where time went."""
    usage = rank0["step_usage"][warmup:]  # [0] is train begin: usage[k] is after step k
    steps = len(usage) - 1
    return {
        name: (usage[-1][i] - usage[0][i]) / steps
        for i, name in enumerate(("user_s_per_step", "system_s_per_step", "page_faults_per_step"))
    }


def measured_row(size: str, config: str, path: str, repeat: int, rank0: dict, parameters: int, warmup: int) -> dict:
    """One training run (a launch, or a segment of an interleaved launch) as a row of the report."""
    return {
        "size": size, "config": config, "path": path, "repeat": repeat, "parameters": parameters,
        "samples_per_s": steady_samples_per_second(rank0, warmup), "global_batch": rank0["global_batch"],
        "args_s": rank0["args_seconds"], "engine_start_s": rank0["engine_start_seconds"],
        "final_loss": rank0["final_loss"], "zero_stage": rank0["zero_stage"],
        "torch_threads": rank0["torch_threads"], **per_step_usage(rank0, warmup),
    }  # fmt: skip


def resolution_ms(model_dir: Path, config: str, repeats: int = 20) -> dict:
    """Time of hf-ext's whole config resolution (load, normalize, fill, validate), in process, in milliseconds."""
    from transformers import AutoConfig

    import hf_ext

    model = AutoConfig.from_pretrained(model_dir)  # read once: the timing is the resolution's alone
    args = hf_ext.TrainingArguments(output_dir=str(harness.ROOT / "runs" / "bench" / "resolve"), report_to=[],
                                    max_steps=10)  # fmt: skip
    times = []
    for _ in range(repeats + 1):  # the first call imports DeepSpeed's config models
        started = time.perf_counter()
        hf_ext.explain_deepspeed_config(config, args, model=model, world_size=2)
        times.append(1000 * (time.perf_counter() - started))
    return {"first_ms": times[0], "median_ms": statistics.median(times[1:]), "max_ms": max(times[1:])}


def summarize(rows: list[dict], keys: tuple[str, ...] = ("size", "config")) -> list[dict]:
    """One entry per combination of ``keys`` the rows hold: both paths' medians, their ratio, the per-pair ratios
    and their geometric mean with its 95% interval."""
    out = []
    for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        group = {
            p: [r for r in rows if tuple(r[k] for k in keys) == key and r["path"] == p] for p in ("stock", "hf-ext")
        }
        if not group["stock"] or not group["hf-ext"]:
            continue
        metrics = ("samples_per_s", "args_s", "engine_start_s", "user_s_per_step", "system_s_per_step",
                   "page_faults_per_step")  # fmt: skip
        med = {p: {m: statistics.median(r[m] for r in g) for m in metrics} for p, g in group.items()}
        ratios = [h["samples_per_s"] / s["samples_per_s"] for s, h in zip(group["stock"], group["hf-ext"])]
        entry = {
            **dict(zip(keys, key)), "parameters": group["stock"][0]["parameters"],
            "stock": med["stock"], "hf-ext": med["hf-ext"],
            "ratio": med["hf-ext"]["samples_per_s"] / med["stock"]["samples_per_s"],
            "per_launch_ratios": ratios,
            "pairs_of": "segments" if "segment" in group["stock"][0] else "launches",
            "torch_threads": {p: sorted({r["torch_threads"] for r in g}) for p, g in group.items()},
        }  # fmt: skip
        entry["geomean_ratio"], *entry["ratio_ci95"] = harness.geometric_mean_interval(ratios)
        hooks = [r["hf_ext_hook_us_per_step"] for r in group["hf-ext"] if "hf_ext_hook_us_per_step" in r]
        if hooks:  # hf-ext's own callbacks, per step, and their share of a step (at hf-ext's median throughput)
            step_us = 1e6 * group["hf-ext"][0]["global_batch"] / med["hf-ext"]["samples_per_s"]
            entry["hf_ext_hook_us_per_step"] = statistics.median(hooks)
            entry["hf_ext_hook_share_of_step"] = statistics.median(hooks) / step_us
        out.append(entry)
    return out


def table(summary: list[dict]) -> str:
    header = [
        "model", "config", "pairs of", "stock samples/s", "hf-ext samples/s", "hf-ext ÷ stock", "per-pair ratios",
        "geometric mean (95% interval)", "TrainingArguments s (stock / hf-ext)", "engine start s (stock / hf-ext)",
        "hf-ext resolution ms", "system s / step (stock / hf-ext)", "page faults / step (stock / hf-ext)",
        "hf-ext callbacks µs / step (share of a step)",
    ]  # fmt: skip
    rows = []
    for s in summary:
        hooks = "–"  # timed in interleaved runs only
        if "hf_ext_hook_us_per_step" in s:
            hooks = f"{s['hf_ext_hook_us_per_step']:.0f} ({s['hf_ext_hook_share_of_step']:.1e})"
        st, hf = s["stock"], s["hf-ext"]
        rows.append([
            f"{s['size']} ({s['parameters'] / 1e6:.1f}M)", s["config"], s["pairs_of"],
            f"{st['samples_per_s']:.2f}", f"{hf['samples_per_s']:.2f}", f"**{s['ratio']:.3f}**",
            ", ".join(f"{r:.3f}" for r in s["per_launch_ratios"]),
            f"{s['geomean_ratio']:.3f} ({s['ratio_ci95'][0]:.3f}–{s['ratio_ci95'][1]:.3f})",
            f"{st['args_s']:.2f} / {hf['args_s']:.2f}", f"{st['engine_start_s']:.1f} / {hf['engine_start_s']:.1f}",
            f"{s['resolution']['median_ms']:.1f}",
            f"{st['system_s_per_step']:.2f} / {hf['system_s_per_step']:.2f}",
            f"{st['page_faults_per_step']:,.0f} / {hf['page_faults_per_step']:,.0f}", hooks,
        ])  # fmt: skip
    return harness.markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "400m"])
    parser.add_argument("--configs", nargs="+", default=["zero2", "zero3"])
    parser.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", nargs="+", type=int, default=[60, 8], help="steps per size, in --sizes order")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    parser.add_argument("--repeats", type=int, default=2, help="stock / hf-ext pairs per size and config")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="OMP_NUM_THREADS for both paths (the extension's own cost, without hf-ext's thread placement)",
    )  # fmt: skip
    parser.add_argument(
        "--release_freed_memory", default="auto", choices=["auto", "on", "off"],
        help="hf-ext's TrainingArguments.release_freed_memory (auto, the default: off here, no plan is made)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", action="store_true",
        help="one launch per size and config, stock and hf-ext taking turns inside it (2 × --repeats segments)",
    )  # fmt: skip
    parser.add_argument("--lora", action="store_true", help="both paths train LoRA adapters (r=16, all-linear)")
    parser.add_argument("--out", default="runs/bench/train.json")
    args = parser.parse_args(argv)
    if args.interleave and args.release_freed_memory == "on":
        parser.error("--interleave runs stock in the same processes: glibc's release setting would apply to it too")
    env_extra = {"OMP_NUM_THREADS": args.threads} if args.threads else None
    steps = dict(zip(args.sizes, args.steps + args.steps[-1:] * len(args.sizes)))

    out = Path(args.out)
    work = out.with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    host_before = harness.host_info()
    rows = []
    for size in args.sizes:
        model = harness.ensure_model(size)
        parameters = harness.parameter_count(model)
        common = ["--model", str(model), "--batch", str(args.batch), "--seq_len", str(args.seq_len)]
        common += ["--steps", str(steps[size])] + (["--lora"] if args.lora else [])
        for config in args.configs:
            # both paths get the preset's JSON file: the same config (hf-ext adapts presets given by name to the host)
            config_file = work.parent / f"{work.name}_{config}.json"
            harness.write_json(config_file, load_deepspeed_config(config))
            common_config = common + ["--config", str(config_file)]
            if args.interleave:  # one launch, the paths taking turns segment by segment
                started = time.time()
                result = harness.launch_worker(
                    common_config + ["--segments", str(2 * args.repeats)],
                    Path(f"{work}_{size}_{config}_interleaved"), env_extra,
                )  # fmt: skip
                if isinstance(result, str):
                    raise SystemExit(f"{size} {config} interleaved: {result}")
                wall = round(time.time() - started, 1)
                for seg in next(r for r in result if r["rank"] == 0)["segments"]:
                    row = measured_row(size, config, seg["path"], seg["segment"] // 2, seg, parameters, args.warmup)
                    row.update(
                        segment=seg["segment"],
                        launch_wall_s=wall,
                        rss_after_bytes=seg["rss_after_bytes"],
                        hf_ext_hook_us_per_step=1e6 * seg["hf_ext_hook_seconds_per_step"],
                    )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                continue
            for repeat in range(args.repeats):
                for path in ("stock", "hf-ext") if repeat % 2 == 0 else ("hf-ext", "stock"):
                    started = time.time()
                    result = harness.launch_worker(
                        common_config + ["--path", path, "--release_freed_memory", args.release_freed_memory],
                        Path(f"{work}_{size}_{config}_{path}_{repeat}"), env_extra,
                    )  # fmt: skip
                    if isinstance(result, str):
                        raise SystemExit(f"{size} {config} {path}: {result}")
                    rank0 = next(r for r in result if r["rank"] == 0)
                    row = measured_row(size, config, path, repeat, rank0, parameters, args.warmup)
                    row.update(wall_s=round(time.time() - started, 1), released_freed_memory=rank0["released_freed_memory"])  # fmt: skip
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = summarize(rows)
    for entry in summary:
        entry["resolution"] = resolution_ms(harness.ensure_model(entry["size"]), entry["config"])
    report = {
        "command": harness.command(MODULE, argv),
        "batch": args.batch, "seq_len": args.seq_len, "steps": steps, "warmup": args.warmup,
        "repeats": args.repeats, "interleaved": args.interleave, "world_size": 2,
        "release_freed_memory": args.release_freed_memory, "threads_option": args.threads,
        "host_before": host_before, "load_average_after": harness.load_average(),
        "rows": rows, "summary": summary,
    }  # fmt: skip
    harness.write_json(out, report)
    print(table(summary))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
