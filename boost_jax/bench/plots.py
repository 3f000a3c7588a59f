"""PNG figures for the benchmarks and runs (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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


def bars(values: dict[str, float], ylabel: str, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["#4c72b0" if not n.startswith("gspmd") else "#55a868" for n in values]
    ax.bar(list(values), list(values.values()), color=colors)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
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


def loss_curves(runs: dict[str, Path], path: Path, metric: str = "loss") -> None:
    """Overlay ``metric`` against step from several runs' ``metrics.jsonl``."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, workdir in runs.items():
        rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text()
                .splitlines() if line.strip()]
        points = [(r["step"], r[metric]) for r in rows if metric in r]
        if not points:
            raise ValueError(f"{workdir}/metrics.jsonl has no {metric!r} entries")
        ax.plot(*zip(*points), label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
