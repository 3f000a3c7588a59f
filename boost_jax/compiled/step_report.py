"""A configured train step compiled for abstract inputs (:func:`compile_step`) and what it
sends (:func:`build_report`): every collective of the compiled HLO (op, dtype, per-device
shape, bytes, mesh axes of its replica groups, runs per step with loop trip counts applied,
forward or backward, and where: ``layer``, ``step`` for the model's boundary, ``optimizer``
for the update's gradient reduction, norm and parameter gathers), totals per mesh axis,
tensor-axis traffic per layer per token and every axis's traffic per step against the
formulas of analysis/comm.py, and the compiler's memory and cost analyses
(``python -m boost_jax.tools.comm_report`` prints it)."""

from __future__ import annotations

import collections
import dataclasses
import math

from boost_jax import compat
from boost_jax.config import Config

GIB = 2**30


def _where(c, run: dict) -> str:
    """``layer`` (in the layer loop), ``step`` (the model's other collectives: they run inside
    value_and_grad, "jvp") or ``optimizer`` (gradient reduction, norm, parameter gathers)."""
    from boost_jax.analysis.comm import in_layer_loop, pipelined_share

    if "jvp(" not in c.op_name:
        return "optimizer"
    return ("layer" if in_layer_loop(c, run, first=True) or pipelined_share(c, run)
            else "step")


def compile_step(config: Config, devices=None, gspmd: bool = False,
                 compiler_options: dict[str, str] | None = None):
    """``(sharded model, optimizer, compiled train step)`` for ``config`` (abstract inputs), on
    ``devices`` (default: all, which must match the mesh); ``gspmd``: the GSPMD baseline;
    ``compiler_options``: XLA options for this compile."""
    import jax.numpy as jnp

    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import compile_train_step

    t = config.train
    model = ShardedModel(config.model, config.parallel, make_mesh(config.parallel, devices),
                         jnp.dtype(t.dtype), gspmd=gspmd, max_segments=config.data.segment_bound)
    opt = make_optimizer(t, model)  # as the trainer builds them (train/loop.py)
    packed = config.data.packed
    return model, opt, compile_train_step(model, opt, t.batch_size, t.seq_len, packed,
                                          compiler_options, t.loss_group_rows)


def build_report(config: Config, dump_hlo: str | None = None, compiled=None, mesh=None,
                 devices=None, gspmd: bool = False) -> dict:
    """Collect the report's numbers (a JSON-able dict) for the configured train step, compiling
    it (on ``devices``) unless ``compiled`` (with its ``mesh``) is given. ``gspmd``: the step
    is the GSPMD baseline (every collective counts; the formula is not expected to hold)."""
    from boost_jax.analysis.comm import measure, predict, schedule
    from boost_jax.analysis.hlo import collectives, totals

    m, par, t = config.model, config.parallel, config.train
    if compiled is None:
        model, _, compiled = compile_step(config, devices, gspmd)
        mesh = model.mesh
    hlo = compiled.as_text()
    if dump_hlo:
        with open(dump_hlo, "w") as f:
            f.write(hlo)
    colls = collectives(hlo, tuple(mesh.devices.shape), tuple(mesh.axis_names))
    measured = measure(colls, m, par, t.batch_size, t.seq_len)
    predicted = predict(m, par, t.batch_size, t.seq_len, t.dtype,
                        config.data.packed)
    run = schedule(m, par, t.batch_size, t.seq_len)
    rows = collections.Counter(
        (c.op, c.dtype, c.shape, c.bytes, ",".join(c.axes), c.count,
         "bwd" if c.backward else "fwd", _where(c, run)) for c in colls)
    mem = compiled.memory_analysis()
    cost = compat.cost_analysis(compiled)
    tokens = t.batch_size // par.data * t.seq_len
    return {
        "config": {"arch": m.arch, "size": m.size, "d_model": m.d_model, "n_layers": m.n_layers,
                   "attn_rank": m.attn_rank, "mlp_rank": m.mlp_rank, "tp_plan": par.tp_plan,
                   "rmsnorm": par.rmsnorm, "grouping": par.grouping,
                   "norm_payload": par.norm_payload, "mesh": dict(mesh.shape),
                   "batch_size": t.batch_size, "seq_len": t.seq_len, "dtype": t.dtype,
                   "tokens_per_tp_group": tokens},
        "collectives": [dict(op=op, dtype=dt, shape=list(shape), bytes=b, axes=axes, runs=runs,
                             direction=way, where=where, instances=n)
                        for (op, dt, shape, b, axes, runs, way, where), n in rows.items()],
        "per_axis": {",".join(k): v for k, v in totals(colls).items()},
        "measured": dataclasses.asdict(measured),
        "predicted": dataclasses.asdict(predicted),
        "per_layer_forward_gib": measured.layer_fwd_bytes * tokens / GIB,
        "memory": {k: getattr(mem, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                "alias_size_in_bytes", "temp_size_in_bytes",
                                                "generated_code_size_in_bytes")
                   if hasattr(mem, k)},
        "cost": {k: cost[k] for k in ("flops", "bytes accessed") if k in cost},
        "check": check(measured, predicted),
    }


