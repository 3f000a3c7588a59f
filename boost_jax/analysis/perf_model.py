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
  circular), plus one point-to-point send of the residual (shard) per iteration each way; the
  embedding, head and cross-entropy run on every stage, each on ``1/S`` of a pass's tokens
  (parallel/pipeline.py), with the ring all-gather and reduce-scatter of the pass's ``[T,
  d_local]`` residual over ``pipe``, forward and backward;
* the optimizer: AdamW reads/writes ~30 bytes per local parameter; data-parallel gradients and
  parameters: the collectives of ``Parallel.zero`` (all-reduces, reduce-scatters plus an
  all-gather, or FSDP's per-layer gathers), fp32 ring times; those that run per layer in the
  layer loops (FSDP's; stage 0's and 1's gradient reductions without pipelining or
  accumulation) are hidden under the layers' compute but for the last layer's share, by
  ``dp_overlap`` (not calibrated: 1.0 until a GPU measures it); the rest is exposed;
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
    #: of the data-parallel collectives that run per layer inside the layer loops (stage 0/1's
    #: in-loop gradient reductions, FSDP's gathers and reduce-scatters), the share of what the
    #: schedule can hide (all but the last layer's, up to the layers' compute) that a GPU
    #: hides -- 1.0, the schedule's bound, until the GPU run measures it (not calibrated)
    dp_overlap: float = 1.0


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
    memory: dict[str, float]  # model_state, activations, logits[, cudnn_workspace]

    @property
    def compute_s(self) -> float:
        b = self.breakdown
        return b["gemm"] + b["attention"] + b["elementwise"] + b["optimizer"]

    @property
    def communication_s(self) -> float:
        return self.breakdown["tp"] + self.breakdown["pp"] + self.breakdown["dp"]


def predict(model: Model, parallel: Parallel, batch: int, seq_len: int, hw: Hardware,
            eff: Efficiency = Efficiency(), dtype: str = "bfloat16",
            flash_attention: bool = True) -> Prediction:
    """Predict one train step (see the module docstring). ``batch`` is global, in sequences;
    ``flash_attention``: the attention keeps no ``seq x seq`` scores (GPU kernels; XLA's CPU
    attention does keep them)."""
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

    # the head (vocab-parallel) and the cross-entropy: once per pass, on every stage, on its
    # 1/S share of the pass's tokens (all of them without pipelining)
    vocab = model.vocab_size // p
    head_tokens = micro * tokens // stages
    head_gemm = 3 * gemm_time((head_tokens, model.d_model, vocab), hw, eff)
    ce_bytes = 6 * head_tokens * vocab * 4  # fp32 logits written, read for the loss and grad
    head = dict(gemm=head_gemm, elementwise=ce_bytes / (hw.hbm_bw * eff.memory),
                tp=allreduce_time(2 * head_tokens * model.d_model, p, tp_bw, tp_lat, eff))
    # useful work: every microbatch through this stage's layers, and the head's share
    busy = {k: passes * v * layers_per_stage + accum * head.get(k, 0.0)
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
        # the boundaries: a pass's [T, d_local] all-gathered and reduce-scattered, and back
        ring = (stages - 1) / stages * micro * tokens * d_local * BF16 / (bw * eff.comm)
        pp += accum * 4 * ((stages - 1) * lat + ring)
    local_params = sum(comm.local_parameters(model, parallel))
    updated = local_params / (data if parallel.zero else 1)  # ZeRO: each rank its slice
    optimizer = 30 * updated / (hw.hbm_bw * eff.memory)
    after, in_loop = data_parallel_time(model, parallel, hw, eff)
    runs = comm.schedule(model, parallel, batch, seq_len)["executions"]
    under = passes * layers_per_stage * sum(
        per_layer[k] for k in ("gemm", "attention", "elementwise"))
    if parallel.zero != 3:  # stages 0/1 reduce in one backward pass over the stage's layers
        runs, under = layers_per_stage, under / passes  # (a pipeline's first iteration's)
    hidden = min(eff.dp_overlap * in_loop * (1 - 1 / runs), under)
    dp = after + in_loop - hidden
    breakdown = dict(gemm=busy["gemm"], attention=busy["attention"],
                     elementwise=busy["elementwise"], optimizer=optimizer, tp=busy["tp"],
                     pp=pp, dp=dp, bubble=bubble)
    share = batch // data * seq_len / (p * stages)  # tokens' worth of FLOPs per GPU
    model_flops = train_flops_per_token(model, seq_len) * share
    hardware_flops = model_flops + share * recompute_flops_per_token(
        model, seq_len, plan, parallel.remat)
    layer_bytes = gemm_bytes + 3 * layer.elementwise_bytes
    head_bytes = ce_bytes + 3 * BF16 * (head_tokens * (model.d_model + vocab)
                                        + model.d_model * vocab)
    hbm = passes * layers_per_stage * layer_bytes + accum * head_bytes + 30 * updated
    return Prediction(
        step_s=sum(breakdown.values()), breakdown=breakdown, model_flops=model_flops,
        hardware_flops=hardware_flops, hbm_bytes=hbm,
        comm_elements=comm.predict(model, parallel, batch, seq_len, dtype).steps,
        memory=memory(model, parallel, batch, seq_len, dtype, flash_attention))


def memory(model: Model, parallel: Parallel, batch: int, seq_len: int,
           dtype: str = "bfloat16", flash_attention: bool = True,
           in_flight: int | None = None) -> dict[str, float]:
    """Bytes per device at the step's peak (:func:`predict`'s ``memory``: ``model_state``,
    ``activations``, ``logits``, with flash attention in bf16 ``cudnn_workspace``).
    ``in_flight``: the pipeline microbatches whose activations a stage holds at once, instead
    of this project's schedules' (every iteration's, ``R M + S - 1``, and the layer loop's
    copy) -- ``min(M, S)`` is the non-interleaved 1F1B schedule's first stage (Narayanan et
    al. 2021; Nanotron's ``pp_engine: 1f1b``, which BOOST's configs use), not built here."""
    p = parallel.tensor
    plan = parallel.tp_plan if p > 1 else ("none" if model.arch == "dense" else "btp")
    passes = parallel.microbatches * parallel.grad_accum
    tokens = batch // parallel.data // passes * seq_len  # per microbatch
    local_params = sum(comm.local_parameters(model, parallel))
    return _memory(model, parallel, plan, local_params, tokens, seq_len, dtype, flash_attention,
                   in_flight)


def data_parallel_time(model: Model, parallel: Parallel, hw: Hardware, eff: Efficiency
                       ) -> tuple[float, float]:
    """The step's gradient and parameter collectives (analysis/comm.py's
    :func:`~boost_jax.analysis.comm.gradient_transfers`, fp32) on ring links: an all-reduce
    ``2 (n-1)`` steps, an all-gather or reduce-scatter ``n - 1`` steps of ``1/n`` of the array.
    Returns ``(after the loops, inside the layer loops)``: the first is exposed; of the second,
    :func:`predict` hides :attr:`Efficiency.dp_overlap` of all but the last layer's share under
    the layers' compute."""
    out = [0.0, 0.0]
    for t in comm.gradient_transfers(model, parallel):
        if t.group <= 1:
            continue
        inside = parallel.num_devices <= hw.gpus_per_node
        bw, lat = (hw.intra_bw, hw.intra_latency) if inside else (hw.inter_bw, hw.inter_latency)
        if t.op == "all-reduce":
            time = allreduce_time(t.elements, t.group, bw, lat, eff, itemsize=4)
        else:
            steps = t.group - 1
            time = steps * lat + steps / t.group * t.elements * 4 / (bw * eff.comm)
        out[t.in_loop] += time
    return out[0], out[1]


#: activation tensors kept per layer for the backward pass with ``remat='none'``, per width
#: class, in the compute dtype (global counts, read off the layer loops of XLA:GPU's programs
#: of the paper's 1B and 3B rows at 2 and 4 layers, compiled for A100s, where the classes' widths
#: differ; ``python -m boost_jax.bench memory --target=a100_sxm_80``): the residual-stream-wide
#: ones (block input, the two norms' outputs), the low-rank latents (pre- and post-activation
#: and the fused q/k/v and gate/up latents once more: 21-23 rank-wide columns of CoLA per
#: layer against the class's 7, i.e. 3 of the class width), the ``d_ff``-wide ones (a
#: low-rank MLP's gate and up outputs and their product), the q/k/v-wide ones (after RoPE) and
#: the attention output. Where each constant was read and on which compiled programs it was
#: checked without being fitted to them: docs/BENCHMARKS.md, "The memory model".
KEPT = {"residual": 3, "latent": 3, "ff": 3, "qkv": 1, "attention": 1}
KEPT_FF_DENSE = 5  # a SwiGLU MLP's ``d_ff``-wide tensors (dense's; svd's alike), instead
#: fp32 residual-width tensors each layer keeps besides: each of its two RMSNorms' fp32 input
#: and normalised value (models/norms.py computes in fp32; read off bf16 programs, and kept for
#: fp32 steps, which the CPU verification checks within 15 %)
NORMS_FP32 = 4
#: under FSDP (and the circular schedule) the blocks are checkpointed keeping the matmul
#: outputs only (models/remat.py): per class what stays of :data:`KEPT` (read off the
#: compiled 1B FSDP step for 8 H100s at 4 layers), no fp32 norm copies
KEPT_FSDP = {"residual": 3, "latent": 1, "ff": 2, "qkv": 1, "attention": 0}
#: fp32 ``seq``-wide tensors per head kept by XLA's (non-flash) attention: scores, softmax
SCORES = 2
#: fp32 ``[tokens, vocab/p]`` arrays at the loss: logits, gradient (3B FSDP: 2 f32[4096, 32000])
LOGITS = 2
#: under ``btp`` with a tensor axis, latent-wide tensors kept besides :data:`KEPT`'s: the
#: partial sums all-reduced inside the block (the 13B TP4xPP2 row's program at 4 layers)
REDUCED = 1
#: share of one layer's activations alive at once while a remat policy rebuilds it: all of
#: them (the 30B TP4xPP4 rows' programs under ``remat='full'`` at 8 and 16 layers)
REBUILT = 1.0


def _widths(model: Model, plan: str, p: int, seq_len: int) -> dict[str, float]:
    """Per-token widths of each activation class on one device (elements)."""
    d, dkv, dff, h = model.d_model, model.d_kv, model.d_ff, model.n_heads
    lat = (4 * model.attn_rank + 3 * model.mlp_rank) if model.is_lowrank else 0
    if plan == "vanilla":  # residual, attention and gate*up replicated; latents rank-split
        return dict(residual=d, latent=lat / p, ff=dff, qkv=d + 2 * dkv, attention=d,
                    scores=h * seq_len)
    if plan in ("fullrank", "none") and not model.is_lowrank:  # residual replicated
        return dict(residual=d, latent=0, ff=dff / p, qkv=(d + 2 * dkv) / p, attention=d / p,
                    scores=h / p * seq_len)
    # btp (and a low-rank model on one device): every full dim split, latents replicated
    return dict(residual=d / p, latent=lat, ff=dff / p, qkv=(d + 2 * dkv) / p,
                attention=d / p, scores=h / p * seq_len)


def _memory(model: Model, parallel: Parallel, plan: str, local_params: int, tokens: int,
            seq_len: int, dtype: str, flash: bool, in_flight: int | None = None
            ) -> dict[str, float]:
    """Bytes per device at the step's peak.

    ``model_state``: fp32 parameters (4 B), Adam's two moments (8 B, split over ``data`` by
    ZeRO-1 and FSDP) and the fp32 gradients (4 B; with accumulation a second fp32 sum), all
    split over ``data`` by FSDP (which holds one layer gathered, and the embedding, head and
    norms gathered, with the whole fp32 gradient of one of embedding and head at a time); plus the
    compute-dtype copy of the weights in bf16 (2 B).
    ``activations``: what each layer keeps for the backward pass (:data:`KEPT` per width class,
    in the compute dtype, and :data:`NORMS_FP32`; XLA attention's scores in fp32 unless
    ``flash``), for every pipeline microbatch in flight, one accumulation micro-step at a
    time; ``full`` remat keeps the block input and rebuilds one layer at a time (all of its
    activations, :data:`REBUILT`), ``lowrank`` keeps the latents, the reduced outputs and the
    residual.
    ``logits``: the vocab-parallel head's fp32 arrays (:data:`LOGITS`) of a microbatch (when
    pipelining, of the stage's ``1/S`` share of a pipeline pass's tokens: every stage runs the
    head on its share of the pass at once).
    ``cudnn_workspace`` (``flash`` only): the workspace of cuDNN's attention backward for one
    layer of a microbatch, which a program compiled without a GPU sizes 0.
    """
    data, p = parallel.data, parallel.tensor
    layers = model.n_layers // parallel.pipe
    act = 2 if dtype == "bfloat16" else 4
    fsdp = data if parallel.zero == 3 else 1
    weights = 4 + 4 * (1 + (parallel.grad_accum > 1)) + (2 if act == 2 else 0)
    state = local_params * (weights / fsdp + 8 / (data if parallel.zero else 1))
    if fsdp > 1:  # one layer's parameters gathered and its gradient before the scatter;
        # the embedding, head and norms gathered for the step (compute dtype), and the whole
        # fp32 gradient of one of embedding and head at a time (XLA:GPU's 3B FSDP step for
        # H100s): 4 B for half of them
        state += _layer_parameters(model, parallel) * (8 + (2 if act == 2 else 0))
        state += comm.local_parameters(model, parallel)[1] * (act + 2)
    w = _widths(model, plan, p, seq_len)
    # FSDP's blocks, and those that slice their layer from the stage's in every pipeline
    # iteration (circular), are always checkpointed (models/remat.py)
    sliced = fsdp > 1 or parallel.repeats > 1
    checkpointed = sliced and parallel.remat == "none"
    counts = dict(KEPT_FSDP if checkpointed else KEPT)
    if not model.bilinear_mlp and not checkpointed:  # a SwiGLU MLP (dense, svd)
        counts["ff"] = KEPT_FF_DENSE
    if plan == "btp" and p > 1:
        counts["latent"] += REDUCED
    keep = {k: counts[k] * w[k] * act for k in KEPT}
    norms = 0 if checkpointed else NORMS_FP32 * w["residual"] * 4
    layer = sum(keep.values()) + norms + (0.0 if flash else SCORES * w["scores"] * 4)
    if parallel.remat == "full":  # the block input; one block rebuilt at a time
        kept, peak = w["residual"] * act, REBUILT * layer
    elif parallel.remat in ("lowrank", "lowrank_attn"):  # latents and the residual stream
        extra = parallel.remat == "lowrank_attn"
        kept = w["latent"] * act + (2 + extra) * w["residual"] * act
        peak = REBUILT * max(layer - kept, 0.0)
    else:
        kept, peak = layer, 0.0
    # pipelining keeps a microbatch's activations per loop iteration (bubbles included)
    # (``R M + S - 1`` iterations of the stage's ``L / (S R)`` layers per pass), and one
    # iteration's more where the stage's layers run in a loop: XLA builds an iteration's
    # layer-loop residuals in a buffer of their own and copies them into the pipeline loop's
    # stacked residuals, both alive at the forward pass's end (the 13B TP4xPP2 row compiled
    # for A100s: 131.8 GiB, 3 passes' activations for M = 1). Not under FSDP, whose compiled
    # program shows no such copy (the same row with FSDP over data=2: 50.9 GiB), nor that of
    # the circular schedule, whose layer loop runs over layer indices (parallel/pipeline.py)
    group = layers // parallel.repeats
    copy = group > 1 and not sliced
    passes = (parallel.repeats * parallel.microbatches + parallel.pipe - 1 + copy
              if parallel.pipe > 1 else 1) if in_flight is None else in_flight
    activations = kept * group * tokens * passes + peak * tokens
    heads = parallel.microbatches / parallel.pipe if parallel.pipe > 1 else 1
    logits = LOGITS * tokens * heads * model.vocab_size / p * 4
    out = {"model_state": state, "activations": activations, "logits": logits}
    if flash and act == 2:  # cuDNN's attention backward (bf16), one layer's: its fp32 dQ
        # accumulator [b, h, s, d_head] and softmax sum [b, h, s] (NVIDIA/cudnn-frontend, include/
        # cudnn_frontend/node/scaled_dot_product_flash_attention.h, SDPABackwardNode:
        # ``dQ_accum``, ``softmax_sum``); XLA's deviceless compile sizes it 0 (no cuDNN)
        out["cudnn_workspace"] = tokens * (w["attention"] + w["scores"] / seq_len) * 4
    return out


def _layer_parameters(model: Model, parallel: Parallel) -> float:
    """Parameters of one decoder layer on one device (its tensor shard)."""
    stage, _ = comm.local_parameters(model, parallel)
    return stage / (model.n_layers // parallel.pipe)
