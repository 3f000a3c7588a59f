"""A configured train step compiled by XLA's GPU compiler for a cluster of GPUs, on a host
without one (:func:`compile_for_gpu`), and what that program holds (:func:`gpu_report`:
per-device memory against the GPU's, every collective with its overlap, the traffic against
the formula, custom calls and fusions, what each loop keeps, XLA's exposed-collective
estimate beside the performance model's); ``python -m boost_jax.tools.gpu_compile`` prints it.
"""

from __future__ import annotations

import collections
import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from boost_jax.config import Config, ConfigError

GIB = 2**30


class GpuProgram(NamedTuple):
    """A train step compiled for GPUs without one: the sharded model (its mesh of mock GPUs),
    the compiled step, the target and XLA's latency-hiding schedule dump (text; "" if XLA
    wrote none)."""

    model: Any
    compiled: Any
    target: Any
    schedule: str


def compile_for_gpu(config: Config, target: str, topology: str) -> GpuProgram:
    """``config``'s train step compiled for ``target`` GPUs in ``topology``
    (``"HOSTSxGPUS"``) by XLA's deviceless GPU compile, with the XLA flags the launchers set on
    a GPU host (:func:`boost_jax.gpu_settings.compiler_options`), its latency-hiding schedule
    dumped to a temporary folder and read back. cuDNN attention is traced with jax's cuDNN
    checks stood in for (compat.cudnn_trace_standin: no cuDNN library here)."""
    from boost_jax import compat, gpu_settings
    from boost_jax.analysis import gpu_target
    from boost_jax.compiled.step_report import compile_step

    tgt = gpu_target.target_config(target)
    hosts, per_host = gpu_target.parse_topology(topology)
    if hosts * per_host != config.parallel.num_devices:
        d, p, t = config.parallel.shape
        raise ConfigError(f"--topology={topology} has {hosts * per_host} GPUs; the mesh "
                          f"Parallel.data x pipe x tensor = {d} x {p} x {t} needs "
                          f"{config.parallel.num_devices}")
    devices = gpu_target.gpu_devices(tgt, hosts, per_host)
    options = gpu_settings.typed_compiler_options(
        gpu_settings.compiler_options(), renamed=compat.xla_pipelining_options_renamed())
    with (compat.cudnn_trace_standin(), tempfile.TemporaryDirectory() as dump,
          warnings.catch_warnings()):
        # a persistent compilation cache holds the GPU executable, but a compiler without a
        # GPU client cannot load it back (jax 0.12: "PjRtCompiler must be constructed with a
        # Client"); jax then compiles again, as it must: that warning says nothing to act on
        warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
        options.update(xla_dump_to=dump, xla_dump_latency_hiding_schedule=True)
        model, _, compiled = compile_step(config, devices, compiler_options=options)
        # one module compiled: one schedule (the largest file, should XLA write another)
        dumps = sorted(Path(dump).glob("*.schedule.txt"), key=lambda f: f.stat().st_size)
        schedule = dumps[-1].read_text() if dumps else ""
    return GpuProgram(model, compiled, tgt, schedule)


