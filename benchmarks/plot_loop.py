"""What each try of the loop bought, side by side: bench_loop's JSON results as one figure.

    python -m benchmarks.plot_loop runs/bench/loop_dpo.json runs/bench/loop_sft.json --png docs/loop-tries.png

Three panels, one row per run (its Train-page method, steps, LoRA rank and learning rate), each with its 95 %
interval: the change in the preference met on held-out messages (paired, points; the goal's +20 marked), the new
model's blind-arena win rate (50 % marked) and the change in the human-reply NLL per token (0 marked: above it is
forgetting).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(report: dict) -> str:
    run = report["run"]
    replay = f", replay {run['replay']}" if run.get("replay") else ""
    replay += f", SFT weight {run['sft_weight']:g}" if run.get("sft_weight") is not None else ""
    replay += f", users' seed {report['seed']}" if report.get("seed") else ""  # recorded since the KTO runs
    replay += f", {run['train_args']}" if run.get("train_args") else ""
    return (f"{run['method'].upper()} {run['steps']} steps, LoRA {run['lora_rank']}, lr {run['learning_rate']:g}"
            f"{replay}\n({report['feedback_rows']} feedback rows)")  # fmt: skip


def plot(reports: list[dict], png: Path) -> None:
    import io

    import matplotlib

    from hf_ext.atomic import write_bytes_atomically  # the figure whole or not at all

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("preference met, held out (change, pts)", lambda r: r["satisfaction"], 100, 20),
        ("arena: new model's win rate (%)", lambda r: r["arena"]["win_rate"], 100, 50),
        ("human-reply NLL/token (change)", lambda r: r["eval"]["differences"]["nll"], 1, 0),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 1.2 + 0.9 * len(reports)), sharey=True)
    ys = list(range(len(reports)))[::-1]
    for ax, (title, get, scale, mark) in zip(axes, panels):
        for y, report in zip(ys, reports):
            value = get(report)
            mid = value.get("diff", value.get("rate"))
            ax.errorbar(mid * scale, y, xerr=[[(mid - value["low"]) * scale], [(value["high"] - mid) * scale]],
                        fmt="o", capsize=4)  # fmt: skip
        ax.axvline(mark, color="grey", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys, [label(r) for r in reports], fontsize=8)
    axes[0].set_ylim(-0.6, len(reports) - 0.4)
    fig.suptitle("What the loop bought on make demo's model (95 % intervals)", fontsize=11)
    fig.tight_layout()

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomically(png, buffer.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench_loop JSON files (--out)")
    parser.add_argument("--png", default="docs/loop-tries.png")
    args = parser.parse_args(argv)
    plot([json.loads(Path(p).read_text()) for p in args.results], Path(args.png))
    print(f"Wrote {args.png}")


if __name__ == "__main__":
    main()
