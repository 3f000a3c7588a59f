"""``python -m boost_jax.plan``: the fastest layouts of a model on a number of GPUs, predicted.

    python -m boost_jax.plan --gin_param=Model.size="'13b'" --gpus=8 [--gpus_per_node=4]
        [--hardware=a100_80gb_4gpu] [--batch=4 --seq_len=4096] [--top=10] [--json]
        [--emit_gin=FILE] [--verify [--verify_top=3]]
    python -m boost_jax.plan --paper [--hardware=a100_80gb_4gpu]

The model comes from gin (``--gin_file`` / ``--gin_param``), the batch and sequence length
from ``--batch`` / ``--seq_len`` (default: the configured ``Train.batch_size`` /
``Train.seq_len``). Every valid layout (``data x pipe x tensor``, plan, remat, pipeline
microbatches and schedule, gradient accumulation, ZeRO stage) is predicted by the performance
model, those above ``--memory_fraction`` of the profile's device memory are dropped and the
rest ranked by step time (boost_jax/analysis/planner.py); nothing is compiled.
``--emit_gin=FILE`` writes the winner as gin bindings ``python -m boost_jax.train
--gin_file=FILE`` runs as is. ``--verify`` compiles the ``--verify_top`` best layouts and
compares the model's memory and communication with the compiled step
(boost_jax/analysis/plan_verify.py): at full shape, by XLA's GPU compiler for the profile's
GPUs, where the ``gpu_compile`` extra is installed (no GPU needed; memory within 10 %); else a
small-shape version of the problem on simulated CPU devices (within 15 %), saying why. Exit
code 1 when they disagree.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from absl import flags

from boost_jax import cli
from boost_jax.cli import define_gin_flags
from boost_jax.errors import ConfigError

PROG = "boost_jax.plan"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The planner's flags and the gin flags (once per process)."""
    define_gin_flags()
    if "gpus" in FLAGS:
        return
    flags.DEFINE_integer("gpus", None, "devices to plan for (required)")
    flags.DEFINE_integer("gpus_per_node", None, "devices per node (default: the profile's)")
    flags.DEFINE_string("hardware", "a100_80gb_4gpu", "hardware profile: a100_80gb_4gpu, "
                        "h100_sxm, h200")
    flags.DEFINE_integer("batch", None, "global batch in sequences (default Train.batch_size)")
    flags.DEFINE_integer("seq_len", None, "tokens per sequence (default Train.seq_len)")
    flags.DEFINE_string("dtype", "bfloat16", "compute dtype planned for (written to --emit_gin)")
    flags.DEFINE_float("memory_fraction", 0.90, "share of device memory a layout may use")
    flags.DEFINE_bool("cross_node_tensor", False, "allow tensor-parallel groups larger than a "
                      "node")
    flags.DEFINE_integer("top", 10, "layouts printed")
    flags.DEFINE_bool("json", False, "print JSON instead of a table")
    flags.DEFINE_string("emit_gin", None, "write the best layout as a gin file")
    flags.DEFINE_bool("verify", False, "compile the best layouts and check the model's memory "
                      "and communication: for the profile's GPUs at full shape where the "
                      "gpu_compile extra is installed, else at small shapes on simulated CPU "
                      "devices")
    flags.DEFINE_integer("verify_top", 3, "layouts --verify compiles")
    flags.DEFINE_bool("paper", False, "print the paper's layouts (analysis/paper.py) beside the "
                      "planner's choice for each, on --hardware (the rows bring their GPUs, "
                      "batch and the default budget; other flags do not apply), as a markdown "
                      "table")


def _problem(model, train):
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.planner import Problem

    if FLAGS.gpus is None:
        raise ConfigError("--gpus is required (the devices to plan for)")
    if FLAGS.hardware not in PROFILES:
        raise ConfigError(f"--hardware={FLAGS.hardware!r} is not one of {', '.join(PROFILES)}")
    for name in ("batch", "seq_len", "top", "verify_top"):
        value = getattr(FLAGS, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}={value} must be a positive integer")
    if FLAGS.dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"--dtype={FLAGS.dtype!r} is not bfloat16 or float32")
    return Problem(model, FLAGS.gpus, FLAGS.batch or train.batch_size,
                   FLAGS.seq_len or train.seq_len, PROFILES[FLAGS.hardware],
                   gpus_per_node=FLAGS.gpus_per_node, dtype=FLAGS.dtype,
                   memory_fraction=FLAGS.memory_fraction,
                   cross_node_tensor=FLAGS.cross_node_tensor)


def format_plan(result, top: int) -> str:
    """The ranked table (and what was pruned)."""
    pb, hw = result.problem, result.problem.hardware
    m = pb.model
    lines = [f"{m.arch}/{m.size} (d={m.d_model}, {m.n_layers} layers) on {pb.gpus} x "
             f"{hw.name.split(',')[0]}, {pb.gpus_per_node} per node; batch {pb.batch} x "
             f"{pb.seq_len}, {pb.dtype}; budget {pb.budget / 2**30:.0f} GiB/device",
             f"{result.enumerated} candidates: {sum(result.invalid.values())} invalid, "
             f"{len(result.over_memory)} over memory, {len(result.layouts)} fit "
             f"({result.seconds:.1f} s, nothing compiled)"]
    head = (f"{'#':>3}  {'layout':<70}{'step s':>8}{'tokens/s':>10}{'MFU':>6}"
            f"{'GiB':>6}  binding")
    lines += [head, "-" * (len(head) + 16)]
    for i, lay in enumerate(result.layouts[:top], 1):
        lines.append(f"{i:>3}  {lay.describe():<70}{lay.step_s:>8.3f}{lay.tokens_per_s:>10,.0f}"
                     f"{100 * lay.mfu(hw):>5.1f}%{lay.memory / 2**30:>6.1f}  {lay.binding}")
    if not result.layouts:
        lines.append("no layout fits" + (
            f": the smallest needs {result.over_memory[0].memory / 2**30:.1f} GiB "
            f"({result.over_memory[0].describe()})" if result.over_memory else ""))
    return "\n".join(lines)