def gpu_report(config: Config, target: str, topology: str, dump_hlo: str | None = None,
               compiled: tuple | None = None) -> dict:
    """comm_report's numbers for the GPU program, plus its memory, schedule and calls;
    ``compiled``: :func:`compile_for_gpu`'s result, if already compiled."""
    from boost_jax import gpu_settings
    from boost_jax.analysis import gpu_program
    from boost_jax.analysis.hlo import collectives
    from boost_jax.compiled.step_report import build_report

    model, compiled, tgt, schedule = compiled or compile_for_gpu(config, target, topology)
    rep = build_report(config, dump_hlo, compiled=compiled, mesh=model.mesh)
    hlo = compiled.as_text()
    sched = gpu_program.schedule(hlo)
    rows = collections.Counter()
    for c in collectives(hlo, tuple(model.mesh.devices.shape), tuple(model.mesh.axis_names)):
        s = sched.get(c.name)
        rows[(c.op, c.dtype, c.bytes, ",".join(c.axes), c.count, c.combined,
              bool(s and s.asynchronous), s.overlapped if s else 0)] += 1
    modelled = model_memory(config, model)
    rep["gpu"] = {
        "target": tgt.name, "device": tgt.device, "topology": topology,
        "xla_flags": gpu_settings.compiler_options(),
        "memory": gpu_program.memory(compiled, tgt.memory_bytes,
                                     int(modelled.get("cudnn_workspace", 0))),
        "memory_model": modelled,
        "collectives": [dict(op=op, dtype=dt, bytes=b, axes=axes, runs=runs, combined=comb,
                             asynchronous=a, overlapped=o, instances=n)
                        for (op, dt, b, axes, runs, comb, a, o), n in rows.items()],
        "custom_calls": gpu_program.custom_calls(hlo),
        "triton_kernels": [dict(kernel=k, target=a, calls=n) for (k, a), n in
                           sorted(gpu_program.triton_kernels(hlo).items())],
        "fusions": gpu_program.fusions(hlo),
        "loop_residuals": gpu_program.layer_loop_residuals(hlo, config.train.seq_len),
        "latency_hiding": gpu_program.latency_hiding_estimate(schedule) if schedule else None,
        "communication_model": model_communication(config, tgt.name, topology),
    }
    return rep


def model_communication(config: Config, target: str, topology: str) -> dict | None:
    """The performance model's communication seconds per step of ``config`` (analysis/
    perf_model.py ``predict``): ``tp`` (the tensor axis's collectives, on every layer's
    critical path), ``pp`` (the pipeline's sends and boundaries), ``dp`` (the data-parallel
    collectives left exposed), on the hardware profile of ``target``'s GPU
    (analysis/gpu_target.py ``GPU_TARGETS``) with ``topology``'s GPUs per host; ``None``
    where no profile has that GPU. Beside XLA's estimate of the exposed time: the model's
    exposed share (``pp + dp``) is the comparable term, since XLA's estimate counts only the
    asynchronous collectives the schedule leaves exposed."""
    from boost_jax.analysis import gpu_target
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.perf_model import predict

    profile = gpu_target.TARGET_PROFILES.get(target)
    if profile is None:
        return None
    _, per_host = gpu_target.parse_topology(topology)
    hw = dataclasses.replace(PROFILES[profile], gpus_per_node=per_host)
    t = config.train
    b = predict(config.model, config.parallel, t.batch_size, t.seq_len, hw, dtype=t.dtype).breakdown
    return {"profile": profile, "tp_s": b["tp"], "pp_s": b["pp"], "dp_s": b["dp"],
            "exposed_s": b["pp"] + b["dp"]}


def model_memory(config: Config, model) -> dict[str, float]:
    """The performance model's bytes per device of ``config``'s step (analysis/perf_model.py:
    ``model_state``, ``activations``, ``logits``, with cuDNN's attention ``cudnn_workspace``,
    ``total``), with the attention the compiled plan runs (cuDNN's keeps no ``seq x seq``
    scores)."""
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.perf_model import predict

    t = config.train
    flash = model.execution.attention_for(packed=config.data.packed) == "cudnn"
    # memory does not depend on the hardware profile (its times do)
    pred = predict(config.model, config.parallel, t.batch_size, t.seq_len,
                   PROFILES["h100_sxm"], dtype=t.dtype, flash_attention=flash)
    return {**pred.memory, "total": sum(pred.memory.values())}


