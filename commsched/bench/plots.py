"""Figures of the benchmarks: matplotlib on the file-only Agg backend, one save sequence,
and the stacked time-breakdown bars every bench writes."""

from __future__ import annotations

from pathlib import Path

from .._lazy import require


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed); the
    ``plots`` extra."""
    matplotlib = require("matplotlib", "the figures of a bench")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Lay ``fig`` out, write it to ``path`` (PNG; the folder is created), free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_breakdown(medians: dict[str, dict[str, float]], path: Path, title: str = "") -> Path:
    """One stacked bar per variant, one segment per part of its time breakdown (PNG)."""
    plt = pyplot()

    variants = list(medians)
    parts: list[str] = []
    for m in medians.values():
        parts += [k for k in m if k not in parts]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(variants) + 2.5), 4.0))
    bottom = [0.0] * len(variants)
    for k in parts:
        vals = [medians[v].get(k, 0.0) for v in variants]
        ax.bar(variants, vals, bottom=bottom, label=k)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set_ylabel("seconds (median over repeats)")
    ax.set_title(title or "time breakdown per variant")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    save_figure(fig, path)
    return path


__all__ = ["plot_breakdown", "pyplot", "save_figure"]
