"""``python -m boost_jax.plot``: the loss curves of one or more training runs in one figure.

    python -m boost_jax.plot runs/default                  # writes runs/default/loss.png
    python -m boost_jax.plot runs/dp4_tp1 runs/dp1_tp4 --out=loss.png
    python -m boost_jax.plot fullrank=runs/dense cola=runs/cola --metric=grad_norm

Each argument is a run's workdir (the trainer's ``--workdir``, holding ``metrics.jsonl``),
optionally prefixed with ``label=``; the label defaults to the workdir's name. Every run is one
colour. For the default ``--metric=loss`` the train loss is a line and the eval loss
(``eval_loss``) markers at the steps where the run evaluated; any other field of
``metrics.jsonl`` (``eval_loss``, ``eval_ppl``, ``grad_norm``, ``lr``, ``tokens_per_sec``,
``step_time``, ``mfu``, ...) is plotted on its own. The title names each run with its model
and parallel plan from ``<workdir>/config.json`` (just the name when that file is absent).

The figure goes to ``<metric>.png`` in the first run's workdir unless ``--out`` names a file
(its suffix picks the format: ``.png``, ``.pdf``, ``.svg``, ...) or an existing directory.

A mistake in the arguments (no workdir, a workdir that does not exist or has no
``metrics.jsonl``, a metric that no run logged, an ``--out`` that cannot be written) prints
``boost_jax.plot: error: ...`` on one line, exits with code 2 and writes nothing;
``BOOST_JAX_DEBUG=1`` raises it with its traceback instead. Unparsable lines of
``metrics.jsonl`` (a write cut off by a kill) are skipped with one warning line.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from absl import flags

from boost_jax.cli import run_app, user_error

PROG = "boost_jax.plot"
FLAGS = flags.FLAGS


class PlotError(ValueError):
    """A user-caused failure: reported as one line, exit code 2."""


@dataclass
class Run:
    """One run to plot: its label, workdir, ``metrics.jsonl`` rows and title line."""

    label: str
    workdir: Path
    rows: list[dict]
    title: str


def define_flags() -> None:
    """``--out`` and ``--metric``."""
    flags.DEFINE_string("out", None, "where the figure goes: a file (.png, .pdf, .svg, ...) or "
                        "a directory; default <metric>.png in the first run's workdir")
    flags.DEFINE_string("metric", "loss", "the metrics.jsonl field to plot against step: loss "
                        "(train line and eval markers), eval_loss, eval_ppl, grad_norm, lr, "
                        "tokens_per_sec, step_time, mfu, ...")


def warn(message: str) -> None:
    """One warning line on stderr."""
    print(f"{PROG} (warning): {message}", file=sys.stderr)  # as cli.UserLines


def parse_runs(args: list[str]) -> dict[str, Path]:
    """``[label=]workdir`` arguments as ``{label: workdir}``; raises PlotError on a workdir
    that does not exist or has no ``metrics.jsonl``, and on a repeated label. An argument that
    is an existing path is a workdir even if it contains ``=``."""
    if not args:
        raise PlotError("give at least one run workdir: python -m boost_jax.plot "
                        "[label=]WORKDIR ... [--metric=loss] [--out=FILE] (see --help)")
    runs: dict[str, Path] = {}
    for arg in args:
        label, path = ("", arg) if "=" not in arg or Path(arg).exists() else arg.split("=", 1)
        workdir = Path(path)
        label = label or workdir.resolve().name
        if not workdir.is_dir():
            raise PlotError(f"workdir {workdir} does not exist (give the --workdir of a "
                            "training run, e.g. runs/default)")
        if not (workdir / "metrics.jsonl").is_file():
            raise PlotError(f"{workdir} has no metrics.jsonl (is it a run's workdir? a run "
                            "writes it from its first step on)")
        if label in runs:
            raise PlotError(f"two runs are labelled {label!r}; name them with label=WORKDIR")
        runs[label] = workdir
    return runs


def read_metrics(path: Path) -> list[dict]:
    """The entries of a ``metrics.jsonl``; unparsable lines are skipped with one warning."""
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise PlotError(f"cannot read {path}: {err.strerror}") from err
    rows, torn = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            torn.append(number)
    if torn:
        warn(f"{path}: skipped {len(torn)} unparsable line(s) (line {torn[0]}"
             f"{', ...' if len(torn) > 1 else ''}; a write cut off by a kill?)")
    return rows


def describe(label: str, workdir: Path) -> str:
    """``label: arch size, plan, mesh`` from ``<workdir>/config.json``; just ``label`` when
    the file is absent or unreadable."""
    path = workdir / "config.json"
    if not path.is_file():
        return label
    try:
        config = json.loads(path.read_text())
        model, parallel = config["Model"], config["Parallel"]
        axes = {axis: int(parallel.get(axis, 1)) for axis in ("data", "pipe", "tensor")}
        plan = f"{parallel['tp_plan']} TP" if axes["tensor"] > 1 else "no TP"
        mesh = " × ".join(f"{axis} {n}" for axis, n in axes.items() if n > 1) or "1 device"
        return f"{label}: {model['arch']} {model['size']}, {plan}, {mesh}"
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        warn(f"{path} is not a trainer's config ({type(err).__name__}: {err}); "
             "the title shows only the run's name")
        return label


def has_values(rows: list[dict], key: str) -> bool:
    """Whether some entry has a finite number under ``key``."""
    return any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for r in rows)


def output_path(out: str | None, default: Path) -> Path:
    """Where the figure goes: ``out``, ``default``'s name in ``out`` if that is a directory,
    or ``default``; raises PlotError when it cannot be written there."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(out) if out else default
    if path.is_dir():
        path = path / default.name
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise PlotError(f"cannot write {path}: {path.suffix or 'no suffix'} is not an image "
                        "format; end the --out name in .png, .pdf or .svg")
    if not path.parent.is_dir():
        raise PlotError(f"cannot write {path}: directory {path.parent} does not exist; "
                        "create it or pick another --out")
    if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise PlotError(f"cannot write {path}: permission denied; pick another --out")
    return path


