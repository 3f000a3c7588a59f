"""The performance model: predict a train step's time, FLOPs, HBM traffic, communication and
memory for a model, mesh, plan, remat policy and hardware profile.

Per GPU and per microbatch of ``T`` tokens, each decoder layer is a list of GEMMs, the attention
core, elementwise work and tensor-axis collectives -- written out per plan below, with the
shapes each GPU really runs (e.g. ``vanilla``'s ``[T, r/p]`` latents and its replicated
attention; ``btp``'s ``[T, d/p] x [d/p, 3r]``). Times:

* GEMM ``[M, K] x [K, N]``: ``2MKN / (peak * eff(AI))``, where ``AI = MKN / (MK + KN + MN)``
  FLOP/byte in bf16 and ``eff(AI) = gemm_max / (1 + gemm_ai_half / AI)``: skinny low-rank
  GEMMs run further from peak; bounded below by the HBM roofline;
* attention core: causal FLOPs / (peak * ``attention``); backward 2.5x forward (flash);
* elementwise work (norms, residual adds, RoPE, activations, the cross-entropy): bytes moved /
  (HBM bandwidth * ``memory``);
* a collective: ring alpha-beta, ``steps * latency + wire bytes / (link bandwidth * comm)``, over
  NVLink inside a node and the network across nodes; TP collectives are not overlapped with
  compute (they sit on the critical path of every layer);
* backward = 2x the forward GEMMs; ``lowrank`` remat re-runs the column GEMMs and attention,
  ``full`` the whole forward (and its TP collectives);
* pipeline: ``(R M + S - 1)`` iterations of the slowest stage's microbatch time (GPipe /
  circular), plus one point-to-point send of the residual (shard) per iteration each way;
* the optimizer: AdamW reads/writes ~30 bytes per local parameter; data-parallel gradients and
  parameters: the collectives of ``Parallel.zero`` (one all-reduce, a reduce-scatter plus an
  all-gather, or FSDP's per-layer gathers), fp32 ring times;
* gradient accumulation: ``Parallel.grad_accum`` micro-steps of the whole forward and
  backward (pipeline passes included) per step, activations of one at a time.

Efficiency constants (:class:`Efficiency`) are global -- never per configuration. Two come from
the BOOST README's kernel measurements (GEMM HFU ~59% for vanilla's AI ~240 GEMMs, ~72% for
BTP's AI ~600: ``gemm_max``, ``gemm_ai_half``); ``attention``, ``memory`` and ``comm`` are
calibrated once against the paper's full-rank rows (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

from boost_jax.analysis import comm
from boost_jax.analysis.flops import recompute_flops_per_token, train_flops_per_token
from boost_jax.analysis.hardware import Hardware
from boost_jax.config import Model, Parallel

BF16 = 2


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The model's global efficiency constants (overridable from the command line)."""

    gemm_max: float = 0.843  # asymptotic GEMM efficiency   } from the README kernel table:
    gemm_ai_half: float = 103.0  # FLOP/byte at half of it  } 59% at AI 240, 72% at AI 600
    attention: float = 0.325  # flash-attention fraction of peak (calibrated on the paper rows)
    memory: float = 0.55  # fraction of HBM bandwidth elementwise work reaches (calibrated)
    comm: float = 0.65  # of link bandwidth: the README's 7B TP=4 times imply ~195 GB/s on A100


@dataclasses.dataclass
class Layer:
    """One decoder layer's forward work on one GPU for a microbatch."""

    gemms: list[tuple[int, int, int]]  # (M, K, N)
    recompute_gemms: list[tuple[int, int, int]]  # re-run by lowrank remat
    attention_flops: float
    elementwise_bytes: float


