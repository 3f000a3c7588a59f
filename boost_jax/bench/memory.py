"""``python -m boost_jax.bench memory``: memory per device at the paper's shapes, the compiled
train step's beside the performance model's.

Rows (``--memory_rows``, :data:`ROWS`): the paper's layouts (analysis/paper.py: their batch,
microbatches, accumulation and remat, seq 4096, bf16), each as published (``data=1``), the
pipelined ones also with FSDP over ``data=2`` (the batch doubled: the same rows per data
shard).

* Without ``--target`` (rows :data:`CPU_ROWS`: 13B and 30B, BOOST's layout): each train step is
  compiled for abstract inputs on simulated CPU devices -- nothing is allocated -- and its peak
  per device (arguments + outputs - aliased + temporaries, as ``plan --verify`` reads it) is
  printed beside the performance model's prediction (with XLA's non-flash attention, which is
  what the CPU program runs) and the model's flash-attention figure. The compiled figure is
  XLA:CPU's program, not a GPU's: the CPU keeps ``seq x seq`` attention scores and computes
  bf16 dots through fp32 copies.
* With ``--target=a100_sxm_80`` (or ``h100_sxm``, ``h200``; rows :data:`GPU_ROWS`, the paper's
  five, for each of ``--methods``): each step is compiled by XLA's GPU compiler for that GPU,
  on the target's nodes (the A100s 4 per node, as the paper's), with cuDNN attention
  (commands/gpu_compile.py: no GPU needed, the ``gpu_compile`` extra), and its peak per device is
  printed beside the performance model's (with flash attention), the GPU's memory and whether
  it fits. cuDNN's workspace is not in the compiled figure (the model's counts it).
  ``--memory_layers=N`` compiles each row at ``N`` decoder layers (the same widths): the
  programs the memory model's constants were read from (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags

from boost_jax.analysis.gpu_target import TARGET_PROFILES  # --target -> its profile (GPUs per node)
from boost_jax.bench.measure import format_rows, run_benchmark
from boost_jax.cli import user_error
from boost_jax.config import Config, ConfigError, Data, Train

FLAGS = flags.FLAGS

#: (paper row, data, zero): each paper row as published, the pipelined ones also with FSDP
#: over data=2
ROWS = {"1b": ("1B TP1", 1, 0), "3b": ("3B TP2", 1, 0), "7b": ("7B TP4", 1, 0),
        "13b": ("13B TP4xPP2", 1, 0), "13b_fsdp": ("13B TP4xPP2", 2, 3),
        "30b": ("30B TP4xPP4", 1, 0), "30b_fsdp": ("30B TP4xPP4", 2, 3)}
#: the rows each kind of compile runs by default (``--memory_rows`` empty): simulated CPU
#: devices the pipelined ones (the paper's largest), a GPU target the paper's five
CPU_ROWS = ("13b", "13b_fsdp", "30b", "30b_fsdp")
GPU_ROWS = ("1b", "3b", "7b", "13b", "30b")
SEQ_LEN = 4096  # the paper's sequence length (analysis/paper.py)
GIB = 2**30


def row_config(name: str, dtype: str = "bfloat16", method: str = "boost",
               attention: str = "auto", microbatches: int | None = None,
               layers: int | None = None) -> Config:
    """The config of one row of :data:`ROWS` for ``method`` (analysis/paper.py ``METHODS``),
    with ``Parallel.attention=attention``; a pipelined row with ``microbatches`` pipeline
    microbatches instead of the paper's, when given; ``layers`` decoder layers instead of the
    model's, when given (the same widths at reduced depth)."""
    from boost_jax.analysis.paper import METHODS, WEAK_SCALING, configs

    if name not in ROWS:
        raise ConfigError(f"unknown memory row {name!r} (one of {', '.join(ROWS)})")
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
    paper, data, zero = ROWS[name]
    row = next(r for r in WEAK_SCALING if r.name == paper)
    model, parallel = configs(row, method)
    parallel = dataclasses.replace(parallel, data=data, zero=zero, attention=attention)
    if microbatches and parallel.pipe > 1:
        parallel = dataclasses.replace(parallel, microbatches=microbatches)
    if layers:
        model = dataclasses.replace(model, n_layers=layers)
    return Config(model, parallel, Train(batch_size=row.batch * data, seq_len=SEQ_LEN,
                                         dtype=dtype), Data())


def measure_row(config: Config, devices) -> dict:
    """Compiled and predicted memory per device (GiB) of ``config``'s train step."""
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.perf_model import predict
    from boost_jax.compiled.plan_verify import compiled_memory
    from boost_jax.compiled.step_report import compile_step

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


