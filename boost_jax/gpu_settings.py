"""GPU run settings in one place: the XLA GPU flags and the memory fraction the launchers set.

    eval "$(python -m boost_jax.gpu_settings --shell)"      # what launch/*.sh do on GPU hosts
    python -m boost_jax.gpu_settings                          # the table: flag, value, why

Each flag is listed with why it is set and its status: ``default`` flags are set by the
launchers, ``pipeline`` flags too when ``BOOST_JAX_XLA_PIPELINE=1``; ``candidate`` flags are
timed on and off (one train step per setting) by ``launch/gpu_session.sh`` and become
``default`` only when that measurement says they help. The defaults are the starting point
MaxText's GPU configurations and JAX's GPU performance guide use. Measured on one H200
(2026-11-28, the CoLA 1B step; docs/BENCHMARKS.md "On a GPU"): no candidate helped -- one GPU
has no collective for the collective flags to act on; command buffers off and Triton GEMMs off
cost 1.5 and 2.3 % -- so nothing changed status; the collective flags need several GPUs.

A variable already in the environment wins: ``XLA_FLAGS`` given by the user replaces these flags
(``--append`` adds the user's after them), ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is kept.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    value: str
    why: str
    status: str  # default | candidate


#: JAX's preallocation share when unset is 0.75; a dedicated training GPU can give more
MEM_FRACTION = "0.90"

FLAGS_LIST = (
    Flag("xla_gpu_enable_latency_hiding_scheduler", "true",
         "schedule collectives to overlap with compute", "default"),
    # not by default: under gradient accumulation it pipelines the micro-step loop's
    # all-gathers by running each layer's tensor all-reduces twice (the 7B TP4 step: 2x the
    # formula's traffic, +3.4 GiB temporaries; compiled deviceless for A100s, 2026-11-28;
    # tests/compiled/test_gpu_report_layouts.py keeps it off the defaults)
    Flag("xla_gpu_enable_pipelined_all_gather", "true",
         "FSDP: the next layer's all-gather under this layer's compute", "candidate"),
    Flag("xla_gpu_enable_pipelined_reduce_scatter", "true",
         "FSDP, ZeRO-1: a layer's gradient reduce-scatter under the next layer's backward",
         "default"),
    Flag("xla_gpu_enable_pipelined_all_reduce", "true",
         "zero 0: a layer's gradient all-reduce under the next layer's backward", "default"),
    Flag("xla_gpu_enable_while_loop_double_buffering", "true",
         "layer scan: the next iteration's inputs prefetched", "candidate"),
    Flag("xla_gpu_enable_triton_gemm", "false",
         "cuBLAS instead of Triton for GEMMs (the skinny low-rank GEMMs may differ)",
         "candidate"),
    Flag("xla_gpu_all_reduce_combine_threshold_bytes", str(64 * 2**20),
         "combine the many small r-wide all-reduces of BTP into fewer launches", "candidate"),
    Flag("xla_gpu_enable_command_buffer", "",
         "empty = command buffers (CUDA graphs) off; the default records them", "candidate"),
    # pipeline parallelism (JAX's GPU performance guide), with BOOST_JAX_XLA_PIPELINE=1
    Flag("xla_gpu_experimental_pipeline_parallelism_opt_level",
         "PIPELINE_PARALLELISM_OPT_LEVEL_ENABLE", "XLA schedules the stage-to-stage permutes",
         "pipeline"),
    Flag("xla_disable_hlo_passes", "collective-permute-motion",
         "keeps the permutes where the pipeline schedule put them", "pipeline"),
)


def flag_text(flags=FLAGS_LIST, status: tuple[str, ...] = ("default",)) -> str:
    """The ``XLA_FLAGS`` string of the flags whose status is in ``status``."""
    return " ".join(f"--{f.name}={f.value}" for f in flags if f.status in status)


def compiler_options(env: dict | None = None) -> dict[str, str]:
    """The launchers' XLA flags (``default``, plus ``pipeline`` with
    ``BOOST_JAX_XLA_PIPELINE=1`` in ``env``) as per-compile options: what
    ``python -m boost_jax.tools.gpu_compile`` compiles with, so that its program is the one a
    launched run gets."""
    env = os.environ if env is None else env
    status = ("default", "pipeline") if env.get("BOOST_JAX_XLA_PIPELINE") == "1" else ("default",)
    return {f.name: f.value for f in FLAGS_LIST if f.status in status}


#: the new names of the launchers' pipelining flags in the XLA of jaxlib >= 0.11
#: (xla/debug_options_flags.cc: "True maps to --xla_gpu_pipeline_all_reduce=on"): XLA_FLAGS
#: still takes the old names, a per-compile option only the new ones
_RENAMED = {f"xla_gpu_enable_pipelined_{c}": f"xla_gpu_pipeline_{c}"
            for c in ("all_gather", "reduce_scatter", "all_reduce")}


def typed_compiler_options(options: dict[str, str], renamed: bool) -> dict[str, object]:
    """``options`` as jax's ``compile(compiler_options=...)`` takes them: booleans as bools;
    ``renamed`` (compat.xla_pipelining_options_renamed): the pipelining flags under their new
    names."""
    out: dict[str, object] = {}
    for name, value in options.items():
        typed: object = {"true": True, "false": False}.get(value, value)
        if renamed and name in _RENAMED:
            name, typed = _RENAMED[name], ("COLLECTIVE_PIPELINING_MODE_ON" if typed
                                           else "COLLECTIVE_PIPELINING_MODE_DEFAULT")
        out[name] = typed
    return out


def environment(env: dict | None = None, append: bool = False) -> dict[str, str]:
    """The variables to export on a GPU host, given the current ``env``."""
    env = os.environ if env is None else env
    pipeline = env.get("BOOST_JAX_XLA_PIPELINE") == "1"
    ours = flag_text(status=("default", "pipeline") if pipeline else ("default",))
    user = env.get("XLA_FLAGS", "").strip()
    xla = (f"{ours} {user}".strip() if append else user) if user else ours
    return {"XLA_FLAGS": xla,
            "XLA_PYTHON_CLIENT_MEM_FRACTION": env.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                      MEM_FRACTION)}


if __name__ == "__main__":  # the command's documented name; the command: commands/gpu_settings.py
    import runpy

    runpy.run_module("boost_jax.commands.gpu_settings", run_name="__main__", alter_sys=True)
