"""Per-rank peak memory of DDP, ZeRO-1/2/3 and ZeRO-3 + offload at 2 ranks, stock HF path vs hf-ext path, next to
the planner's prediction; results as JSON, a table and a PNG bar chart in docs/benchmarks.md ("Memory" section).

    python scripts/bench_memory.py --size 400m --out runs/bench_memory.json
    python scripts/bench_memory.py --model runs/models/medium --steps 3 --configs ddp zero2 zero3

Each configuration is one 2-rank launch of scripts/memory_worker.py (DDP under torchrun, the others under
deepspeed), run one at a time. Before each launch the available RAM is checked against the planner's prediction
for both ranks plus a margin; a configuration that does not fit is recorded as skipped, not run.

"stock": transformers' TrainingArguments/Trainer with the preset JSON as is ("auto"s filled by transformers).
"hf-ext": hf_ext's TrainingArguments/Trainer with the same preset (config resolution, CPU thread placement, freed
memory returned to the OS). Peak RSS is measured per rank with the kernel's high-water mark from just before the
model is created to the end of training; "increment" is that peak minus the RSS before the model existed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent
WORKER = ROOT / "scripts" / "memory_worker.py"
CONFIGS = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "zero3_offload": "zero3_offload"}
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3_offload": "ZeRO-3 + offload"}
GiB = 2**30
SECTION = "## Memory"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


RELEASE = ("--release_freed_memory", "on")  # hf-ext's memory runs: TrainingArguments.release_freed_memory=True


def launch(
    model: Path, config: str, path: str, opts, out: Path, extra: tuple[str, ...] = (), env_extra: dict | None = None
) -> list[dict] | str:
    args = ["--model", str(model), "--config", CONFIGS.get(config, config), "--path", path, "--out", str(out)]
    args += ["--batch", str(opts.batch), "--seq_len", str(opts.seq_len), "--steps", str(opts.steps), *extra]
    return launch_worker(WORKER, args, out, env_extra, torchrun=config == "ddp")


def launch_worker(
    worker: Path, args: list[str], out: Path, env_extra: dict | None = None, torchrun: bool = False
) -> list[dict] | str:
    """Run ``worker`` on 2 ranks (deepspeed's launcher, or torchrun); its per-rank ``OUT.rank<N>.json``, or why not."""
    port = str(free_port())
    if torchrun:
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, str(worker)]
    else:
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port, str(worker)]
    cmd += args
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMP_NUM_THREADS", None)
    env.update(env_extra or {})
    for rank in (0, 1):
        Path(f"{out}.rank{rank}.json").unlink(missing_ok=True)
    log = Path(f"{out}.log")
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        return f"exit {proc.returncode} (see {log}): " + log.read_text()[-300:].replace("\n", " ")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


def preset_zero(config: str, hidden: int | None) -> dict:
    """The ``zero_optimization`` section hf-ext runs preset ``config`` with on this host, "auto" sizes filled."""
    from hf_ext.deepspeed.resolve import CPU_ZERO3_GRANULARITY, CPU_ZERO3_KEYS, load_deepspeed_config
    from hf_ext.runtime import has_accelerator

    zero = load_deepspeed_config(config)["zero_optimization"]
    zero = {k: (hidden**2 if v == "auto" else v) for k, v in zero.items()}
    if zero["stage"] == 3 and not has_accelerator():  # what hf-ext's presets run with on a CPU-only host
        zero.update(dict.fromkeys(CPU_ZERO3_KEYS, CPU_ZERO3_GRANULARITY))
    return zero


