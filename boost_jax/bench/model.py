"""``python -m boost_jax.bench model``: the performance model's predictions.

    python -m boost_jax.bench model --paper [--json]          # the paper's rows, side by side
    python -m boost_jax.bench model --paper --held_out        # the fitted constants held out
    python -m boost_jax.bench model [--gin_param=...]         # one configured run

``--hardware`` picks a profile (analysis/hardware.py: a100_80gb_4gpu, h100_sxm, h200);
``--hw_override=field=value`` and ``--eff_override=field=value`` replace any hardware constant
or efficiency constant (analysis/perf_model.py: gemm_max, gemm_ai_half, attention, memory,
comm).
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags

from boost_jax.analysis.hardware import PROFILES, Hardware
from boost_jax.analysis.perf_model import Efficiency
from boost_jax.cli import run_command
from boost_jax.config import Config, ConfigError

FLAGS = flags.FLAGS


def _overrides(cls, base, items: list[str]):
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    values = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or name == "name":
            raise ConfigError(f"unknown {cls.__name__} field {name!r} (one of "
                              f"{', '.join(k for k in fields if k != 'name')})")
        values[name] = int(value) if fields[name] in (int, "int") else float(value)
    return dataclasses.replace(base, **values)


def hardware_and_efficiency() -> tuple[Hardware, Efficiency]:
    if FLAGS.hardware not in PROFILES:
        raise ConfigError(f"--hardware={FLAGS.hardware!r} is not one of {', '.join(PROFILES)}")
    hw = _overrides(Hardware, PROFILES[FLAGS.hardware], FLAGS.hw_override)
    return hw, _overrides(Efficiency, Efficiency(), FLAGS.eff_override)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def format_paper(table: list[dict], hw: Hardware, eff: Efficiency) -> str:
    head = (f"{'row':<14}{'GPUs':>5}  {'full-rank TP s':>22}  {'vanilla TP s':>22}  "
            f"{'BOOST s':>22}  {'BOOST vs FR':>13}  {'vs vanilla':>13}")
    lines = [f"BOOST paper rows on {hw.name}; seq 4096, bf16 -- measured / predicted (error)",
             head, "-" * len(head)]
    for e in table:
        cells = "  ".join(f"{e[m]['measured_s']:>6.2f} / {e[m]['predicted_s']:5.2f} "
                          f"({_pct(e[m]['error']):>4})" for m in ("fullrank", "vanilla", "boost"))
        sp = "  ".join(f"{e[k]['measured']:5.2f} / {e[k]['predicted']:4.2f}"
                       for k in ("speedup_vs_fullrank", "speedup_vs_vanilla"))
        lines.append(f"{e['row']:<14}{e['gpus']:>5}  {cells}  {sp}")
    lines.append("constants: " + ", ".join(f"{k}={v:g}" for k, v in
                                          dataclasses.asdict(eff).items()))
    return "\n".join(lines)


def format_held_out(rows: list[dict], everything: Efficiency) -> str:
    """:func:`boost_jax.analysis.calibrate.leave_one_out`'s table."""
    from boost_jax.analysis.calibrate import FITTED

    head = (f"{'full-rank row':<14}{'measured s':>11}  {'in sample':>10}  {'held out':>9}  "
            + "  ".join(f"{name + ' (fit without it)':>28}" for name in FITTED))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['row']:<14}{r['measured_s']:>11.2f}  {_pct(r['in_sample_error']):>10}"
                     f"  {_pct(r['held_out_error']):>9}  " + "  ".join(
                         f"{r['fitted'][name]:>28.3f}" for name in FITTED))
    lines.append("fitted on every full-rank row: " + ", ".join(
        f"{name}={getattr(everything, name):.3f}" for name in FITTED))
    return "\n".join(lines)


def _held_out(hw: Hardware, eff: Efficiency) -> int:
    from boost_jax.analysis.calibrate import fit, leave_one_out
    from boost_jax.analysis.paper import WEAK_SCALING

    rows, everything = leave_one_out(WEAK_SCALING, hw, eff), fit(WEAK_SCALING, hw, eff)
    if FLAGS.json:
        print(json.dumps({"held_out": rows, "fitted_on_all": dataclasses.asdict(everything)},
                         indent=1))
    else:
        print(format_held_out(rows, everything))
    return 0


def _paper() -> int:
    from boost_jax.analysis.paper import ARCHITECTURES, SPEEDUP_RANGES, WEAK_SCALING, compare

    hw, eff = hardware_and_efficiency()
    if FLAGS.held_out:
        return _held_out(hw, eff)
    weak, archs = compare(WEAK_SCALING, hw, eff), compare(ARCHITECTURES, hw, eff)
    if FLAGS.json:
        print(json.dumps({"hardware": dataclasses.asdict(hw), "efficiency":
                          dataclasses.asdict(eff), "weak_scaling": weak,
                          "architectures": archs, "speedup_ranges": SPEEDUP_RANGES}, indent=1))
        return 0
    print(format_paper(weak, hw, eff))
    print()
    print(format_paper(archs, hw, eff).split("\n", 1)[1])
    for base, (lo, hi) in SPEEDUP_RANGES.items():
        got = [e[f"speedup_vs_{base}"]["predicted"] for e in weak[1:]]
        inside = sum(lo <= s <= hi for s in got)
        print(f"predicted BOOST speedup vs {base}, 3B-30B: "
              f"{', '.join(f'{s:.2f}' for s in got)} ({inside}/{len(got)} inside the paper's "
              f"{lo}-{hi})")
    return 0


def _one(config: Config) -> int:
    from boost_jax.analysis.perf_model import predict

    hw, eff = hardware_and_efficiency()
    t = config.train
    pred = predict(config.model, config.parallel, t.batch_size, t.seq_len, hw, eff, t.dtype)
    out = {"hardware": hw.name, "step_s": pred.step_s, "breakdown_s": pred.breakdown,
           "model_tflop_per_gpu": pred.model_flops / 1e12,
           "hardware_tflop_per_gpu": pred.hardware_flops / 1e12,
           "mfu": pred.model_flops / pred.step_s / hw.peak_flops,
           "hbm_gb_per_gpu": pred.hbm_bytes / 1e9, "comm_elements": pred.comm_elements,
           "memory_gb": {k: v / 1e9 for k, v in pred.memory.items()}}
    if FLAGS.json:
        print(json.dumps(out, indent=1))
        return 0
    m, par = config.model, config.parallel
    print(f"{m.arch}/{m.size} {par.tp_plan} mesh {par.shape} remat={par.remat}, batch "
          f"{t.batch_size} x {t.seq_len} on {hw.name}: {pred.step_s:.3f} s/step, "
          f"MFU {100 * out['mfu']:.1f}%")
    for k, v in pred.breakdown.items():
        print(f"  {k:<12}{v:9.4f} s")
    print(f"  model {out['model_tflop_per_gpu']:.1f} TFLOP / GPU, HBM {out['hbm_gb_per_gpu']:.1f}"
          f" GB / GPU; memory " + ", ".join(f"{k} {v:.1f} GB" for k, v in
                                             out["memory_gb"].items()))
    print("  communication per step (elements): " + ", ".join(
        f"{k} {v:,.0f}" for k, v in pred.comm_elements.items()))
    return 0


def main(argv) -> int:
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    # the model compiles nothing and runs on no device: no line about simulated devices
    if FLAGS.paper:
        return run_command("bench model", lambda _: _paper(), simulated=False)
    return run_command("bench model", _one, simulated=False)
