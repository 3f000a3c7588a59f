"""Communication of a train step: the analytic prediction (SPEC §6.2) and the HLO measurement.

Elements are counted as :mod:`boost_jax.analysis.hlo` counts them (an all-reduce's array, a
reduce-scatter's full input, an all-gather's result). ``T`` is the number of tokens one
tensor-parallel group processes per step (``batch / data * seq_len``).

Tensor axis, per decoder layer per token (grouping on):

==========================  =======================================  ========================
plan                        forward                                  backward
==========================  =======================================  ========================
``fullrank``                ``2 d``  (o, down)                        ``2 d``  (qkv, gate/up)
``vanilla``                 ``3 d + 2 d_kv + 2 d_ff``                ``3 d + d_ff``
``btp`` online              ``(3 r_a + 1) + r_a + (2 r_m + 1) + r_m``  ``3 r_a + r_a + 2 r_m + r_m``
``btp`` sync                ``7 r`` + 2 statistics                   ``7 r`` + 2 statistics
==========================  =======================================  ========================

Without grouping every member of q/k/v and gate/up has its own collective (the online
statistic then rides in each A factor's all-reduce). With ``Parallel.remat='full'`` the
backward pass recomputes each block and replays its forward collectives (all of them under
``btp``; under ``vanilla``/``fullrank`` all but the last, whose full-width output only the next
block reads); ``lowrank`` keeps every collective's output and replays none.

Per step, outside the layers: the vocab-parallel embedding (an all-reduce of ``[T, d]``, or
for ``btp`` a reduce-scatter into the residual shard whose backward is an all-gather), the
head's input (``fullrank``/``vanilla``: the
backward all-reduce of ``[T, d]``; ``btp``: the all-gather of the residual shards and its
backward reduce-scatter, plus the final norm gain's gradient, ``d``), and the sharded
cross-entropy's three ``[T]`` reductions. Data axis: one all-reduce per step of every local
parameter gradient, plus the loss.
"""

from __future__ import annotations

import dataclasses
import math

from boost_jax.analysis.hlo import Collective
from boost_jax.config import Model, Parallel
from boost_jax.models.decoder import abstract_model
from boost_jax.parallel.plans import get_plan


@dataclasses.dataclass(frozen=True)
class Comm:
    """Communication of one train step (elements unless named ``*_bytes``).

    ``layer_fwd`` / ``layer_bwd``: tensor-axis elements per layer per token, for the
    ``looped`` layers run by the layer loop (``looped`` is 0 when the compiler kept no loop,
    e.g. a single scanned layer; then all layers count as boundary).
    ``boundary_fwd`` / ``boundary_bwd``: tensor-axis elements per step outside the layer loop.
    ``layer_fwd_bytes`` / ``layer_bwd_bytes``: the same per-layer traffic in bytes per token.
    ``data``: data-axis elements per step.
    """

    layer_fwd: float
    layer_bwd: float
    boundary_fwd: float
    boundary_bwd: float
    layer_fwd_bytes: float
    layer_bwd_bytes: float
    data: float
    looped: int


def step_total(comm: Comm, tokens: int) -> float:
    """Tensor-axis elements per step."""
    return (comm.layer_fwd + comm.layer_bwd) * comm.looped * tokens + comm.boundary_fwd + \
        comm.boundary_bwd


def _layer(model: Model, parallel: Parallel) -> tuple[float, float, int]:
    """(forward, backward) tensor elements per layer per token; forward statistic count."""
    d, dkv, dff, ra, rm = model.d_model, model.d_kv, model.d_ff, model.attn_rank, model.mlp_rank
    grouped = parallel.grouping
    plan = parallel.tp_plan if parallel.tensor > 1 else "none"
    if plan == "none":
        return 0.0, 0.0, 0
    if plan == "fullrank":
        return 2 * d, 2 * d if grouped else 5 * d, 0
    if plan == "vanilla":
        return 3 * d + 2 * dkv + 2 * dff, (3 * d + dff) if grouped else (6 * d + dff), 0
    latents = 4 * ra + 3 * rm  # btp: q, k, v, o latents + gate, up, down latents
    norms = 2 if grouped else 5  # norm_down collectives per layer (one per grouped A factor)
    if parallel.rmsnorm == "online":
        return latents + norms, latents, norms
    return latents + norms, latents + norms, norms


