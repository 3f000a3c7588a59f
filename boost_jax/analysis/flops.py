"""Analytic model FLOPs, for MFU and tokens -> FLOP conversions.

Conventions (the numbers a trainer reports as *model* FLOPs, MaxText/Levanter style):

* a matmul ``[m, k] x [k, n]`` is ``2 m k n`` FLOPs; elementwise work (norms, activations,
  RoPE, softmax) is not counted;
* projections: dense ``2 d_in d_out`` per token; low-rank ``2 r (d_in + d_out)``;
* LaX gates (blocks 1..L-1): dense ``2 r^2`` and Kronecker ``2 r (a + b)`` per latent member;
* attention core: ``QK^T`` and ``PV`` are ``2 s d`` each per token without a mask; causal
  attention counts half (``2 s d`` per token in all), the convention MaxText uses;
* the LM head is ``2 d V`` per token; the embedding lookup is a gather (0 FLOPs);
* training = 3 x forward (backward = 2 x forward); remat recomputation is *not* model FLOPs.
"""

from __future__ import annotations

from boost_jax.config import Model
from boost_jax.models.projections import balanced_factors


def _proj(cfg: Model, d_in: int, d_out: int, rank: int) -> int:
    return 2 * d_in * d_out if cfg.arch == "dense" else 2 * rank * (d_in + d_out)


def forward_flops_per_token(cfg: Model, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by component: ``projections``, ``lax_gates``, ``attention``,
    ``head`` and ``total`` (whole model, all layers)."""
    d, dkv, dff, ra, rm = cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.attn_rank, cfg.mlp_rank
    per_layer = (_proj(cfg, d, d, ra) + 2 * _proj(cfg, d, dkv, ra) + _proj(cfg, d, d, ra)
                 + 2 * _proj(cfg, d, dff, rm) + _proj(cfg, dff, d, rm))
    gates = 0
    if cfg.arch == "lax" and cfg.lax_gate != "identity":
        def gate(r):
            a, b = balanced_factors(r)
            return 2 * r * r if cfg.lax_gate == "dense" else 2 * r * (a + b)
        gates = (cfg.n_layers - 1) * (4 * gate(ra) + 3 * gate(rm))
    attention = cfg.n_layers * 2 * seq_len * d  # causal: half of 4 s d
    out = dict(projections=float(cfg.n_layers * per_layer), lax_gates=float(gates),
               attention=float(attention), head=float(2 * d * cfg.vocab_size))
    out["total"] = sum(out.values())
    return out


def recompute_flops_per_token(cfg: Model, seq_len: int, tp_plan: str, remat: str) -> float:
    """Forward FLOPs per token that activation checkpointing adds to a step (all layers).

    ``full`` recomputes every block. ``lowrank`` keeps every chunk-boundary value, so it
    recomputes only what lies between them: the column-side GEMMs of q/k/v and gate/up (B
    factors, or dense weights) and the attention core (plus LaX gates) -- under ``vanilla``,
    whose full-width q/k/v/gate/up outputs are kept, only the attention core and the LaX gates
    (on the gathered latents, which it keeps).
    ``lowrank_attn`` also keeps the attention output.
    """
    if remat == "none":
        return 0.0
    f = forward_flops_per_token(cfg, seq_len)
    if remat == "full":
        return f["projections"] + f["lax_gates"] + f["attention"]
    d, dkv, dff, ra, rm = cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.attn_rank, cfg.mlp_rank
    if cfg.arch == "dense":
        columns = 2 * d * (d + 2 * dkv) + 2 * 2 * d * dff
    else:
        columns = 2 * ra * (d + 2 * dkv) + 2 * 2 * rm * dff
    attention = f["attention"] if remat == "lowrank" else 0.0
    if tp_plan == "vanilla":
        return f["lax_gates"] + attention
    return cfg.n_layers * columns + f["lax_gates"] + attention


def train_flops_per_token(cfg: Model, seq_len: int) -> float:
    """Model FLOPs of one training step per token (3 x forward)."""
    return 3 * forward_flops_per_token(cfg, seq_len)["total"]


#: per-device dense peak FLOP/s by device-kind substring: (bf16, fp32 matmuls as TF32)
PEAK_FLOPS = {
    "H200": (989.4e12, 494.7e12),  # NVIDIA H200 SXM datasheet (same tensor cores as H100 SXM)
    "H100": (989.4e12, 494.7e12),  # NVIDIA H100 SXM5 datasheet, dense
    "A100": (312e12, 156e12),  # NVIDIA A100 datasheet, dense
}


def peak_flops(device_kind: str, dtype: str, override_tflops: float | None = None
               ) -> float | None:
    """Per-device peak for ``dtype`` ('bfloat16' or 'float32'), or None when unknown (CPU);
    ``override_tflops`` (``Train.peak_tflops``), when set, wins."""
    if override_tflops:
        return override_tflops * 1e12
    for key, (bf16, fp32) in PEAK_FLOPS.items():
        if key in device_kind:
            return bf16 if dtype == "bfloat16" else fp32
    return None
