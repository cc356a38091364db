"""The bench's plots: speed-up by category and method, acceptance rate by draft position."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

SPECULATIVE = ("draft", "draft-pmin", "ngram", "suffix", "hybrid", "auto", "server-spec", "server-ngram",
               "server-ngram-mod")


def split_name(name: str) -> tuple[str, str]:
    """``(method, suffix)`` of a run name: ``("auto", "@ik")`` for ``auto@ik``, ``("auto", "")`` for ``auto``
    (see :func:`specdec.bench.runner.variant`)."""
    method = name.partition("@")[0]
    return method, name[len(method):]


def plots(rows: list[dict], out: Path) -> list[Path]:
    """``speedup_by_category.png`` (decode-only and end-to-end speed-up per category and method) and
    ``acceptance_by_position.png`` (acceptance rate by draft position, one panel per category)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c in dict.fromkeys(r["category"] for r in rows)]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "none"]
    get = {(r["category"], r["method"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(cats) + 3), 8), sharex=True)
    width = 0.8 / max(1, len(methods))
    for ax, key, title in zip(axes, ("decode_speedup", "speedup"), ("decode only", "end to end")):
        for j, m in enumerate(methods):
            ys = [get[c, m][key] if (c, m) in get else math.nan for c in cats]
            ax.bar(np.arange(len(cats)) + (j - (len(methods) - 1) / 2) * width, ys, width, label=m, color=f"C{j}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"speed-up over plain ({title})")
    axes[1].set_xticks(np.arange(len(cats)), cats, rotation=20)
    axes[0].legend(ncol=min(4, len(methods)), fontsize=8)
    fig.tight_layout()
    p1 = out / "speedup_by_category.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    spec = [m for m in methods if split_name(m)[0] in SPECULATIVE and not m.startswith("server")]
    ncol = min(4, len(cats))
    fig, axes = plt.subplots(math.ceil(len(cats) / ncol), ncol, figsize=(3.2 * ncol, 2.8 * math.ceil(len(cats) / ncol)),
                             sharey=True, squeeze=False)
    for ax, c in zip(axes.flat, cats):
        for m in spec:  # the bar chart's colour of each method
            acc = get[c, m]["acceptance_by_position"] if (c, m) in get else []
            ax.plot(range(1, len(acc) + 1), acc, marker="o", markersize=3, label=m, color=f"C{methods.index(m)}")
        ax.set_title(c, fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("draft position")
    for ax in axes.flat[len(cats):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("acceptance rate")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "acceptance_by_position.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def score_curve_plot(curves: dict[str, dict], out: Path) -> Path | None:
    """``score_curves.png``: each backend's ``S(n)`` (ms to score n tokens in one call) and ``S(n)/S(1)``
    against n, from the bench's probe (``curves``: backend -> {n: seconds}); None when there are none."""
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for b, c in curves.items():
        pts = sorted((int(n), float(v)) for n, v in c.items() if v is not None)
        if not pts:
            continue
        n, s = np.array([p[0] for p in pts]), np.array([p[1] for p in pts]) * 1000
        axes[0].plot(n, s, marker="o", markersize=3, label=b)
        axes[1].plot(n, s / s[0], marker="o", markersize=3, label=b)
    axes[1].plot([1, 17], [1, 17], ls=":", color="grey", label="n single calls")
    for ax, title in zip(axes, ("S(n), ms", "S(n) / S(1)")):
        ax.set_title(title)
        ax.set_xlabel("tokens scored in one call (n)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "score_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
