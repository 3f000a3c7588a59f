"""``python -m boost_jax.plot``: overlay the loss curves of one or more training runs.

    python -m boost_jax.plot runs/dp4_tp1 runs/dp1_tp4 --out=loss.png
    python -m boost_jax.plot fullrank=runs/dense cola=runs/cola --metric=eval_loss

Each argument is a run's workdir (the one holding ``metrics.jsonl``), optionally prefixed with
``label=``; the label defaults to the workdir's name.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("out", "loss.png", "where the PNG goes")
    flags.DEFINE_string("metric", "loss", "the metrics.jsonl field to plot against step "
                        "(loss, eval_loss, grad_norm, tokens_per_sec, ...)")


def parse_runs(args: list[str]) -> dict[str, Path]:
    """``[label=]workdir`` arguments as ``{label: workdir}``; raises ValueError on a workdir
    without ``metrics.jsonl`` or a repeated label."""
    if not args:
        raise ValueError("give at least one run workdir ([label=]path)")
    runs: dict[str, Path] = {}
    for arg in args:
        label, _, path = arg.rpartition("=") if "=" in arg else ("", "", arg)
        workdir = Path(path)
        label = label or workdir.name
        if not (workdir / "metrics.jsonl").is_file():
            raise ValueError(f"{workdir} has no metrics.jsonl (is it a run's workdir?)")
        if label in runs:
            raise ValueError(f"two runs are labelled {label!r}; name them with label=path")
        runs[label] = workdir
    return runs


def main(argv: list[str]) -> int:
    from boost_jax.bench.plots import loss_curves

    try:
        runs = parse_runs(argv[1:])
        loss_curves(runs, Path(FLAGS.out), FLAGS.metric)
    except ValueError as e:
        print(f"boost_jax.plot: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {FLAGS.out}: {FLAGS.metric} of {', '.join(runs)}")
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
