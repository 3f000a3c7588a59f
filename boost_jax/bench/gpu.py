"""``python -m boost_jax.bench gpu``: the single-GPU measurements that only a GPU can make, in
one process per part (``--parts``), each printing a table and writing ``--out``/gpu_<part>.json.

* ``attention`` -- causal attention forward + backward at the 1B shape (32 heads of 128, bf16,
  ``--seq_lens``): XLA vs cuDNN flash attention, median time and the ratio, and whether the
  compiled HLO holds a ``[b, h, s, s]`` score tensor.
* ``kernels`` -- each Triton kernel (forward + backward) vs XLA's fusion of the ``jnp``
  reference on a 1B-shaped chunk boundary (``T = 16384`` tokens, ``d = 2048``, ``3r + 1 =
  1537``): median time and achieved GB/s against the device's HBM bandwidth.
* ``profile`` -- one CoLA 1B-shaped train step (``--gin_param`` shapes it) traced with
  ``jax.profiler``; the top device ops by total time.

The step table (dense / CoLA / SVD / LaX, remat none / lowrank) is ``bench step`` at the 1B
shape, run per configuration by ``launch/gpu_session.sh``. Medians over ``--steps`` timed runs
after warm-up. On a host without a GPU every part says so and exits 2.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from absl import flags

from boost_jax.errors import ConfigError

FLAGS = flags.FLAGS
PARTS = ("attention", "kernels", "profile")
#: the 1B preset's attention: 32 heads of 128 (models/presets.py)
HEADS, HEAD_DIM = 32, 128
#: a 1B-shaped BTP chunk boundary at TP=1: 4 x 4096 tokens, d = 2048, grouped qkv 3 x 512
TOKENS, D_MODEL, QKV = 4 * 4096, 2048, 3 * 512


def timed(fn, *args, steps: int) -> float:
    """Median seconds of ``fn(*args)`` over ``steps`` runs after two warm-up runs."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_rows(seq_lens: list[int], steps: int, batch: int = 1) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from boost_jax.models.attention import causal_attention

    rows = []
    for s in seq_lens:
        shape = (batch, s, HEADS, HEAD_DIM)
        q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(3))
        row = {"seq_len": s, "batch": batch}
        for impl in ("xla", "cudnn"):
            def loss(q, k, v, impl=impl):
                return jnp.sum(causal_attention(q, k, v, 10000.0, implementation=impl)
                               .astype(jnp.float32))

            step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
            hlo = step.lower(q, k, v).compile().as_text()
            row[f"{impl}_s"] = timed(step, q, k, v, steps=steps)
            row[f"{impl}_scores_in_hlo"] = f"[{batch},{HEADS},{s},{s}]" in hlo.replace(" ", "")
        row["xla_over_cudnn"] = row["xla_s"] / row["cudnn_s"]
        rows.append(row)
    return rows


def kernel_rows(steps: int, hbm_bw: float) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from boost_jax.kernels import ops

    x = jax.random.normal(jax.random.key(0), (TOKENS, D_MODEL), jnp.bfloat16)
    gamma = jnp.ones((D_MODEL,), jnp.bfloat16)
    payload = jnp.abs(jax.random.normal(jax.random.key(1), (TOKENS, QKV + 1), jnp.bfloat16))
    cases = {
        # bytes: read x, write x_hat (bf16) + two fp32 stats; backward reads x, dx_hat, writes dx
        "norm_local": (lambda impl: lambda x: jax.value_and_grad(
            lambda x: jnp.sum(ops.norm_local(x, gamma, 1e-6, impl)[0].astype(jnp.float32)))(x),
            x, 2 * 2 * TOKENS * D_MODEL + 8 * TOKENS + 3 * 2 * TOKENS * D_MODEL),
        # bytes: read payload, write y (+ z kept); backward reads z, dy and writes dpayload
        "recover_silu": (lambda impl: lambda p: jax.value_and_grad(
            lambda p: jnp.sum(ops.recover(p, D_MODEL, 1e-6, "silu", jnp.bfloat16, impl)
                              .astype(jnp.float32)))(p),
            payload, 2 * TOKENS * (QKV + 1) + 2 * 2 * TOKENS * QKV
            + 2 * 2 * TOKENS * QKV + 2 * TOKENS * (QKV + 1)),
    }
    rows = []
    for name, (make, arg, nbytes) in cases.items():
        row = {"kernel": name, "bytes": nbytes}
        for impl in ("xla", "triton"):
            t = timed(jax.jit(make(impl)), arg, steps=steps)
            row[f"{impl}_s"], row[f"{impl}_hbm"] = t, nbytes / t / hbm_bw
        row["xla_over_triton"] = row["xla_s"] / row["triton_s"]
        rows.append(row)
    return rows


