"""Training curves as a PNG (headless matplotlib)."""

from __future__ import annotations

from pathlib import Path

# (log key, panel title) - panels with no data are left out
PANELS = (
    (("loss", "eval_loss"), "loss"),
    (("learning_rate",), "learning rate"),
    (("eval_bleu", "eval_chrf"), "generation metrics"),
)


def plot_training_curves(log_history: list[dict], path: str | Path, title: str | None = None) -> Path | None:
    """Plot train/eval loss, learning rate (and BLEU/chrF when logged) against the global step."""
    import matplotlib  # noqa: PLC0415 (optional extra: chat)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional extra: chat)

    series = {}
    for keys, _ in PANELS:
        for key in keys:
            points = [(row["step"], row[key]) for row in log_history if key in row and "step" in row]
            if points:
                series[key] = points
    panels = [(keys, name) for keys, name in PANELS if any(k in series for k in keys)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (keys, name) in zip(axes[0], panels):
        for key in keys:
            if key in series:
                steps, values = zip(*series[key])
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