def plot(args: list[str], out: str | None = None,
         metric: str = "loss") -> tuple[Path, list[str]]:
    """Read the runs named by ``args``, draw ``metric`` and write the figure; returns its path
    and the labels of the runs in it. Raises PlotError, before writing anything, on a user
    mistake."""
    from boost_jax.bench.plots import loss_curves

    workdirs = parse_runs(args)
    runs = [Run(label, w, read_metrics(w / "metrics.jsonl"), describe(label, w))
            for label, w in workdirs.items()]
    keys = [metric] if metric.startswith("eval_") else [metric, f"eval_{metric}"]
    missing = [r for r in runs if not any(has_values(r.rows, k) for k in keys)]
    if len(missing) == len(runs):
        raise PlotError(f"no run logged {metric!r} (try --metric=loss, eval_loss, grad_norm, "
                        "lr or tokens_per_sec; a metric of null, such as mfu on CPUs, has no "
                        "values)")
    for run in missing:
        warn(f"{run.workdir} has no {metric!r} values; it is left out of the figure")
    runs = [r for r in runs if r not in missing]
    path = output_path(out, next(iter(workdirs.values())) / f"{metric}.png")
    fig = loss_curves({r.label: r.rows for r in runs}, metric, "\n".join(r.title for r in runs))
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:].lower(), dpi=120)
    try:
        path.write_bytes(buffer.getvalue())
    except OSError as err:
        raise PlotError(f"cannot write {path}: {err.strerror}; pick another --out") from err
    return path, [r.label for r in runs]


def command(args: list[str], out: str | None = None, metric: str = "loss") -> int:
    """:func:`plot` with one-line errors; returns the exit code (0, or 2 on a user mistake)."""
    try:
        path, labels = plot(args, out, metric)
    except PlotError as err:
        return user_error(PROG, err)
    print(f"wrote {path}: {metric} of {', '.join(labels)}")
    return 0


def main(argv: list[str]) -> int:
    """The command: ``argv[1:]`` are the runs, the flags are parsed."""
    return command(argv[1:], FLAGS.out, FLAGS.metric)


if __name__ == "__main__":
    define_flags()
    run_app(PROG, main)
