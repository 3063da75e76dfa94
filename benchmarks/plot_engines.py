"""One bar chart per model: measured peak RSS per rank of each engine, one bar per run given (e.g. fp32 and bf16),
with the planner's prediction marked on each bar. Reads the JSON that ``benchmarks.bench_memory`` writes.

    python -m benchmarks.plot_engines --title "BlenderBot-400M shape, 2 CPU ranks" --png docs/memory_engines_400m.png \
        fp32=runs/bench/memory_400m_fsdp_fp32_v2.json fp32=runs/bench/memory_400m_offload_fp32.json \
        bf16=runs/bench/memory_400m_bf16.json

Each ``LABEL=FILE`` adds FILE's hf-ext rows to the series LABEL (several files may feed one series).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.bench_memory import LABELS
from benchmarks.harness import GiB

ORDER = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")


def series(specs: list[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """``{label: {config: (measured peak GiB, predicted peak GiB)}}`` from ``LABEL=FILE`` specs."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for spec in specs:
        label, _, file = spec.partition("=")
        for row in json.loads(Path(file).read_text())["rows"]:
            if row["path"] != "hf-ext" or row.get("skipped"):
                continue
            predicted = (row["predicted_increment_bytes"] + row["baseline_bytes"]) / GiB
            out.setdefault(label, {})[row["config"]] = (row["peak_bytes"] / GiB, predicted)
    return out


def plot(data: dict, title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in ORDER if any(c in rows for rows in data.values())]
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    width = 0.8 / max(1, len(data))
    for i, (label, rows) in enumerate(data.items()):
        xs = [x + (i - (len(data) - 1) / 2) * width for x in range(len(configs))]
        measured = [rows.get(c, (0, 0))[0] for c in configs]
        ax.bar(xs, measured, width, label=f"{label}, measured")
        planned = [(x, rows[c][1]) for x, c in zip(xs, configs) if c in rows]
        ax.scatter([x for x, _ in planned], [y for _, y in planned], marker="_", s=400, color="black", zorder=3,
                   label="planner" if i == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(configs)), [LABELS[c] for c in configs], fontsize=8)
    ax.set_ylabel("peak RSS per rank (GiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=bench_memory JSON")
    parser.add_argument("--title", default="")
    parser.add_argument("--png", required=True)
    opts = parser.parse_args(argv)
    plot(series(opts.runs), opts.title, Path(opts.png))
    print(f"wrote {opts.png}")


if __name__ == "__main__":
    main()
