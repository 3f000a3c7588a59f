"""PNG figures for the benchmarks and runs (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COMPUTE = ("gemm", "attention", "elementwise", "optimizer")
COMMUNICATION = ("tp", "pp", "dp")


def time_breakdown(panels: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    """One panel per title, stacked bars per plan: compute, communication and pipeline bubble
    (the paper's Fig. 1)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    parts = [("compute", COMPUTE, "#4c72b0"), ("communication", COMMUNICATION, "#dd8452"),
             ("bubble", ("bubble",), "#8c8c8c")]
    for ax, (title, breakdowns) in zip(axes[0], panels.items()):
        names = list(breakdowns)
        bottom = [0.0] * len(names)
        for label, keys, color in parts:
            values = [1e3 * sum(breakdowns[n].get(k, 0.0) for k in keys) for n in names]
            if any(values):
                ax.bar(names, values, bottom=bottom, label=label, color=color)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("predicted time per step (ms)")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: the bars' colours: boost_jax's explicit plans, and the GSPMD baseline (rows ``gspmd-*``)
EXPLICIT, GSPMD = ("#4c72b0", "explicit shard_map plans"), (
    "#55a868", "GSPMD baseline: the same shardings, XLA picks the collectives")


def bars(values: dict[str, float], ylabel: str, title: str, path: Path) -> None:
    """One bar per row, its value written on it; a legend says what the colours are when the
    GSPMD baseline's rows are among them."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    kinds = [GSPMD if n.startswith("gspmd") else EXPLICIT for n in values]
    drawn = ax.bar(list(values), list(values.values()), color=[c for c, _ in kinds])
    ax.bar_label(drawn, labels=[f"{v:,.0f}" for v in values.values()], fontsize=7, padding=2)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.margins(y=0.15)
    if GSPMD in kinds:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=c, label=label) for c, label in (EXPLICIT, GSPMD)],
                  fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2,
                  frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaling(rows: list[dict], path: Path, hardware: str) -> None:
    """Predicted (lines) and the paper's measured (points) iteration time over GPU count."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    gpus = [r["gpus"] for r in rows]
    for method, color in (("fullrank", "#c44e52"), ("vanilla", "#8172b3"), ("boost", "#4c72b0")):
        ax.plot(gpus, [r[method]["predicted_s"] for r in rows], "-", color=color,
                label=f"{method} (model)")
        ax.plot(gpus, [r[method]["measured_s"] for r in rows], "o", color=color,
                label=f"{method} (paper)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [f"{r['row']}\n{r['gpus']} GPU" for r in rows], fontsize=7)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"weak scaling: the model on {hardware.split(',')[0]}\n"
                 "vs the BOOST paper's measurements (A100)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


METRIC_AXES = {"loss": "loss (nats/token)", "eval_loss": "eval loss (nats/token)",
               "eval_ppl": "eval perplexity (exp of the eval loss)",
               "grad_norm": "gradient norm (L2, before clipping)", "lr": "learning rate",
               "step_time": "step time (s)", "tokens_per_sec": "throughput (tokens/s)",
               "tflops_per_device": "model TFLOP/s per device",
               "mfu": "MFU (fraction of peak FLOP/s)", "nonfinite": "non-finite step (1 = yes)"}


def loss_curves(runs: dict[str, list[dict]], metric: str = "loss", title: str = "") -> Figure:
    """``metric`` against step for several runs' ``metrics.jsonl`` entries (``{label: rows}``),
    one colour per run: train values as a line, ``eval_<metric>`` values (the eval loss for
    ``loss``) as markers of the same colour; an ``eval_*`` metric is markers on a line. Rows
    without a finite number under the key are skipped; raises ValueError when no run has any.
    The caller saves the returned figure (``fig.savefig(path)``)."""

    def points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
        pairs = sorted((r["step"], r[key]) for r in rows
                       if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))
        return [s for s, _ in pairs], [v for _, v in pairs]

    fig = Figure(figsize=(7, 4.2 + 0.18 * title.count("\n")))
    ax = fig.add_subplot()
    several = len(runs) > 1
    plotted = False
    for i, (label, rows) in enumerate(runs.items()):
        color, name = f"C{i % 10}", f"{label} " if several else ""
        steps, values = points(rows, metric)
        if metric.startswith("eval_"):  # evals only: markers joined by a line
            ax.plot(steps, values, "o-", color=color, markersize=4, linewidth=1.2,
                    label=f"{name}eval")
            plotted |= bool(steps)
            continue
        if steps:
            ax.plot(steps, values, "-", color=color, linewidth=1.2, label=f"{name}train")
        eval_steps, eval_values = points(rows, f"eval_{metric}")
        if eval_steps:
            ax.plot(eval_steps, eval_values, "o", color=color, markersize=6,
                    markeredgecolor="black", markeredgewidth=0.8, label=f"{name}eval")
        plotted |= bool(steps or eval_steps)
    if not plotted:
        raise ValueError(f"no run has {metric!r} entries")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.set_ylabel(METRIC_AXES.get(metric, metric))
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
