"""``python -m boost_jax.bench zero``: the data-parallel layouts (``Parallel.zero`` 0 / 1 / 3)
with and without gradient accumulation, side by side.

For each layout (``--layouts``, default ``0,1,3`` each with ``grad_accum`` 1 and 4) on the
configured model and mesh (default: CoLA 60M, ``btp`` on data=2 x tensor=4, batch 16 x seq 256,
fp32): the train state per device (parameters and optimizer moments, from the shardings),
compiled temporary memory, the data-axis collectives per step and the bytes each device puts
on the wire for them (read from the compiled HLO), the share of those bytes moved inside the
layer loops (per layer, under the neighbouring layers' compute on a GPU) rather than once per
step, and the median step time. The mesh is the configured one: with ``Parallel.pipe > 1`` the
rows are the layouts under pipelining (FSDP x pipeline included).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math

import jax
from absl import flags

from boost_jax.bench.measure import format_rows, measure, run_benchmark
from boost_jax.config import Config, ConfigError

FLAGS = flags.FLAGS

DEFAULTS = ["Model.size='60m'", "Parallel.data=2", "Parallel.tensor=4", "Train.batch_size=16",
            "Train.seq_len=256", "Train.dtype='float32'"]


def parse_layout(text: str) -> tuple[int, int]:
    """``'3'`` -> (zero 3, accumulation 1); ``'1x4'`` -> (zero 1, 4 micro-steps)."""
    try:
        zero, _, accum = text.partition("x")
        return int(zero), int(accum or 1)
    except ValueError:
        raise ConfigError(f"--layouts entry {text!r} is not ZERO or ZEROxACCUM (e.g. 3x4)") \
            from None


def state_mib(config: Config) -> dict[str, float]:
    """Parameters and optimizer state one device holds (MiB), from their shardings."""
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import abstract_state

    model = ShardedModel(config.model, config.parallel, make_mesh(config.parallel))
    state = abstract_state(model, make_optimizer(config.train))

    def mib(tree):
        return sum(s.dtype.itemsize * math.prod(s.sharding.shard_shape(s.shape))
                   for s in jax.tree.leaves(tree)) / 2**20
    return {"params_mib": mib(state["params"]), "opt_mib": mib(state["opt_state"])}


def bench_layout(config: Config, zero: int, accum: int, steps: int) -> dict:
    parallel = dataclasses.replace(config.parallel, zero=zero, grad_accum=accum)
    train = dataclasses.replace(config.train, micro_batch_size=None)  # (it would set accum)
    config = Config(config.model, parallel, train, config.data)
    rep = measure(config, steps)
    data = rep["per_axis"].get("data", {"count": 0, "wire_bytes": 0.0})
    return {"zero": zero, "grad_accum": accum, **state_mib(config),
            "temp_mib": rep["memory"].get("temp_size_in_bytes", 0) / 2**20,
            "data_collectives": data["count"], "data_wire_mib": data["wire_bytes"] / 2**20,
            "in_loop": in_loop_share(rep),
            "median_step_s": rep["median_step_s"], "check": rep["check"]}


def in_loop_share(rep: dict) -> float:
    """The share of the step's data-axis bytes moved by collectives inside a loop (per layer,
    where a GPU can overlap them with compute) rather than once per step."""
    rows = [r for r in rep["collectives"] if r["axes"] == "data"]
    moved = [r["bytes"] * r["runs"] * r["instances"] for r in rows]
    looped = sum(m for r, m in zip(rows, moved) if r["runs"] > 1)
    return looped / sum(moved) if moved else 0.0


COLUMNS = [("zero", ">4", "zero"), ("accum", ">6", "grad_accum"),
           ("params MiB", ">12.1f", "params_mib"), ("opt MiB", ">9.1f", "opt_mib"),
           ("temp MiB", ">10.0f", "temp_mib"), ("data colls", ">12", "data_collectives"),
           ("data wire MiB", ">15.2f", "data_wire_mib"), ("in loop", ">9.0%", "in_loop"),
           ("step s", ">9.3f", "median_step_s"),
           ("check", ">7", lambda r: "OK" if not r["check"] else "MISMATCH")]


def format_table(rows: list[dict]) -> str:
    return "\n".join(format_rows(rows, COLUMNS))


def _run(config: Config) -> int:
    rows = []
    for zero, accum in map(parse_layout, FLAGS.layouts):
        rows.append(bench_layout(config, zero, accum, FLAGS.steps))
        gc.collect()
    print(json.dumps(rows, indent=1) if FLAGS.json else format_table(rows))
    return 0


def main(argv) -> int:
    return run_benchmark("zero", argv, DEFAULTS, _run)
