"""``python -m boost_jax.bench step``: the three plans and their GSPMD baselines side by side
on the devices this host has (simulated CPU devices here, GPUs elsewhere).

Rows: ``fullrank`` (dense), ``vanilla`` and ``btp`` (the configured low-rank arch) as explicit
``shard_map`` plans, and ``gspmd-megatron`` / ``gspmd-vanilla`` / ``gspmd-btp``: plain
``jax.jit`` with the same parameter shardings and nothing else, GSPMD choosing every
collective (``--plans`` picks a subset). Each row: median step time over ``--steps`` steps,
tokens/s, MFU (analytic FLOPs; needs a known device peak or ``Train.peak_tflops``), compiled
temporary memory, tensor-axis collectives and bytes per step and per layer per token, read from
the compiled HLO.

Writes ``--out``/bench.json and three figures: ``time_breakdown.png`` (the performance model's
compute / communication / bubble split per plan of the configured run and of the paper's 7B
TP=4 row on ``--hardware``, like the paper's Fig. 1), ``comm_per_layer.png`` (the measured
tensor-axis bytes per layer per token of every row) and ``scaling.png`` (the model's
weak-scaling predictions against the paper's measurements). Defaults: the small model,
data=2 x tensor=4, batch 16 x seq 128, fp32.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from absl import flags, logging

from boost_jax.bench.measure import measure, ratio_line, row_config, run_benchmark
from boost_jax.config import Config

FLAGS = flags.FLAGS

DEFAULTS = ["Model.size='small'", "Parallel.data=2", "Parallel.tensor=4", "Train.batch_size=16",
            "Train.seq_len=128", "Train.dtype='float32'"]


def bench_row(config: Config, label: str, gspmd: bool, steps: int, peak: float | None) -> dict:
    from boost_jax.analysis.flops import train_flops_per_token

    rep = measure(config, steps, gspmd=gspmd)
    t, mesh = config.train, rep["config"]["mesh"]
    devices = mesh["data"] * mesh["pipe"] * mesh["tensor"]
    flops = train_flops_per_token(config.model, t.seq_len) * t.batch_size * t.seq_len
    tensor = rep["per_axis"].get("tensor", {"count": 0, "bytes": 0})
    m = rep["measured"]
    per_device = flops / devices / rep["median_step_s"]
    return {"row": label, "arch": config.model.arch, "plan": config.parallel.tp_plan,
            "gspmd": gspmd, "median_step_s": rep["median_step_s"],
            "tokens_per_s": rep["tokens_per_s"], "tflops_per_device": per_device / 1e12,
            "mfu": None if peak is None else per_device / peak,
            "temp_mib": rep["memory"].get("temp_size_in_bytes", 0) / 2**20,
            "peak_mib": None if rep["peak_bytes"] is None else rep["peak_bytes"] / 2**20,
            "compile_s": rep["compile_s"], "first_step_s": rep["first_step_s"],
            "tp_collectives_per_step": tensor["count"], "tp_bytes_per_step": tensor["bytes"],
            "tp_elements_per_layer_token": m["layer_fwd"] + m["layer_bwd"],
            "tp_bytes_per_layer_token": m["layer_fwd_bytes"] + m["layer_bwd_bytes"]}


def format_table(rows: list[dict]) -> str:
    head = (f"{'row':<16}{'arch':<7}{'step s':>9}{'tok/s':>9}{'MFU':>7}{'temp MiB':>10}"
            f"{'peak MiB':>10}{'TP colls':>10}{'TP MiB/step':>13}{'TP elem/layer/tok':>19}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"{r['row']:<16}{r['arch']:<7}{r['median_step_s']:>9.3f}"
                     f"{r['tokens_per_s']:>9.0f}{mfu:>7}{r['temp_mib']:>10.0f}{peak:>10}"
                     f"{r['tp_collectives_per_step']:>10}{r['tp_bytes_per_step'] / 2**20:>13.2f}"
                     f"{r['tp_elements_per_layer_token']:>19.0f}")
    by = {r["row"]: r for r in rows}
    for a, b in (("btp", "gspmd-btp"), ("vanilla", "gspmd-vanilla"),
                 ("fullrank", "gspmd-megatron"), ("btp", "fullrank"), ("btp", "vanilla")):
        if a in by and b in by:
            lines.append(ratio_line(by[a], by[b], a, b, "tp_bytes_per_step"))
    return "\n".join(lines)


def _figures(config: Config, rows: list[dict], out: Path) -> list[str]:
    from boost_jax.analysis.paper import WEAK_SCALING, compare, predict_row
    from boost_jax.analysis.perf_model import predict
    from boost_jax.bench import plots
    from boost_jax.bench.model import hardware_and_efficiency

    hw, eff = hardware_and_efficiency()
    t, m = config.train, config.model
    here = {}
    for plan in ("fullrank", "vanilla", "btp"):
        v, _ = row_config(config, plan)
        here[plan] = predict(v.model, v.parallel, t.batch_size, t.seq_len, hw, eff,
                             t.dtype).breakdown
    seven_b = next(r for r in WEAK_SCALING if r.name == "7B TP4")
    paper = {method.replace("boost", "btp"): pred.breakdown
             for method, pred in predict_row(seven_b, hw, eff).items()}
    plots.time_breakdown({
        f"this run: {m.size} (d={m.d_model}, {m.n_layers} layers),\nmesh "
        f"{dict(zip(('data', 'pipe', 'tensor'), config.parallel.shape))}, "
        f"{t.batch_size}x{t.seq_len} tokens, on {hw.name.split(',')[0]}": here,
        f"the paper's 7B TP=4, {seven_b.batch}x4096 tokens,\non {hw.name.split(',')[0]}":
            paper}, out / "time_breakdown.png")
    plots.bars({r["row"]: r["tp_bytes_per_layer_token"] for r in rows},
               "tensor-axis bytes / layer / token", "measured from the compiled HLO "
               "(forward + backward)", out / "comm_per_layer.png")
    plots.scaling(compare(WEAK_SCALING, hw, eff), out / "scaling.png", hw.name)
    return ["time_breakdown.png", "comm_per_layer.png", "scaling.png"]


def _run(config: Config) -> int:
    import jax

    from boost_jax.analysis.flops import peak_flops

    t = config.train
    peak = peak_flops(jax.devices()[0].device_kind, t.dtype, t.peak_tflops)
    rows = []
    variants = [(label, *row_config(config, label)) for label in FLAGS.plans]
    for label, variant, gspmd in variants:
        logging.info("bench step: %s", label)
        rows.append(bench_row(variant, label, gspmd, FLAGS.steps, peak))
        gc.collect()
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = _figures(config, rows, out)
    (out / "bench.json").write_text(json.dumps(
        {"config": config.to_dict(), "device": jax.devices()[0].device_kind,
         "devices": jax.device_count(), "rows": rows, "figures": figures}, indent=1))
    print(format_table(rows))
    print(f"wrote {out / 'bench.json'} and {', '.join(figures)}")
    return 0


def main(argv) -> int:
    return run_benchmark("step", argv, DEFAULTS, _run)