def top_ops(trace_dir: Path, top: int = 15) -> list[dict]:
    """The ``top`` op names by total duration in a ``jax.profiler`` perfetto trace: device
    (GPU) tracks when the trace has them, else every track."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
    total, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and (not gpu or e.get("pid") in gpu):
            total[e["name"]] += e.get("dur", 0.0)
            count[e["name"]] += 1
    busy = sum(total.values()) or 1.0
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    return [{"op": n, "total_ms": total[n] / 1e3, "calls": count[n], "share": total[n] / busy}
            for n in ranked]


def profile_rows(config, steps: int, out: Path) -> list[dict]:
    import jax
    import numpy as np

    from boost_jax.bench.measure import random_batch
    from boost_jax.compiled.step_report import compile_step
    from boost_jax.train.step import init_state, stop_flags

    t = config.train
    model, opt, compiled = compile_step(config)
    state, stop = init_state(model, opt, t.seed), stop_flags(model)
    batch = {k: jax.device_put(v, model.batch_sharding) for k, v in random_batch(
        np.random.default_rng(0), config.model.vocab_size, t.batch_size, t.seq_len).items()}
    for _ in range(2):
        state, metrics = compiled(state, batch, stop)
    jax.block_until_ready(metrics)
    trace = out / "trace"
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        for _ in range(steps):
            state, metrics = compiled(state, batch, stop)
        jax.block_until_ready(metrics)
    return top_ops(trace)


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = {float: "{:.4g}", bool: "{}", int: "{}", str: "{}"}
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    for r in rows:
        lines.append(" | ".join(fmt.get(type(r[k]), "{}").format(r[k]) for k in keys))
    return "\n".join(lines)


def run(config) -> int:
    import jax

    from boost_jax.analysis.hardware import PROFILES

    if jax.default_backend() != "gpu":
        raise ConfigError(f"bench gpu measures a GPU; this host runs on {jax.default_backend()}")
    parts = FLAGS.parts
    for p in parts:
        if p not in PARTS:
            raise ConfigError(f"--parts: unknown part {p!r}; choose from {', '.join(PARTS)}")
    device = jax.devices()[0].device_kind
    hbm = next((h.hbm_bw for h in PROFILES.values() if device.split()[-1] in h.name),
               PROFILES["h100_sxm"].hbm_bw)
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if part == "attention":
            rows = attention_rows([int(s) for s in FLAGS.seq_lens], FLAGS.steps)
        elif part == "kernels":
            rows = kernel_rows(FLAGS.steps, hbm)
        else:
            rows = profile_rows(config, FLAGS.steps, out)
        (out / f"gpu_{part}.json").write_text(json.dumps(
            {"device": device, "part": part, "rows": rows}, indent=1))
        print(f"## {part} on {device}\n\n{_table(rows)}\n")
    return 0


def main(argv) -> int:
    from boost_jax.bench.measure import run_benchmark

    return run_benchmark("gpu", argv, ["Model.size='1b'", "Model.arch='cola'", "Model.n_layers=4",
                                       "Parallel.data=1", "Parallel.tensor=1",
                                       "Parallel.tp_plan='btp'", "Train.batch_size=4",
                                       "Train.seq_len=4096", "Train.dtype='bfloat16'"], run)
