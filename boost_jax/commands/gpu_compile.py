"""``python -m boost_jax.tools.gpu_compile``: the configured train step compiled by XLA's GPU
compiler for a cluster of GPUs, on a host without one, and what that program holds.

    python -m boost_jax.tools.gpu_compile --target=h100_sxm --topology=2x8 \\
        [--gin_file=F ...] [--gin_param=B ...] [--json] [--dump_hlo=PATH] [--check]

``--target``: a GPU model (h100_sxm, h100_pcie, h200, a100_sxm_80, a100_sxm_40, a100_pcie_80,
b200: XLA's specs, carried by the CUDA plugin of jax >= 0.12) or the path of an XLA
``GpuTargetConfigProto`` text file; ``--topology``: hosts x GPUs per host, whose product is
the mesh's size. Needs the ``gpu_compile`` extra (``pip install -e ".[gpu_compile]"``: the
CUDA plugin without NVIDIA's libraries). The report (analysis/gpu_program.py): per-device
memory against the GPU's (fits or not, headroom), every collective of the compiled program
(op, dtype, bytes, mesh axes, runs per step, asynchronous or not, the compute XLA scheduled
under it), the tensor- and data-axis traffic against the analytic formula
(commands/comm_report.py), the custom calls (cuDNN attention, cuBLAS, Triton) and fusions, what
each loop keeps per iteration for the backward pass, and XLA's estimate of the exposed
collective time beside the performance model's communication time for the same layout.
``--check`` exits 1 when the traffic differs from the formula.
"""

from __future__ import annotations

import json

from absl import app, flags

from boost_jax import cli
from boost_jax.cli import define_gin_flags, run_command
from boost_jax.compiled.gpu_report import format_gpu_report, gpu_report
from boost_jax.config import Config

FLAGS = flags.FLAGS


def define_flags() -> None:
    define_gin_flags()
    flags.DEFINE_string("target", "h100_sxm", "GPU model (h100_sxm, h100_pcie, h200, "
                        "a100_sxm_80, a100_sxm_40, a100_pcie_80, b200) or the path of an XLA "
                        "GpuTargetConfigProto text file")
    flags.DEFINE_string("topology", "1x8", "HOSTSxGPUS: hosts x GPUs per host")
    flags.DEFINE_bool("json", False, "print the report as JSON")
    flags.DEFINE_string("dump_hlo", None, "write the compiled GPU program's HLO text here")
    flags.DEFINE_bool("check", False, "exit 1 if the communication differs from the formula")


def _report(config: Config) -> int:
    rep = gpu_report(config, FLAGS.target, FLAGS.topology, FLAGS.dump_hlo)
    print(json.dumps(rep, indent=1) if FLAGS.json else format_gpu_report(rep))
    return 1 if FLAGS.check and rep["check"] else 0


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax

    # before any backend starts: the CUDA plugin is then the compiler of the mock GPUs, not a
    # backend that fails to start on a host without CUDA (analysis/gpu_target.py)
    jax.config.update("jax_platforms", "cpu")
    return run_command("gpu_compile", _report, simulated=False)


if __name__ == "__main__":
    define_flags()
    cli.run_app("gpu_compile", main)
