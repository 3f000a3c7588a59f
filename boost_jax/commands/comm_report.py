"""``python -m boost_jax.tools.comm_report``: what a configured train step sends, read from the
compiled HLO, beside the analytic prediction.

    python -m boost_jax.tools.comm_report [--gin_file=F ...] [--gin_param=B ...] [--json]
        [--dump_hlo=PATH] [--check]

The train step of the configured model, plan and mesh is compiled for abstract inputs (no data
and no parameters are needed; on a CPU host the mesh's devices are simulated). The report lists
every collective (op, dtype, per-device shape, bytes, mesh axes of its replica groups, runs per
step with loop trip counts applied, forward or backward, and where: ``layer``, ``step`` for the
model's boundary, ``optimizer`` for the update's gradient reduction, norm and parameter
gathers), totals per mesh axis (elements, bytes, ring wire bytes), tensor-axis traffic per
layer per token against the analytic formula, every axis's traffic per step against the
formulas of analysis/comm.py (data-axis and ZeRO / FSDP / accumulation collectives included),
and the compiler's memory and cost analyses. ``--check`` exits 1 when the measured traffic
differs from the prediction.
"""

from __future__ import annotations

import json

from absl import app, flags

from boost_jax import cli
from boost_jax.cli import define_gin_flags, run_command
from boost_jax.compiled.step_report import build_report, format_report
from boost_jax.config import Config

FLAGS = flags.FLAGS


def define_flags() -> None:
    define_gin_flags()
    flags.DEFINE_bool("json", False, "print the report as JSON")
    flags.DEFINE_string("dump_hlo", None, "write the compiled HLO text to this path")
    flags.DEFINE_bool("check", False, "exit 1 if measured communication differs from the formula")


def _report(config: Config) -> int:
    rep = build_report(config, FLAGS.dump_hlo)
    print(json.dumps(rep, indent=1) if FLAGS.json else format_report(rep))
    return 1 if FLAGS.check and rep["check"] else 0


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    return run_command("comm_report", _report)


if __name__ == "__main__":
    define_flags()
    cli.run_app("comm_report", main)