def predict(model: Model, parallel: Parallel, batch: int, seq_len: int, dtype: str
            ) -> Comm:
    """The analytic communication of a train step (see the module docstring)."""
    tokens = batch // parallel.data * seq_len
    fwd, bwd, stats = _layer(model, parallel)
    act = 2 if dtype == "bfloat16" else 4
    online = parallel.tp_plan == "btp" and parallel.rmsnorm == "online"
    stat_bytes = act if online and parallel.norm_payload == "compute" else 4
    if online and parallel.norm_payload == "float32":  # the fused q/k/v, gate/up payloads
        fused = 3 * model.attn_rank + 2 * model.mlp_rank + stats
        fwd_bytes = 4 * fused + act * (fwd - fused)
    else:
        fwd_bytes = act * (fwd - stats) + stat_bytes * stats
    bwd_stats = stats if (parallel.tp_plan == "btp" and parallel.rmsnorm == "sync") else 0
    bwd_bytes = act * (bwd - bwd_stats) + 4 * bwd_stats
    if parallel.remat == "full" and parallel.tensor > 1:
        # the recomputed forward replays its collectives, except the last one (down's output,
        # which only the next block reads) when it is full-width (vanilla, fullrank)
        unused = 0 if parallel.tp_plan == "btp" else model.d_model
        bwd, bwd_bytes = bwd + fwd - unused, bwd_bytes + fwd_bytes - act * unused
    d = model.d_model
    b_fwd = b_bwd = 0.0
    if parallel.tensor > 1:
        b_fwd, b_bwd = tokens * d + 3 * tokens, tokens * d
        if parallel.tp_plan == "btp":
            b_fwd, b_bwd = 2 * tokens * d + 3 * tokens, 2 * tokens * d + d
    looped = layers_looped(model)
    outside = model.n_layers - looped  # LaX's block 0 runs before the scan
    b_fwd, b_bwd = b_fwd + outside * fwd * tokens, b_bwd + outside * bwd * tokens
    plan = get_plan(parallel)
    local = 0
    for spec_def in abstract_model(model)[1].values():
        spec = plan.spec(spec_def.axes)
        split = math.prod(parallel.tensor for a in spec if a is not None)
        local += math.prod(spec_def.shape) // split
    data = (local + 1) if parallel.data > 1 else 0
    return Comm(fwd, bwd, b_fwd, b_bwd, fwd_bytes, bwd_bytes, data, looped)


def layers_looped(model: Model) -> int:
    """Layers the compiled step runs in a loop: the ``lax.scan`` over blocks (LaX runs block 0
    before it); XLA unrolls a scan of one layer, which then leaves no loop."""
    scanned = model.n_layers - (1 if model.arch == "lax" else 0)
    return scanned if scanned > 1 else 0


def measure(colls: list[Collective], model: Model, parallel: Parallel, batch: int,
            seq_len: int) -> Comm:
    """The same quantities read from compiled-HLO collectives (:func:`hlo.collectives`).

    Layer collectives are the tensor-axis ones inside a ``while`` loop whose trip count is the
    number of scanned layers; only collectives of the model's ``shard_map`` region count (the
    optimizer's gradient-norm reductions are not the plan's traffic).
    """
    tokens = batch // parallel.data * seq_len
    scanned = layers_looped(model)
    vals = dict(layer_fwd=0.0, layer_bwd=0.0, boundary_fwd=0.0, boundary_bwd=0.0,
                layer_fwd_bytes=0.0, layer_bwd_bytes=0.0, data=0.0, looped=scanned)
    for c in colls:
        if "shard_map" not in c.op_name:
            continue
        if c.axes == ("data",):
            vals["data"] += c.count * c.elements
        if c.axes != ("tensor",):
            continue
        way = "bwd" if c.backward else "fwd"
        if scanned and c.trips and c.trips[-1] == scanned:
            vals[f"layer_{way}"] += c.count * c.elements / (scanned * tokens)
            vals[f"layer_{way}_bytes"] += c.count * c.bytes / (scanned * tokens)
        else:
            vals[f"boundary_{way}"] += c.count * c.elements
    return Comm(**vals)
