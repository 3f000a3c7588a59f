"""Compile, inspect and time one configuration's train step (shared by the benchmarks), and
the benchmark rows: the explicit plans and their GSPMD baselines."""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import flags

from boost_jax.cli import run_command
from boost_jax.config import Config, ConfigError

#: benchmark row -> (tensor-parallel plan, GSPMD baseline?). A GSPMD row is plain ``jax.jit``
#: with the plan's parameter shardings and nothing else: GSPMD chooses every collective.
ROWS = {"fullrank": ("fullrank", False), "vanilla": ("vanilla", False), "btp": ("btp", False),
        "gspmd-megatron": ("fullrank", True), "gspmd-vanilla": ("vanilla", True),
        "gspmd-btp": ("btp", True)}


def row_config(config: Config, row: str) -> tuple[Config, bool]:
    """``(config, gspmd)`` of one benchmark row: the dense model for the Megatron rows, the
    configured low-rank arch (CoLA if dense is configured) for the others."""
    if row not in ROWS:
        raise ConfigError(f"unknown benchmark row {row!r}; choose from {', '.join(ROWS)}")
    plan, gspmd = ROWS[row]
    low = config.model.arch if config.model.arch != "dense" else "cola"
    model = dataclasses.replace(config.model, arch="dense" if plan == "fullrank" else low)
    return Config(model, dataclasses.replace(config.parallel, tp_plan=plan), config.train,
                  config.data), gspmd


def random_batch(rng, vocab: int, batch: int, seq_len: int, packed: bool = False) -> dict:
    """Random int32 ``[batch, seq_len]`` tokens; ``packed``: rows of random-length documents
    (a quarter row on average) and some padding, with their segment ids and positions."""
    import numpy as np

    out = {k: rng.integers(0, vocab, (batch, seq_len), dtype=np.int32)
           for k in ("inputs", "targets")}
    if packed:
        ids = np.zeros((batch, seq_len), np.int32)
        positions = np.zeros((batch, seq_len), np.int32)
        for r in range(batch):
            at, seg = 0, 1
            while at < seq_len * 0.9:
                n = min(int(rng.integers(1, seq_len // 2 + 1)), seq_len - at)
                ids[r, at:at + n], positions[r, at:at + n] = seg, np.arange(n)
                at, seg = at + n, seg + 1
        out.update(segment_ids=ids, positions=positions)
    return out


def measure(config: Config, steps: int, gspmd: bool = False) -> dict:
    """The communication report of ``config``'s compiled train step plus its median time over
    ``steps`` steps on random tokens (after one warm-up step); ``gspmd``: the GSPMD baseline
    with the plan's parameter shardings. Also ``compile_s`` (the step's trace and compile),
    ``first_step_s`` (the warm-up step: on a GPU, autotuning and module load) and, where the
    device's allocator reports it (a GPU's), ``peak_bytes``: the most device memory in use at
    once, parameters, optimizer state and batch included, over the process so far."""
    import jax
    import numpy as np

    from boost_jax.compiled.step_report import build_report, compile_step
    from boost_jax.train.step import init_state, stop_flags

    t = config.train
    start = time.perf_counter()
    model, opt, compiled = compile_step(config, gspmd=gspmd)
    compile_s = time.perf_counter() - start
    rep = build_report(config, compiled=compiled, mesh=model.mesh, gspmd=gspmd)
    state, stop = init_state(model, opt, t.seed), stop_flags(model)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps + 1):
        batch = random_batch(rng, config.model.vocab_size, t.batch_size, t.seq_len,
                             config.data.packed)
        batch = {k: jax.device_put(v, model.batch_sharding) for k, v in batch.items()}
        start = time.perf_counter()
        state, metrics = compiled(state, batch, stop)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    rep["compile_s"], rep["first_step_s"] = compile_s, times.pop(0)
    rep["median_step_s"] = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    rep["peak_bytes"] = stats.get("peak_bytes_in_use")
    rep["tokens_per_s"] = t.batch_size * t.seq_len / rep["median_step_s"]
    return rep


def format_rows(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """A benchmark table: ``columns`` are ``(header, format spec, row key or callable)``, e.g.
    ``("temp MiB", ">10.0f", "temp_mib")``; a spec starting with ``<`` aligns left."""
    def width(spec):
        return int("".join(c for c in spec.split(".")[0] if c.isdigit()))

    head = "".join(f"{h:{'<' if spec[0] == '<' else '>'}{width(spec)}}" for h, spec, _ in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append("".join(f"{(key(r) if callable(key) else r[key]):{spec}}"
                             for _, spec, key in columns))
    return lines


def ratio_line(a: dict, b: dict, name_a: str, name_b: str, tp_bytes: str) -> str:
    """``a / b: step time xT, temp memory xM, TP bytes xB`` for two benchmark rows (below 1:
    ``a`` is faster / smaller)."""
    def x(key):
        return a[key] / b[key] if b[key] else float("nan")
    return (f"{name_a} / {name_b}: step time x{x('median_step_s'):.2f}, temp memory "
            f"x{x('temp_mib'):.3f}, TP bytes x{x(tp_bytes):.2f}")


def run_benchmark(name: str, argv: list[str], defaults: list[str], body,
                  simulated: bool = True) -> int:
    """Run ``body(config)`` as ``python -m boost_jax.bench <name>``: the benchmark's default gin
    bindings go first, so the user's ``--gin_param`` override them; ``simulated``:
    :func:`boost_jax.cli.setup_devices`'."""
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    flags.FLAGS.gin_param = defaults + list(flags.FLAGS.gin_param)
    return run_command(f"bench {name}", body, simulated)