def _layer(m: Model, plan: str, p: int, tokens: int, seq_len: int) -> Layer:
    t, d, dkv, dff, ra, rm = tokens, m.d_model, m.d_kv, m.d_ff, m.attn_rank, m.mlp_rank
    attn = 2 * t * seq_len * d  # causal QK^T and PV over all heads
    # norms, residual adds, RoPE and the gated product (elements per token, read + write)
    residual = 4 * d + 6 * d + 2 * (d + dkv) + 3 * dff
    # latent activation (cola, lax) and LaX's crossing on the 7 latents
    latents = {"svd": 0, "cola": 2, "lax": 5}.get(m.arch, 0) * (4 * ra + 3 * rm)
    if m.arch == "dense":
        gemms = [(t, d, (d + 2 * dkv) // p), (t, d // p, d), (t, d, 2 * dff // p),
                 (t, dff // p, d)]
        elem = 4 * d + 6 * d + (2 * (d + dkv) + 3 * dff) // p  # norms/residual replicated
        return Layer(gemms, gemms[:1] + gemms[2:3], attn / p, elem * t * BF16)
    if plan == "vanilla" and p > 1:  # rank split; attention and gate*up replicated
        rp_a, rp_m = ra // p, rm // p
        gemms = [(t, d, 3 * rp_a), (t, rp_a, d), (t, rp_a, dkv), (t, rp_a, dkv),
                 (t, d, rp_a), (t, rp_a, d), (t, d, 2 * rp_m), (t, rp_m, dff), (t, rp_m, dff),
                 (t, dff, rp_m), (t, rp_m, d)]
        return Layer(gemms, [], attn, (residual + latents // p) * t * BF16)
    # btp (and any low-rank model on one GPU): full dims split, latents replicated
    gemms = [(t, d // p, 3 * ra), (t, ra, d // p), (t, ra, dkv // p), (t, ra, dkv // p),
             (t, d // p, ra), (t, ra, d // p), (t, d // p, 2 * rm), (t, rm, dff // p),
             (t, rm, dff // p), (t, dff // p, rm), (t, rm, d // p)]
    recompute = gemms[1:4] + gemms[7:9]
    return Layer(gemms, recompute, attn / p, (residual // p + latents) * t * BF16)


def gemm_time(mkn: tuple[int, int, int], hw: Hardware, eff: Efficiency) -> float:
    m, k, n = mkn
    ai = m * k * n / (m * k + k * n + m * n)
    compute = 2 * m * k * n / (hw.peak_flops * eff.gemm_max / (1 + eff.gemm_ai_half / ai))
    memory = BF16 * (m * k + k * n + m * n) / (hw.hbm_bw * eff.memory)
    return max(compute, memory)


def allreduce_time(elements: float, group: int, bw: float, latency: float, eff: Efficiency,
                   itemsize: int = BF16) -> float:
    """Ring all-reduce of ``elements`` over ``group`` GPUs."""
    if group <= 1:
        return 0.0
    steps = 2 * (group - 1)
    return steps * latency + steps / group * elements * itemsize / (bw * eff.comm)


@dataclasses.dataclass
class Prediction:
    """A predicted train step, per GPU; times in seconds, memory in bytes."""

    step_s: float
    breakdown: dict[str, float]  # gemm, attention, elementwise, optimizer, tp, pp, dp, bubble
    model_flops: float  # per GPU per step (analytic model FLOPs, no recompute)
    hardware_flops: float  # per GPU per step including recomputation
    hbm_bytes: float  # per GPU per step: GEMM operands, elementwise work, optimizer
    comm_elements: dict[str, float]  # per step, by mesh axes (analysis/comm.py)
    memory: dict[str, float]  # model_state, activations

    @property
    def compute_s(self) -> float:
        b = self.breakdown
        return b["gemm"] + b["attention"] + b["elementwise"] + b["optimizer"]

    @property
    def communication_s(self) -> float:
        return self.breakdown["tp"] + self.breakdown["pp"] + self.breakdown["dp"]


def predict(model: Model, parallel: Parallel, batch: int, seq_len: int, hw: Hardware,
            eff: Efficiency = Efficiency(), dtype: str = "bfloat16") -> Prediction:
    """Predict one train step (see the module docstring). ``batch`` is global, in sequences."""
    p, stages, data = parallel.tensor, parallel.pipe, parallel.data
    plan = parallel.tp_plan if p > 1 else ("none" if model.arch == "dense" else "btp")
    micro, accum = parallel.microbatches, parallel.grad_accum
    passes = micro * accum  # microbatches through the layers per step
    tokens = batch // data // passes * seq_len  # per microbatch
    layer = _layer(model, plan, p, tokens, seq_len)
    layers_per_stage = model.n_layers // stages
    intra = p <= hw.gpus_per_node
    tp_bw, tp_lat = (hw.intra_bw, hw.intra_latency) if intra else (hw.inter_bw, hw.inter_latency)

    fwd_gemm = sum(gemm_time(g, hw, eff) for g in layer.gemms)
    gemm = 3 * fwd_gemm  # forward + the two backward GEMMs per weight
    attention = 3.5 * layer.attention_flops / (hw.peak_flops * eff.attention)  # fwd + 2.5 bwd
    elementwise = 3 * layer.elementwise_bytes / (hw.hbm_bw * eff.memory)
    gemm_bytes = 3 * sum(BF16 * (m * k + k * n + m * n) for m, k, n in layer.gemms)
    if parallel.remat in ("lowrank", "lowrank_attn"):
        gemm += sum(gemm_time(g, hw, eff) for g in layer.recompute_gemms)
        if parallel.remat == "lowrank":
            attention += layer.attention_flops / (hw.peak_flops * eff.attention)
    elif parallel.remat == "full":
        gemm += fwd_gemm
        attention += layer.attention_flops / (hw.peak_flops * eff.attention)
        elementwise += layer.elementwise_bytes / (hw.hbm_bw * eff.memory)
    # the layer's collectives: the formulas the HLO tests check (replays of `full` included)
    fwd, bwd = comm.layer_collectives(model, parallel, dtype)
    tp = sum(allreduce_time(e * tokens, p, tp_bw, tp_lat, eff, itemsize=b) for e, b in fwd + bwd)
    per_layer = dict(gemm=gemm, attention=attention, elementwise=elementwise, tp=tp)

    # the head (vocab-parallel) and the cross-entropy run on the last stage
    vocab = model.vocab_size // p
    head_gemm = 3 * gemm_time((tokens, model.d_model, vocab), hw, eff)
    ce_bytes = 6 * tokens * vocab * 4  # fp32 logits written, read for the loss and its grad
    head = dict(gemm=head_gemm, elementwise=ce_bytes / (hw.hbm_bw * eff.memory),
                tp=allreduce_time(2 * tokens * model.d_model, p, tp_bw, tp_lat, eff))
    # useful work: every microbatch through this stage's layers (and the head, last stage)
    busy = {k: passes * (v * layers_per_stage + head.get(k, 0.0))
            for k, v in per_layer.items()}
    bubble = pp = 0.0
    if stages > 1:
        iterations = parallel.repeats * micro + stages - 1
        bubble = accum * (stages - 1) * layers_per_stage / parallel.repeats * sum(
            per_layer.values())
        d_local = model.d_model // p if plan == "btp" else model.d_model
        across = p * stages > hw.gpus_per_node  # stages on different nodes
        bw, lat = (hw.inter_bw, hw.inter_latency) if across else (hw.intra_bw, hw.intra_latency)
        pp = accum * iterations * 2 * (lat + tokens * d_local * BF16 / (bw * eff.comm))
    local_params = sum(comm.local_parameters(model, parallel))
    updated = local_params / (data if parallel.zero else 1)  # ZeRO: each rank its slice
    optimizer = 30 * updated / (hw.hbm_bw * eff.memory)
    dp = data_parallel_time(model, parallel, hw, eff)
    breakdown = dict(gemm=busy["gemm"], attention=busy["attention"],
                     elementwise=busy["elementwise"], optimizer=optimizer, tp=busy["tp"],
                     pp=pp, dp=dp, bubble=bubble)
    share = batch // data * seq_len / (p * stages)  # tokens' worth of FLOPs per GPU
    model_flops = train_flops_per_token(model, seq_len) * share
    hardware_flops = model_flops + share * recompute_flops_per_token(
        model, seq_len, plan, parallel.remat)
    layer_bytes = gemm_bytes + 3 * layer.elementwise_bytes
    hbm = passes * layers_per_stage * layer_bytes + passes * (ce_bytes + 3 * BF16 * tokens * (
        model.d_model + vocab) + 3 * BF16 * model.d_model * vocab) + 30 * updated
    return Prediction(
        step_s=sum(breakdown.values()), breakdown=breakdown, model_flops=model_flops,
        hardware_flops=hardware_flops, hbm_bytes=hbm,
        comm_elements=comm.predict(model, parallel, batch, seq_len, dtype).steps,
        memory=_memory(model, parallel, local_params, tokens, micro, layers_per_stage))


def data_parallel_time(model: Model, parallel: Parallel, hw: Hardware, eff: Efficiency
                       ) -> float:
    """The step's gradient and parameter collectives (analysis/comm.py's
    :func:`~boost_jax.analysis.comm.gradient_transfers`, fp32) on ring links: an all-reduce
    ``2 (n-1)`` steps, an all-gather or reduce-scatter ``n - 1`` steps of ``1/n`` of the array.
    Not overlapped with compute (a GPU overlaps FSDP's per-layer ones in part)."""
    out = 0.0
    for t in comm.gradient_transfers(model, parallel):
        if t.group <= 1:
            continue
        inside = parallel.num_devices <= hw.gpus_per_node
        bw, lat = (hw.intra_bw, hw.intra_latency) if inside else (hw.inter_bw, hw.inter_latency)
        if t.op == "all-reduce":
            out += allreduce_time(t.elements, t.group, bw, lat, eff, itemsize=4)
        else:
            steps = t.group - 1
            out += steps * lat + steps / t.group * t.elements * 4 / (bw * eff.comm)
    return out


def _memory(model: Model, parallel: Parallel, local_params: int, tokens: int, micro: int,
            layers: int) -> dict[str, float]:
    """Model state (bf16 weights, fp32 master, grads and two Adam moments: 18 B/param; Adam
    split over data with ZeRO-1, everything with FSDP) and activations kept for the backward
    pass (elements per token per layer, in bf16, for every pipeline microbatch in flight: one
    accumulation micro-step at a time)."""
    split = parallel.data if parallel.zero else 1
    if parallel.zero == 3:
        state = local_params * (2 + 4 + 4 + 8) / split
    else:
        state = local_params * (2 + 4 + 4 + 8 / split)
    d, p, r = model.d_model, parallel.tensor, model.attn_rank
    per_token = {"none": 12 * d + 4 * model.d_ff, "lowrank": 7 * r + 2 * d,
                 "lowrank_attn": 7 * r + 3 * d, "full": d}[parallel.remat]
    if parallel.tp_plan != "vanilla":
        per_token = per_token / p if parallel.remat != "lowrank" else 7 * r + 2 * d / p
    activations = per_token * BF16 * tokens * micro * layers
    return {"model_state": state, "activations": activations}