def check(measured, predicted) -> list[str]:
    """The quantities where measurement and formula differ (empty: they agree)."""
    m, p = dataclasses.asdict(measured), dataclasses.asdict(predicted)
    layer = ("layer_fwd", "layer_bwd", "layer_fwd_bytes", "layer_bwd_bytes") if m["looped"] else ()
    pairs = [(k, m[k], p[k]) for k in ("looped", *layer)]
    pairs += [(f"per step on {axes}", m["steps"].get(axes, 0.0), p["steps"].get(axes, 0.0))
              for axes in sorted(set(m["steps"]) | set(p["steps"]))]
    return [f"{name}: measured {a:g}, formula {b:g}" for name, a, b in pairs
            if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)]


def format_report(rep: dict) -> str:
    c = rep["config"]
    lines = [f"comm_report: {c['arch']}/{c['size']} (d={c['d_model']}, {c['n_layers']} layers, "
             f"r={c['attn_rank']}/{c['mlp_rank']}), tp_plan={c['tp_plan']} rmsnorm={c['rmsnorm']}"
             f" grouping={c['grouping']}, mesh {c['mesh']}, batch {c['batch_size']} x seq "
             f"{c['seq_len']}, {c['dtype']}", "",
             "collectives (per device; runs = per step, loop trip counts applied)",
             f"  {'op':<19}{'axes':<13}{'dtype':<6}{'shape':<22}{'bytes':>13}{'runs':>6}"
             f"{'n':>4}  dir  where"]
    for r in sorted(rep["collectives"], key=lambda r: (r["where"], r["axes"], r["direction"],
                                                         -r["bytes"])):
        shape = "[" + ",".join(map(str, r["shape"])) + "]"
        lines.append(f"  {r['op']:<19}{r['axes']:<13}{r['dtype']:<6}{shape:<22}{r['bytes']:>13,}"
                     f"{r['runs']:>6}{r['instances']:>4}  {r['direction']}  {r['where']}")
    lines += ["", "totals per mesh axis per step (wire: bytes each device sends, ring)"]
    for axes, v in sorted(rep["per_axis"].items()):
        lines.append(f"  {axes:<18}{v['count']:>6} collectives {v['elements']:>16,} elements "
                     f"{v['bytes']:>16,} bytes {v['wire_bytes']:>16,.0f} wire")
    m, p = rep["measured"], rep["predicted"]
    lines += ["", "tensor axis                          measured      formula",
              f"  per layer per token, forward  {m['layer_fwd']:>12,.1f} {p['layer_fwd']:>12,.1f}"
              " elements",
              f"  per layer per token, backward {m['layer_bwd']:>12,.1f} {p['layer_bwd']:>12,.1f}"
              " elements",
              f"  per layer per token, forward  {m['layer_fwd_bytes']:>12,.1f} "
              f"{p['layer_fwd_bytes']:>12,.1f} bytes",
              f"  per layer per token, backward {m['layer_bwd_bytes']:>12,.1f} "
              f"{p['layer_bwd_bytes']:>12,.1f} bytes",
              f"  per-layer forward payload ({c['tokens_per_tp_group']} tokens): "
              f"{rep['per_layer_forward_gib']:.3f} GiB",
              "per step (the model's collectives)"] + [
              f"  {axes:<28}{m['steps'].get(axes, 0):>12,.0f} {p['steps'].get(axes, 0):>12,.0f}"
              " elements" for axes in sorted(set(m["steps"]) | set(p["steps"]))] + [
              "", "compiled memory (per device): " + ", ".join(
                  f"{k.removesuffix('_size_in_bytes')} {v / 2**20:,.1f} MiB"
                  for k, v in rep["memory"].items()),
              "cost analysis (per device, loop bodies counted once): " + ", ".join(
                  f"{k} {v:,.3g}" for k, v in rep["cost"].items()),
              "", "check: " + ("OK" if not rep["check"] else "MISMATCH -- " +
                               "; ".join(rep["check"]))]
    return "\n".join(lines)