def predictions(model_dir: Path, opts) -> dict:
    """The planner's per-rank prediction (above the process baseline) for each configuration."""
    import gc

    from transformers import AutoModelForSeq2SeqLM

    from hf_ext.memory import formulas as planner

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    facts = planner.model_facts(model)
    profile = planner.probe_activations(model, opts.seq_len, (1, 2))
    del model
    gc.collect()
    out = {}
    for name, config in CONFIGS.items():
        if name == "ddp":
            candidate, zero = planner.Candidate(0, ddp=True), None
        else:
            zero = preset_zero(config, facts.hidden_size)
            off = [isinstance(zero.get(k), dict) and zero[k].get("device") == "cpu" for k in ("offload_optimizer", "offload_param")]  # fmt: skip
            candidate = planner.Candidate(zero["stage"], *off)
        out[name] = planner.plan(candidate, facts, profile, 2, opts.batch, zero=zero)
    return {"num_params": facts.num_params, "plans": out}


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.27
    series = [("stock", "stock HF"), ("hf-ext", "hf-ext"), ("predicted", "planner (hf-ext)")]
    for i, (key, label) in enumerate(series):
        values = []
        for name in names:
            row = next((r for r in rows if r["config"] == name and r["path"] == ("hf-ext" if key == "predicted" else key)), None)  # fmt: skip
            if row is None or row.get("skipped"):
                values.append(0)
            elif key == "predicted":
                values.append((row["predicted_increment_bytes"] + row["baseline_bytes"]) / GiB)
            else:
                values.append(row["peak_bytes"] / GiB)
        ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
    ax.set_ylabel("peak RSS per rank (GiB)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict, png: str) -> str:
    o = result["settings"]
    lines = [
        SECTION,
        "",
        f"`python scripts/bench_memory.py {o['cmdline']}` — {result['model']} ({result['num_params']:,} parameters), "
        f"2 CPU ranks, fp32 AdamW, micro-batch {o['batch']} x {o['seq_len']} tokens, {o['steps']} steps, "
        f"{result['date']}. Peak RSS per rank (max of the two ranks) from before the model is created to the end "
        "of training; increment = peak minus the RSS before the model existed; planner = predicted increment "
        "(± band: 15% + 64 MiB).",
        "",
        "| config | stock peak GiB | hf-ext peak GiB | stock incr. GiB | hf-ext incr. GiB | planner incr. GiB | "
        "planner ÷ measured (hf-ext) |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["config"], r["path"]): r for r in result["rows"]}
    for name in dict.fromkeys(r["config"] for r in result["rows"]):
        cells = [LABELS[name]]
        s, h = by.get((name, "stock")), by.get((name, "hf-ext"))
        for r in (s, h):
            cells.append("skipped" if r is None or r.get("skipped") else f"{r['peak_bytes'] / GiB:.2f}")
        for r in (s, h):
            cells.append("—" if r is None or r.get("skipped") else f"{r['increment_bytes'] / GiB:.2f}")
        pred = result["predictions"].get(name)
        cells.append(f"{pred / GiB:.2f}" if pred else "—")
        ok = h is not None and not h.get("skipped") and pred
        cells.append(f"{pred / h['increment_bytes']:.2f}" if ok else "—")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for key, label in (("ratio_stock", "stock"), ("ratio_hf_ext", "hf-ext")):
        value = result.get(key)
        lines.append(f"- ZeRO-3 ÷ DDP peak RSS, {label}: {value:.2f}" if value else f"- ZeRO-3 ÷ DDP, {label}: n/a")
    skipped = [f"{LABELS[r['config']]} ({r['path']}): {r['skipped']}" for r in result["rows"] if r.get("skipped")]
    if skipped:
        lines.append("- not measured: " + "; ".join(skipped))
    lines += ["", f"![per-rank peak RSS]({png})", ""]
    return "\n".join(lines)


def write_section(doc: Path, text: str, section: str = SECTION) -> None:
    """Replace the ``section`` of ``doc`` (from its heading up to the next "## " heading), or append it."""
    old = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    start = old.find(section + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(section))
        new = old[:start] + text + (old[end + 1 :] if end >= 0 else "")
    doc.write_text(new.rstrip("\n") + "\n", encoding="utf-8")


def ratio(rows, path):
    peaks = {r["config"]: r["peak_bytes"] for r in rows if r["path"] == path and not r.get("skipped")}
    return peaks["zero3"] / peaks["ddp"] if "zero3" in peaks and "ddp" in peaks else None


def report(model, pred, rows, opts, argv) -> dict:
    result = {
        "model": str(model),
        "num_params": pred["num_params"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {
            "batch": opts.batch,
            "seq_len": opts.seq_len,
            "steps": opts.steps,
            "cmdline": " ".join(sys.argv[1:] if argv is None else argv),
        },
        "predictions": {name: p.total_bytes for name, p in pred["plans"].items()},
        "plans": {name: p.to_dict() for name, p in pred["plans"].items()},
        "rows": rows,
        "ratio_stock": ratio(rows, "stock"),
        "ratio_hf_ext": ratio(rows, "hf-ext"),
    }
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    doc = Path(opts.docs)
    png = Path(opts.png)
    chart(rows, png)
    write_section(doc, markdown(result, os.path.relpath(png, doc.parent)))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="400m", help="tiny_model size to build when --model is not given")
    parser.add_argument("--model", default=None, help="model directory (default: runs/models/<size>)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--paths", nargs="+", default=["stock", "hf-ext"], choices=["stock", "hf-ext"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--margin_gib", type=float, default=1.0, help="free RAM kept beyond the two ranks' needs")
    parser.add_argument("--out", default="runs/bench_memory.json")
    parser.add_argument("--docs", default="docs/benchmarks.md")
    parser.add_argument("--png", default="docs/memory.png")
    opts = parser.parse_args(argv)

    model = Path(opts.model or ROOT / "runs" / "models" / opts.size)
    if not (model / "config.json").exists():
        from chat_e.models import build

        build(str(model), opts.size, seed=0)
    pred = predictions(model, opts)
    work = Path(opts.out).with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in opts.configs:
        plan = pred["plans"][name]
        for path in opts.paths:
            need = 2 * (plan.total_bytes + 600 * 2**20) + int(opts.margin_gib * GiB)  # two ranks + baselines
            free = available()
            row = {"config": name, "path": path, "predicted_increment_bytes": plan.total_bytes, "band": plan.band}
            if free < need:
                row["skipped"] = f"{free / GiB:.1f} GiB available, {need / GiB:.1f} GiB needed"
                print(f"{name} ({path}): skipped, {row['skipped']}", flush=True)
                rows.append(row)
                continue
            started = time.time()
            # hf-ext as run for a memory budget: freed memory released, as whenever the planner plans the run
            result = launch(model, name, path, opts, Path(f"{work}_{name}_{path}"), RELEASE)
            if isinstance(result, str):
                row["skipped"] = result
            else:
                worst = max(result, key=lambda r: r["peak_bytes"])
                row.update({k: worst[k] for k in ("peak_bytes", "baseline_bytes", "increment_bytes", "zero_stage")})
                row["ranks"] = [{k: r[k] for k in ("peak_bytes", "baseline_bytes", "increment_bytes")} for r in result]
            row["seconds"] = round(time.time() - started, 1)
            print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
            rows.append(row)
            report(model, pred, rows, opts, argv)  # partial results survive an interrupted run
    result = report(model, pred, rows, opts, argv)
    print(f"wrote {opts.out}, {opts.png}, section '{SECTION}' of {opts.docs}")
    return result


if __name__ == "__main__":
    main()