def topology(config: Config, target: str) -> str:
    """``HOSTSxGPUS`` of ``config``'s mesh on ``target``'s nodes (:data:`TARGET_PROFILES`)."""
    from boost_jax.analysis import gpu_target
    from boost_jax.analysis.hardware import PROFILES

    if target not in TARGET_PROFILES:
        raise ConfigError(f"--target={target!r}: bench memory compiles for "
                          f"{', '.join(TARGET_PROFILES)}")
    return gpu_target.topology(config.parallel.num_devices,
                               PROFILES[TARGET_PROFILES[target]].gpus_per_node)


def measure_gpu_row(config: Config, target: str) -> dict:
    """Per-device memory (GiB) of ``config``'s train step compiled by XLA's GPU compiler for
    ``target`` GPUs (commands/gpu_compile.py, no GPU needed), beside the performance model's and
    the GPU's capacity."""
    from boost_jax.analysis import gpu_program
    from boost_jax.analysis.perf_model import memory
    from boost_jax.compiled.gpu_report import compile_for_gpu, model_memory

    m, par, t = config.model, config.parallel, config.train
    topo = topology(config, target)
    built = compile_for_gpu(config, target, topo)
    model = model_memory(config, built.model)
    mem = gpu_program.memory(built.compiled, built.target.memory_bytes,
                             int(model.get("cudnn_workspace", 0)))
    schedule = (f"{par.pipeline_schedule}:{par.repeats}" if par.repeats > 1
                else par.pipeline_schedule if par.pipe > 1 else "-")
    stages, iterations = par.pipe, par.repeats * par.microbatches + par.pipe - 1
    # 1F1B (not interleaved): each stage runs all its layers per microbatch, as GPipe does
    gpipe = dataclasses.replace(par, pipeline_schedule="gpipe", pipeline_repeats=1)
    one_f_one_b = memory(m, gpipe, t.batch_size, t.seq_len, t.dtype,
                         in_flight=min(par.microbatches, stages) if stages > 1 else None)
    full_depth = type(m)(arch=m.arch, size=m.size).n_layers
    size = m.size if m.n_layers == full_depth else f"{m.size}/{m.n_layers}L"
    return {"layout": f"{size} {m.arch} {par.tp_plan} data={par.data} pipe={par.pipe} "
                      f"tensor={par.tensor} zero={par.zero} micro={par.microbatches} "
                      f"accum={par.grad_accum} remat={par.remat}",
            "topology": topo, "compiled_gib": mem["total"] / GIB, "temp_gib": mem["temp"] / GIB,
            "model_gib": model["total"] / GIB, "capacity_gib": mem["capacity"] / GIB,
            "fits": mem["fits"], "model": {k: v / GIB for k, v in model.items()},
            "schedule": schedule, "bubble": (stages - 1) / iterations,
            "model_1f1b_gib": sum(one_f_one_b.values()) / GIB}


GPU_COLUMNS = [("layout", "<74", "layout"), ("hosts x GPUs", ">13", "topology"),
               ("compiled GiB", ">13.1f", "compiled_gib"), ("temp GiB", ">10.1f", "temp_gib"),
               ("model GiB", ">11.1f", "model_gib"),
               ("model/compiled", ">15.2f", lambda r: r["model_gib"] / r["compiled_gib"]),
               ("of GiB", ">8.1f", "capacity_gib"),
               ("fits", ">6", lambda r: "yes" if r["fits"] else "NO")]
#: ``--schedules``: the pipeline schedule, its bubble (idle share of the iterations) and what
#: the model says 1F1B would hold at the same microbatches (analysis/perf_model.py ``memory``)
SCHEDULE_COLUMNS = [GPU_COLUMNS[0], ("schedule", ">11", "schedule"),
                    ("bubble", ">7.2f", "bubble"), *GPU_COLUMNS[2:5],
                    ("1F1B model GiB", ">15.1f", "model_1f1b_gib"), *GPU_COLUMNS[6:]]


