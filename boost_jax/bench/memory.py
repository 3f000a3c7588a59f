"""``python -m boost_jax.bench memory``: memory per device at the paper's pipelined shapes, the
compiled train step's beside the performance model's.

Rows (``--memory_rows``): the BOOST layouts of the paper's ``13B TP4xPP2`` and ``30B TP4xPP4``
rows (analysis/paper.py: CoLA, ``btp`` online, their batch, microbatches and remat, seq 4096,
bf16), each as published (``data=1``) and with FSDP over ``data=2`` (the batch doubled: the same
rows per data shard), i.e. 8 to 32 devices. Each train step is compiled for abstract inputs on
simulated CPU devices -- nothing is allocated -- and its peak per device (arguments + outputs
- aliased + temporaries, as ``plan --verify`` reads it) is printed beside the performance
model's prediction (``perf_model.predict`` with XLA's non-flash attention, which is what the CPU
program runs) and the model's flash-attention figure (what a GPU run would hold).

The compiled figure is XLA:CPU's program, not a GPU's: the CPU keeps ``seq x seq`` attention
scores and computes bf16 dots through fp32 copies.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags

from boost_jax.bench.measure import format_rows, run_benchmark
from boost_jax.cli import user_error
from boost_jax.config import Config, ConfigError, Data, Train

FLAGS = flags.FLAGS

#: (paper row, data, zero): each pipelined paper row as published and with FSDP over data=2
ROWS = {"13b": ("13B TP4xPP2", 1, 0), "13b_fsdp": ("13B TP4xPP2", 2, 3),
        "30b": ("30B TP4xPP4", 1, 0), "30b_fsdp": ("30B TP4xPP4", 2, 3)}
SEQ_LEN = 4096  # the paper's sequence length (analysis/paper.py)
GIB = 2**30


def row_config(name: str, dtype: str = "bfloat16") -> Config:
    """The config of one row of :data:`ROWS`."""
    from boost_jax.analysis.paper import WEAK_SCALING, configs

    if name not in ROWS:
        raise ConfigError(f"unknown memory row {name!r} (one of {', '.join(ROWS)})")
    paper, data, zero = ROWS[name]
    row = next(r for r in WEAK_SCALING if r.name == paper)
    model, parallel = configs(row, "boost")
    parallel = dataclasses.replace(parallel, data=data, zero=zero)
    return Config(model, parallel, Train(batch_size=row.batch * data, seq_len=SEQ_LEN,
                                         dtype=dtype), Data())


def measure_row(config: Config, devices) -> dict:
    """Compiled and predicted memory per device (GiB) of ``config``'s train step."""
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.perf_model import predict
    from boost_jax.analysis.plan_verify import compiled_memory
    from boost_jax.tools.comm_report import compile_step

    m, par, t = config.model, config.parallel, config.train
    _, _, compiled = compile_step(config, devices[:par.num_devices])
    hw = PROFILES["h200"]  # memory does not depend on the profile

    def model_gib(flash: bool) -> float:
        pred = predict(m, par, t.batch_size, t.seq_len, hw, dtype=t.dtype,
                       flash_attention=flash)
        return sum(pred.memory.values()) / GIB

    stats = compiled.memory_analysis()
    return {"layout": f"{m.size} data={par.data} pipe={par.pipe} tensor={par.tensor} "
                      f"zero={par.zero} micro={par.microbatches} remat={par.remat}",
            "devices": par.num_devices, "compiled_gib": compiled_memory(compiled) / GIB,
            "temp_gib": stats.temp_size_in_bytes / GIB, "model_gib": model_gib(False),
            "model_flash_gib": model_gib(True)}


COLUMNS = [("layout", "<56", "layout"), ("devices", ">8", "devices"),
           ("compiled GiB", ">13.1f", "compiled_gib"), ("temp GiB", ">10.1f", "temp_gib"),
           ("model GiB", ">11.1f", "model_gib"),
           ("model/compiled", ">15.2f", lambda r: r["model_gib"] / r["compiled_gib"]),
           ("model flash GiB", ">16.1f", "model_flash_gib")]


def _run(config: Config) -> int:
    import jax

    devices = jax.devices()
    rows = []
    for name in FLAGS.memory_rows:
        row = row_config(name, config.train.dtype)
        if row.parallel.num_devices > len(devices):
            raise ConfigError(f"memory row {name!r} needs {row.parallel.num_devices} devices, "
                              f"{len(devices)} are visible")
        rows.append(measure_row(row, devices))
    print(json.dumps(rows, indent=1) if FLAGS.json else "\n".join(format_rows(rows, COLUMNS)))
    return 0


def main(argv) -> int:
    # the configured mesh is only how many devices to simulate: the rows bring their layouts
    try:
        n = max(row_config(name).parallel.num_devices for name in FLAGS.memory_rows)
    except ConfigError as err:
        return user_error("bench memory", err)
    mesh = [f"Parallel.data={n}", "Parallel.tensor=1", "Parallel.pipe=1",
            "Parallel.tp_plan='none'", f"Train.batch_size={n}", "Train.dtype='bfloat16'"]
    return run_benchmark("memory", argv, mesh, _run)
