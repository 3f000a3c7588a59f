"""Compile, inspect and time one configuration's train step (shared by the benchmarks)."""

from __future__ import annotations

import statistics
import time

from boost_jax.config import Config


def measure(config: Config, steps: int, gspmd: bool = False) -> dict:
    """The communication report of ``config``'s compiled train step plus its median time over
    ``steps`` steps on random tokens (after one warm-up step); ``gspmd``: the GSPMD baseline
    with the plan's parameter shardings."""
    import jax
    import numpy as np

    from boost_jax.tools.comm_report import build_report, compile_step
    from boost_jax.train.step import init_state

    t = config.train
    model, tx, compiled = compile_step(config, gspmd=gspmd)
    rep = build_report(config, compiled=compiled, mesh=model.mesh, gspmd=gspmd)
    state = init_state(model, tx, t.seed)
    rng = np.random.default_rng(0)
    times = []
    for i in range(steps + 1):
        batch = {k: jax.device_put(rng.integers(0, config.model.vocab_size,
                                                (t.batch_size, t.seq_len), dtype=np.int32),
                                   model.batch_sharding) for k in ("inputs", "targets")}
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i:
            times.append(time.perf_counter() - start)
    rep["median_step_s"] = statistics.median(times)
    rep["tokens_per_s"] = t.batch_size * t.seq_len / rep["median_step_s"]
    return rep
