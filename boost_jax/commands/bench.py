"""``python -m boost_jax.bench <benchmark> [flags]``; benchmarks: tp, remat, model, step, zero,
memory, data, checkpoint, gpu."""

from absl import app, flags

from boost_jax import cli
from boost_jax.bench import checkpoint, data, gpu, memory, model, remat, step, tp, zero
from boost_jax.bench.measure import ROWS
from boost_jax.cli import define_gin_flags

BENCHMARKS = {"tp": tp.main, "remat": remat.main, "model": model.main, "step": step.main,
              "zero": zero.main, "memory": memory.main, "data": data.main,
              "checkpoint": checkpoint.main, "gpu": gpu.main}


def define_flags() -> None:
    define_gin_flags()
    flags.DEFINE_list("plans", list(ROWS), "tp, step: rows to compare, from "
                      f"{', '.join(ROWS)}")
    flags.DEFINE_list("policies", ["none", "full", "lowrank", "lowrank_attn"],
                      "remat policies to compare")
    flags.DEFINE_list("layouts", ["0", "1", "3", "0x4", "1x4", "3x4"],
                      "zero: Parallel.zero stages, each optionally x gradient accumulation")
    flags.DEFINE_list("memory_rows", [], "memory: the paper-shape rows, from "
                      f"{', '.join(memory.ROWS)} (default: {', '.join(memory.CPU_ROWS)}; "
                      f"with --target {', '.join(memory.GPU_ROWS)})")
    flags.DEFINE_string("target", None, "memory: compile for these GPUs with XLA's GPU "
                        f"compiler, without a GPU ({', '.join(memory.TARGET_PROFILES)}; the "
                        "gpu_compile extra) instead of simulated CPU devices")
    flags.DEFINE_list("methods", ["fullrank", "vanilla", "boost"], "memory --target: the "
                      "paper's methods to compile each row for")
    flags.DEFINE_list("memory_microbatches", [], "memory: the pipelined rows with this many "
                      "pipeline microbatches instead of the paper's (with --target, a list: "
                      "each)")
    flags.DEFINE_integer("memory_layers", 0, "memory --target: compile each row with this many "
                         "decoder layers (its widths, reduced depth; 0: the model's)")
    flags.DEFINE_list("schedules", [], "memory --target: the pipelined rows under each of "
                      "these pipeline schedules, gpipe or circular:R (R repeats), with each "
                      "one's bubble and what 1F1B would hold by the performance model")
    flags.DEFINE_integer("steps", 5, "timed steps per configuration (after one warm-up step)")
    flags.DEFINE_string("out", "bench_out", "step: where bench.json and the figures go; data "
                        "--prepare_mb: where the corpus and the prepared dataset go")
    flags.DEFINE_list("loader_workers", ["0", "2", "4"], "data: grain worker counts")
    flags.DEFINE_list("packings", ["concat", "document"], "data: Data.packing values")
    flags.DEFINE_integer("batches", 50, "data: global batches read per loader row")
    flags.DEFINE_float("consume_tokens_per_s", 0.0, "data: the trainer's rate to compare with "
                       "(0: time the configured train step here)")
    flags.DEFINE_float("prepare_mb", 0.0, "data: prepare a synthetic corpus of this many MiB "
                       "instead of timing the loader")
    flags.DEFINE_integer("prepare_workers", -1, "data --prepare_mb: tokenizer processes "
                         "(-1: one per core)")
    flags.DEFINE_multi_string("prepare_arg", [], "data --prepare_mb: a flag passed on to "
                              "boost_jax.data.prepare, e.g. --prepare_arg=--chunk_mb=8")
    flags.DEFINE_integer("kill_after_shards", 0, "data --prepare_mb: SIGKILL the first run "
                         "after this many finished shards, then resume")
    flags.DEFINE_bool("json", False, "print JSON instead of a table")
    flags.DEFINE_list("parts", list(gpu.PARTS), "gpu: parts to measure")
    flags.DEFINE_list("seq_lens", ["4096"], "gpu attention: sequence lengths")
    flags.DEFINE_bool("paper", False, "model: the paper's rows, measured beside predicted")
    flags.DEFINE_bool("held_out", False, "model --paper: the row-fitted constants refitted with "
                      "each full-rank row left out, and that row's error (analysis/calibrate.py)")
    flags.DEFINE_string("hardware", "a100_80gb_4gpu", "model: hardware profile")
    flags.DEFINE_multi_string("hw_override", [], "model: field=value of the hardware profile")
    flags.DEFINE_multi_string("eff_override", [], "model: field=value of the efficiency "
                              "constants")


def main(argv):
    if len(argv) < 2 or argv[1] not in BENCHMARKS:
        given = f"unknown benchmark {argv[1]!r}" if len(argv) > 1 else "no benchmark named"
        raise app.UsageError(f"{given}; usage: python -m boost_jax.bench "
                             f"{{{'|'.join(BENCHMARKS)}}} [flags]")
    return BENCHMARKS[argv[1]](argv[1:])


if __name__ == "__main__":
    define_flags()
    cli.run_app("bench", main)