def gpu_configs(rows: list[str], methods: list[str], dtype: str = "bfloat16",
                microbatches: list[int | None] = (None,), schedules: list[str] = ("",),
                layers: int | None = None) -> tuple[list[Config], list[str]]:
    """The configs of ``rows`` x ``methods`` x ``microbatches`` x ``schedules``
    (:func:`row_config`, cuDNN attention: what the paper's GPU runs use, no seq x seq scores),
    in that order, and why each combination ``Config`` rejects was left out. A config two
    methods share (at TP=1 ``vanilla`` and ``btp`` are both the unsharded low-rank model, plan
    ``none``) comes once. A schedule (pipelined rows only): ``gpipe`` or ``circular:R`` (``R``
    repeats); ``""`` the row's own. ``layers``: each row at that depth (:func:`row_config`)."""
    configs, skipped = [], []
    for name in rows:
        for method in methods:
            for m in microbatches:
                for schedule in schedules:
                    try:
                        row = row_config(name, dtype, method, "cudnn", m, layers)
                    except ConfigError as err:
                        skipped.append(f"{name} {method} layers={layers}: {err}")
                        continue
                    if schedule and row.parallel.pipe > 1:  # parse_lists' spelling
                        kind, _, repeats = schedule.partition(":")
                        try:
                            row = dataclasses.replace(row, parallel=dataclasses.replace(
                                row.parallel, pipeline_schedule=kind,
                                pipeline_repeats=int(repeats or 1)))
                        except ConfigError as err:
                            skipped.append(f"{name} {method} micro={m} {schedule}: {err}")
                            continue
                    configs += [] if row in configs else [row]
    return configs, skipped


def parse_lists(microbatches: list[str], schedules: list[str]
                ) -> tuple[list[int | None], list[str]]:
    """``--memory_microbatches`` and ``--schedules`` checked (:class:`ConfigError` naming the
    bad value): positive integers; ``gpipe`` or ``circular:R`` with ``R`` a positive integer.
    Empty lists mean the rows' own (``[None]``, ``[""]``)."""
    def positive(text: str, flag: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"--{flag}: {text!r} is not a positive integer")
        return int(text)

    for schedule in schedules:
        kind, colon, repeats = schedule.partition(":")
        if kind not in ("gpipe", "circular") or (kind == "gpipe") == bool(colon):
            raise ConfigError(f"--schedules: {schedule!r} is not gpipe or circular:R")
        if colon:
            positive(repeats, "schedules")
    return ([positive(m, "memory_microbatches") for m in microbatches] or [None],
            list(schedules) or [""])


def _run_gpu(config: Config) -> int:
    """The paper rows (``--memory_rows``, default :data:`GPU_ROWS`) x ``--methods`` (x
    ``--memory_microbatches`` x ``--schedules``) compiled for ``--target``
    (:func:`gpu_configs`)."""
    micro, schedules = parse_lists(FLAGS.memory_microbatches, FLAGS.schedules)
    if FLAGS.memory_layers < 0:
        raise ConfigError(f"--memory_layers={FLAGS.memory_layers}: a positive number of "
                          "layers, or 0 for the model's")
    configs, skipped = gpu_configs(FLAGS.memory_rows or list(GPU_ROWS), FLAGS.methods,
                                   config.train.dtype, micro, schedules,
                                   FLAGS.memory_layers or None)
    rows = [measure_gpu_row(row, FLAGS.target) for row in configs]
    columns = SCHEDULE_COLUMNS if FLAGS.schedules else GPU_COLUMNS
    print(json.dumps(rows, indent=1) if FLAGS.json else "\n".join(format_rows(rows, columns)))
    for why in skipped:
        print(f"not compiled: {why}")
    return 0


def _run(config: Config) -> int:
    import jax

    devices = jax.devices()
    rows = []
    if FLAGS.memory_layers:
        raise ConfigError("--memory_layers: with --target only (the GPU compile)")
    for name in FLAGS.memory_rows or CPU_ROWS:
        micro, _ = parse_lists(FLAGS.memory_microbatches, [])
        if len(micro) > 1:
            raise ConfigError("--memory_microbatches: one value without --target")
        row = row_config(name, config.train.dtype, microbatches=micro[0])
        if row.parallel.num_devices > len(devices):
            raise ConfigError(f"memory row {name!r} needs {row.parallel.num_devices} devices, "
                              f"{len(devices)} are visible")
        rows.append(measure_row(row, devices))
    print(json.dumps(rows, indent=1) if FLAGS.json else "\n".join(format_rows(rows, COLUMNS)))
    return 0


def main(argv) -> int:
    if FLAGS.target:
        import jax

        # before any backend starts: the CUDA plugin compiles for mock GPUs (gpu_compile.py)
        jax.config.update("jax_platforms", "cpu")
        return run_benchmark("memory", argv, ["Train.dtype='bfloat16'"], _run_gpu,
                             simulated=False)
    # the configured mesh is only how many devices to simulate: the rows bring their layouts
    try:
        n = max(row_config(name).parallel.num_devices
                for name in FLAGS.memory_rows or CPU_ROWS)
    except ConfigError as err:
        return user_error("bench memory", err)
    mesh = [f"Parallel.data={n}", "Parallel.tensor=1", "Parallel.pipe=1",
            "Parallel.tp_plan='none'", f"Train.batch_size={n}", "Train.dtype='bfloat16'"]
    return run_benchmark("memory", argv, mesh, _run)
