"""``python -m boost_jax.bench remat``: the activation-checkpointing policies side by side.

For each policy (``--policies``, default none, full, lowrank, lowrank_attn) on the configured
model and plan (default: CoLA 60M with ``btp`` + online RMSNorm on data=2 x tensor=4, batch 8 x
seq 512, fp32): compiled temporary memory, the FLOPs the recomputation adds (analytic), tensor-
axis bytes per step (from the compiled HLO), median step time, and BOOST's efficiency figure:
memory saved per millisecond of added step time, relative to ``none``.
"""

from __future__ import annotations

import dataclasses
import gc
import json

from absl import flags

from boost_jax.bench.measure import measure, run_benchmark
from boost_jax.config import Config

FLAGS = flags.FLAGS

DEFAULTS = ["Model.size='60m'", "Parallel.data=2", "Parallel.tensor=4", "Train.batch_size=8",
            "Train.seq_len=512", "Train.dtype='float32'"]


def bench_policy(config: Config, remat: str, steps: int) -> dict:
    from boost_jax.analysis.flops import recompute_flops_per_token

    config = Config(config.model, dataclasses.replace(config.parallel, remat=remat),
                    config.train, config.data)
    rep = measure(config, steps)
    t, par = config.train, config.parallel
    tokens = t.batch_size * t.seq_len
    return {"remat": remat, "temp_mib": rep["memory"].get("temp_size_in_bytes", 0) / 2**20,
            "recompute_tflop_per_step": recompute_flops_per_token(
                config.model, t.seq_len, par.tp_plan, remat) * tokens / 1e12,
            "tp_bytes_per_step": rep["per_axis"].get("tensor", {"bytes": 0})["bytes"],
            "tp_collectives_per_step": rep["per_axis"].get("tensor", {"count": 0})["count"],
            "median_step_s": rep["median_step_s"], "check": rep["check"]}


def efficiency(row: dict, base: dict) -> float | None:
    """MB of memory saved per ms of added step time against ``base`` (None: no time added)."""
    saved = (base["temp_mib"] - row["temp_mib"]) * 2**20 / 1e6
    added = (row["median_step_s"] - base["median_step_s"]) * 1e3
    return saved / added if added > 0 else None


def format_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["remat"] == "none"), None)
    head = (f"{'remat':<14}{'temp MiB':>10}{'recompute TFLOP':>17}{'TP MiB/step':>13}"
            f"{'TP colls':>10}{'step s':>9}{'MB saved/ms':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if base is None or r is base:
            eff_s = "-"
        else:
            eff = efficiency(r, base)
            eff_s = "no time added" if eff is None else f"{eff:.1f}"
        lines.append(f"{r['remat']:<14}{r['temp_mib']:>10.0f}{r['recompute_tflop_per_step']:>17.3f}"
                     f"{r['tp_bytes_per_step'] / 2**20:>13.1f}{r['tp_collectives_per_step']:>10}"
                     f"{r['median_step_s']:>9.3f}{eff_s:>15}")
    by = {r["remat"]: r for r in rows}
    if base is not None and "lowrank" in by and "full" in by:
        lo, fu = efficiency(by["lowrank"], base), efficiency(by["full"], base)
        if lo is not None and fu is not None:
            lines.append(f"efficiency lowrank / full: x{lo / fu:.2f}")
    return "\n".join(lines)


def _run(config: Config) -> int:
    rows = []
    for remat in FLAGS.policies:
        rows.append(bench_policy(config, remat, FLAGS.steps))
        gc.collect()
    print(json.dumps(rows, indent=1) if FLAGS.json else format_table(rows))
    return 0


def main(argv) -> int:
    return run_benchmark("remat", argv, DEFAULTS, _run)
