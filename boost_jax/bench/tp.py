"""``python -m boost_jax.bench tp``: full-rank Megatron TP, vanilla low-rank TP and BTP side by
side on a 7B-shaped model (d=4096, d_ff=11008, r=1024, 32 heads, vocab 32000) with a few
layers, on whatever devices exist (simulated CPU devices on a host without an accelerator).

For each plan it compiles the real train step (AdamW included), reads its collectives from the
compiled HLO, and times it on random tokens: TP bytes per layer per step (forward + backward),
tensor-axis collectives per step, analytic model FLOPs, compiled temporary memory, median step
time and tokens/s. Rows: the explicit plans and their GSPMD baselines (``gspmd-megatron``,
``gspmd-vanilla``, ``gspmd-btp``: plain ``jax.jit`` with the plan's parameter shardings only).
Gin flags apply to every row (e.g. ``--gin_param=Model.n_layers=4``); ``--plans`` picks a
subset. Defaults: 2 layers, batch 4 x seq 128, fp32, mesh data=2 x
tensor=4 (8 devices); the dense model with AdamW then needs about 20 GB of host memory --
``--gin_param=Parallel.data=1`` halves that.
"""

from __future__ import annotations

import gc
import json

from absl import flags

from boost_jax.bench.measure import format_rows, measure, ratio_line, row_config, run_benchmark
from boost_jax.config import Config

FLAGS = flags.FLAGS

DEFAULTS = ["Model.size='7b'", "Model.n_layers=2", "Parallel.data=2", "Parallel.tensor=4",
            "Train.batch_size=4", "Train.seq_len=128", "Train.dtype='float32'"]


def bench_plan(config: Config, steps: int, row: str | None = None, gspmd: bool = False
               ) -> dict:
    """One row of the table: compile, measure communication, time ``steps`` train steps."""
    from boost_jax.analysis.flops import train_flops_per_token

    rep = measure(config, steps, gspmd=gspmd)
    t, m = config.train, rep["measured"]
    return {"plan": row or config.parallel.tp_plan, "arch": config.model.arch,
            "tp_bytes_per_layer": (m["layer_fwd_bytes"] + m["layer_bwd_bytes"])
            * rep["config"]["tokens_per_tp_group"],
            "tp_collectives_per_step": rep["per_axis"].get("tensor", {"count": 0})["count"],
            "model_tflop_per_step": train_flops_per_token(config.model, t.seq_len)
            * t.batch_size * t.seq_len / 1e12,
            "temp_mib": rep["memory"].get("temp_size_in_bytes", 0) / 2**20,
            "median_step_s": rep["median_step_s"], "tokens_per_s": rep["tokens_per_s"],
            "check": rep["check"]}


COLUMNS = [("plan", "<16", "plan"), ("arch", "<7", "arch"),
           ("TP MiB/layer", ">13.1f", lambda r: r["tp_bytes_per_layer"] / 2**20),
           ("TP colls", ">10", "tp_collectives_per_step"),
           ("TFLOP/step", ">12.3f", "model_tflop_per_step"), ("temp MiB", ">11.0f", "temp_mib"),
           ("step s", ">9.3f", "median_step_s"), ("tok/s", ">9.0f", "tokens_per_s")]


def format_table(rows: list[dict]) -> str:
    lines = format_rows(rows, COLUMNS)
    by = {r["plan"]: r for r in rows}
    for a, b in (("btp", "gspmd-btp"), ("vanilla", "gspmd-vanilla"),
                 ("fullrank", "gspmd-megatron"), ("btp", "vanilla"), ("btp", "fullrank")):
        if a in by and b in by:
            lines.append(ratio_line(by[a], by[b], a, b, "tp_bytes_per_layer"))
    return "\n".join(lines)


def _run(config: Config) -> int:
    rows = []
    for row, (variant, gspmd) in [(r, row_config(config, r)) for r in FLAGS.plans]:
        rows.append(bench_plan(variant, FLAGS.steps, row, gspmd))
        gc.collect()  # one plan's parameters and optimizer state at a time

    print(json.dumps(rows, indent=1) if FLAGS.json else format_table(rows))
    return 0


def main(argv) -> int:
    return run_benchmark("tp", argv, DEFAULTS, _run)