def format_paper(entries: list[dict]) -> str:
    """:func:`~boost_jax.analysis.paper.compare_with_planner` as a markdown table."""
    gib = 2**30
    lines = ["| row | method | paper layout | predicted s | GiB | planner's choice | predicted s "
             "| GiB | binding |", "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        p, c = e["paper"], e["choice"]
        choice = (f"{c.describe()} | {c.step_s:.3f} | {c.memory / gib:.1f} | {c.binding}"
                  if c is not None else "no layout fits | - | - | -")
        lines.append(f"| {e['row']} | {e['method']} | {p.describe()} | {p.step_s:.3f} | "
                     f"{p.memory / gib:.1f}{' (over)' if e['over'] else ''} | {choice} |")
    return "\n".join(lines)


def _run(model, train) -> int:
    from boost_jax.analysis.planner import emit_gin, plan

    if FLAGS.paper:
        from boost_jax.analysis.hardware import PROFILES
        from boost_jax.analysis.paper import ARCHITECTURES, WEAK_SCALING, compare_with_planner

        if FLAGS.hardware not in PROFILES:
            raise ConfigError(f"--hardware={FLAGS.hardware!r} is not one of "
                              f"{', '.join(PROFILES)}")
        print(format_paper(compare_with_planner(WEAK_SCALING + ARCHITECTURES,
                                                PROFILES[FLAGS.hardware])))
        return 0

    problem = _problem(model, train)
    result = plan(problem)
    if not result.layouts:
        reason = (f"the smallest layout needs {result.over_memory[0].memory / 2**30:.1f} GiB "
                  f"per device, the budget is {problem.budget / 2**30:.1f} GiB"
                  if result.over_memory else
                  next(iter(result.invalid), "no candidate layout"))
        raise ConfigError(f"no layout of {problem.gpus} GPUs fits: {reason}")
    checks = None
    if FLAGS.verify:
        from boost_jax.analysis import gpu_target
        from boost_jax.compiled import plan_verify

        why = plan_verify.gpu_target_missing(FLAGS.hardware)
        if why is None:  # the layouts themselves, compiled for the profile's GPUs
            import jax

            # before any backend starts: the CUDA plugin compiles for mock GPUs (no GPU here)
            jax.config.update("jax_platforms", "cpu")
            checks = plan_verify.verify_on_gpu(problem, FLAGS.verify_top,
                                               gpu_target.GPU_TARGETS[FLAGS.hardware])
        else:
            from boost_jax.parallel.mesh import request_host_devices

            print(f"verify: small shapes on simulated CPU devices ({why})", file=sys.stderr)
            request_host_devices(max(problem.gpus, 1))  # no effect once JAX's backends are up
            checks = plan_verify.verify(problem, FLAGS.verify_top)
    if FLAGS.emit_gin:
        try:
            Path(FLAGS.emit_gin).write_text(emit_gin(result.layouts[0], problem))
        except OSError as err:
            raise ConfigError(f"--emit_gin={FLAGS.emit_gin}: {err.strerror}") from None
    hw = problem.hardware
    if FLAGS.json:
        print(json.dumps({
            "hardware": dataclasses.asdict(problem.node_hardware), "gpus": problem.gpus,
            "batch": problem.batch, "seq_len": problem.seq_len, "dtype": problem.dtype,
            "budget_gib": problem.budget / 2**30, "enumerated": result.enumerated,
            "invalid": sum(result.invalid.values()), "over_memory": len(result.over_memory),
            "seconds": result.seconds,
            "layouts": [lay.to_json(hw) for lay in result.layouts[:FLAGS.top]],
            "verify": checks}, indent=1))
    else:
        print(format_plan(result, FLAGS.top))
        if checks is not None:
            from boost_jax.compiled.plan_verify import format_checks

            print()
            print(format_checks(checks))
        if FLAGS.emit_gin:
            print(f"wrote {FLAGS.emit_gin}: python -m boost_jax.train --gin_file="
                  f"{FLAGS.emit_gin}")
    return 1 if checks and any(c["flags"] for c in checks) else 0


def main(argv) -> int:
    if len(argv) > 1:
        from absl import app

        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    # plan with the configured model; the mesh is this planner's to choose, so the configured
    # one (and its device count) is not set up: verification asks for its own CPU devices
    from boost_jax.config import Model, Train
    from boost_jax.gin_io import bound, parse_gin

    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_param, search_paths=[str(cli.CONFIGS_DIR)])
        return _run(Model(**bound(Model)), Train(**bound(Train)))
    except ConfigError as err:
        return cli.user_error(PROG, err)


if __name__ == "__main__":
    define_flags()
    cli.run_app(PROG, main)
