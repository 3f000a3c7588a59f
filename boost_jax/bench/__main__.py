"""``python -m boost_jax.bench <benchmark> [flags]``; benchmarks: tp, remat, model, step, zero."""

from absl import app, flags

from boost_jax.bench import model, remat, step, tp, zero
from boost_jax.bench.measure import ROWS
from boost_jax.cli import define_gin_flags

BENCHMARKS = {"tp": tp.main, "remat": remat.main, "model": model.main, "step": step.main,
              "zero": zero.main}


def define_flags() -> None:
    define_gin_flags()
    flags.DEFINE_list("plans", list(ROWS), "tp, step: rows to compare, from "
                      f"{', '.join(ROWS)}")
    flags.DEFINE_list("policies", ["none", "full", "lowrank", "lowrank_attn"],
                      "remat policies to compare")
    flags.DEFINE_list("layouts", ["0", "1", "3", "0x4", "1x4", "3x4"],
                      "zero: Parallel.zero stages, each optionally x gradient accumulation")
    flags.DEFINE_integer("steps", 5, "timed steps per configuration (after one warm-up step)")
    flags.DEFINE_string("out", "bench_out", "step: where bench.json and the figures go")
    flags.DEFINE_bool("json", False, "print JSON instead of a table")
    flags.DEFINE_bool("paper", False, "model: the paper's rows, measured beside predicted")
    flags.DEFINE_string("hardware", "a100_80gb_4gpu", "model: hardware profile")
    flags.DEFINE_multi_string("hw_override", [], "model: field=value of the hardware profile")
    flags.DEFINE_multi_string("eff_override", [], "model: field=value of the efficiency "
                              "constants")


def main(argv):
    if len(argv) < 2 or argv[1] not in BENCHMARKS:
        raise app.UsageError(f"usage: python -m boost_jax.bench {{{'|'.join(BENCHMARKS)}}} "
                             "[flags]")
    return BENCHMARKS[argv[1]](argv[1:])


if __name__ == "__main__":
    define_flags()
    app.run(main)
