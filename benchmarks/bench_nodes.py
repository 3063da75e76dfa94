"""One node with 2 ranks against two nodes with 1 rank each (on loopback), ZeRO-3 and FSDP2: the dialogue recipe's
throughput and loss in each layout.

    python -m benchmarks.bench_nodes --size small --steps 40 --repeats 3 --out runs/bench/nodes.json

Each row is one launch of recipes/blenderbot.py (configs/tiny.yaml's data and settings, the ``--size`` model) for
``--steps`` optimizer steps. "1 node" is ``torchrun --nproc_per_node 2``; "2 nodes" is two torchrun agents started
at once, ``--nnodes 2 --nproc_per_node 1 --node_rank {0,1} --rdzv_endpoint 127.0.0.1:PORT``, which share only the
rendezvous endpoint and the output directory, as two machines would. Both layouts are world size 2 with the same
seed and data, so their losses must agree; the run summary (``all_results.json``) says how many nodes and ranks per
node each run saw. Every rank runs 1 intra-op thread (``OMP_NUM_THREADS=1``, which hf-ext respects): on separate
machines a node's single rank would take the node's cores, here the two "nodes" share this host's. Each repeat
runs both layouts back to back; the throughput ratio is the geometric mean of the repeats' ratios with its 95%
interval.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks import harness

RECIPE = harness.ROOT / "recipes" / "blenderbot.py"
ENGINES = {"zero3": ["--deepspeed", "zero3"], "fsdp": ["--fsdp", "full_shard"]}
LAYOUTS = ("1 node x 2 ranks", "2 nodes x 1 rank")
THREADS = {"OMP_NUM_THREADS": 1}


def layout_commands(layout: str) -> list[list[str]]:
    """The launcher command of every node in ``layout`` (each followed by the recipe and its arguments)."""
    if layout == LAYOUTS[0]:
        return [harness.launcher_cmd("torchrun", RECIPE)]
    port = str(harness.free_port())
    return [
        [str(harness.BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
         "--rdzv_endpoint", f"127.0.0.1:{port}", str(RECIPE)]
        for node in (0, 1)
    ]  # fmt: skip


def launch(config: str, layout: str, model_dir: Path, out: Path, steps: int) -> dict:
    recipe_args = [
        "--config", "recipes/configs/tiny.yaml", "--model_name_or_path", str(model_dir), "--output_dir", str(out),
        "--max_steps", str(steps), "--samples_to_print", "0", "--do_eval", "false", "--logging_steps", "1000",
        *ENGINES[config],
    ]  # fmt: skip
    procs = []
    for node, cmd in enumerate(layout_commands(layout)):
        log = Path(f"{out}.node{node}.log").open("w")
        env = harness.launch_env(THREADS)
        procs.append((subprocess.Popen([*cmd, *recipe_args], cwd=harness.ROOT, env=env, stdout=log, stderr=log), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    if any(codes):
        raise SystemExit(f"{config}, {layout} exited {codes}:\n{Path(procs[0][1].name).read_text()[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    run = results["run"]
    return {
        "config": config,
        "layout": layout,
        "samples_per_second": results["train_samples_per_second"],
        "train_runtime": results["train_runtime"],
        "train_loss": results["train_loss"],
        **{k: run[k] for k in ("nodes", "ranks_per_node", "world_size", "engine", "zero_stage", "fsdp")},
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per config and layout: the median throughput over the repeats, and the paired ratio to one node."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        runs = {layout: [r for r in rows if r["config"] == config and r["layout"] == layout] for layout in LAYOUTS}
        for layout in LAYOUTS:
            ratios = [
                b["samples_per_second"] / a["samples_per_second"] for a, b in zip(runs[LAYOUTS[0]], runs[layout])
            ]
            first = runs[layout][0]
            out.append({
                "config": config, "layout": layout, "nodes": first["nodes"], "ranks_per_node": first["ranks_per_node"],
                "label": f"ZeRO-{first['zero_stage']}" if first["zero_stage"] else f"FSDP2 {first['fsdp']['sharding']}",
                "median_samples_per_second": statistics.median(r["samples_per_second"] for r in runs[layout]),
                "ratio_to_one_node": harness.geometric_mean_interval(ratios),
                "losses": sorted({r["train_loss"] for r in runs[layout]}),
            })  # fmt: skip
    return out


def markdown(summary: list[dict]) -> str:
    header = ["engine", "layout", "nodes × ranks per node (run summary)", "samples/s (median)",
              "÷ 1 node (95% interval)", "final loss"]  # fmt: skip
    body = []
    for r in summary:
        mean, low, high = r["ratio_to_one_node"]
        interval = "" if math.isnan(low) else f" ({low:.2f}–{high:.2f})"
        body.append([
            r["label"], r["layout"], f"{r['nodes']} × {r['ranks_per_node']}", f"{r['median_samples_per_second']:.1f}",
            f"{mean:.2f}{interval}", ", ".join(f"{loss:.6f}" for loss in r["losses"]),
        ])  # fmt: skip
    return harness.markdown_table(header, body)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="a chat_e.data.models size")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each config and layout")
    parser.add_argument("--configs", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--out", default="runs/bench/nodes.json")
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = harness.ensure_model(args.size, tmp / args.size)
        num_params = harness.parameter_count(model_dir)
        for repeat in range(args.repeats):
            for config in args.configs:
                for i, layout in enumerate(LAYOUTS):
                    rows.append(launch(config, layout, model_dir, tmp / f"{config}_{i}_{repeat}", args.steps))
                    print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows)
    result = {
        "command": harness.command("benchmarks.bench_nodes", argv),
        "size": args.size,
        "num_params": num_params,
        "steps": args.steps,
        "host": harness.host_info(),
        "rows": rows,
        "summary": summary,
    }
    text = markdown(summary)
    return harness.finish(result, text, args.out)


if __name__ == "__main__":
    main()