def format_gpu_report(rep: dict) -> str:
    from boost_jax.compiled.step_report import format_report

    g = rep["gpu"]
    m = g["memory"]
    lines = [f"gpu_compile: {g['target']} ({g['device']}), {g['topology']} (hosts x GPUs), "
             "compiled by XLA's GPU compiler on this host (no GPU), with the launchers' XLA "
             "flags: " + " ".join(f"--{k}={v}" for k, v in g["xla_flags"].items()), "",
             "memory per device (MiB): " + ", ".join(
                 f"{k} {m[k] / 2**20:,.1f}" for k in ("argument", "output", "alias", "temp",
                                                     "generated_code", "total")),
             f"  of {m['capacity'] / GIB:,.2f} GiB: " + (
                 f"fits, {m['headroom'] / GIB:,.2f} GiB free" if m["fits"] else
                 f"does NOT fit, {-m['headroom'] / GIB:,.2f} GiB over") +
             (f" (with cuDNN's workspace, {m['unsized'] / 2**20:,.1f} MiB, which the compile "
              "sizes 0: the model's figure below)" if m["unsized"] else ""),
             "  the performance model's (analysis/perf_model.py): " + ", ".join(
                 f"{k} {v / 2**20:,.1f}" for k, v in g["memory_model"].items())
             + f" MiB; model / compiled {g['memory_model']['total'] / m['total']:.2f}", "",
             "collectives of the GPU program (per device; runs per step; overlapped = compute "
             "instructions scheduled between start and done)",
             f"  {'op':<19}{'axes':<13}{'dtype':<6}{'bytes':>13}{'runs':>6}{'n':>4}  "
             f"{'async':<6}{'overlapped':>10}"]
    for r in sorted(g["collectives"], key=lambda r: (r["axes"], r["op"], -r["bytes"])):
        lines.append(f"  {r['op']:<19}{r['axes']:<13}{r['dtype']:<6}{r['bytes']:>13,}"
                     f"{r['runs']:>6}{r['instances']:>4}  {'yes' if r['asynchronous'] else 'no':<6}"
                     f"{r['overlapped']:>10}")
    if g["loop_residuals"]:
        lines += ["", "what each loop keeps per iteration for the backward pass (its stacked "
                  "tensors with a sequence dimension: dtype[width per token] x count)"]
        lines += [f"  {r['loop']} ({r['trips']} iterations): " + ", ".join(
            f"{k} x{v}" for k, v in r["kept"].items()) + f"; {r['bytes_per_token']:,} B per "
            "token" for r in g["loop_residuals"]]
    lines += ["", f"fusions: {g['fusions']}; custom calls and fusion kinds: " + ", ".join(
        f"{k} x{v}" for k, v in sorted(g["custom_calls"].items()))]
    if g["triton_kernels"]:
        lines.append("jax-triton kernels (the PTX's target): " + ", ".join(
            f"{t['kernel']} ({t['target']}) x{t['calls']}" for t in g["triton_kernels"]))
    if (lhs := g["latency_hiding"]) is not None:
        kinds = collections.Counter()
        for r in lhs["computations"]:
            kinds.update({k: v * (r["runs"] or 0) for k, v in r["by_kind"].items()})
        lines.append(
            "exposed collective time per step, XLA's estimate (its latency-hiding scheduler's "
            "wasted time in its latency estimator's units, read as us; its default, "
            "approximate estimator costs an asynchronous collective about 5,000 whatever its "
            "size: a count of exposed collectives, not a time; synchronous collectives not "
            f"counted): {lhs['exposed_us']:,.1f}" + (" (" + ", ".join(
                f"{k} {v:,.1f}" for k, v in sorted(kinds.items())) + ")" if kinds else "")
            + ("" if lhs["complete"] else "; a loop's trip count unknown: not counted"))
    if (cm := g["communication_model"]) is not None:
        lines.append(
            f"communication per step, the performance model's ({cm['profile']}, seconds as "
            f"ms): tensor {cm['tp_s'] * 1e3:,.1f} (on every layer's critical path), pipeline "
            f"{cm['pp_s'] * 1e3:,.1f}, data-parallel exposed {cm['dp_s'] * 1e3:,.1f}")
        if lhs is not None:
            lines.append(
                "  XLA's estimate / the model's exposed time (pipeline + data): "
                + (f"{lhs['exposed_us'] / (cm['exposed_s'] * 1e6):,.2f}" if cm["exposed_s"]
                   else "- (the model leaves none exposed)")
                + ": not comparable as times (XLA's units count exposed asynchronous "
                "collectives; docs: Compiling for a GPU cluster without one)")
    lines += ["",
        "the same program's communication against the formula (comm_report):", "",
        format_report(rep)]
    return "\n".join(lines)
