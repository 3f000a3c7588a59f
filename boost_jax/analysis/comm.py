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
cross-entropy's three ``[T]`` reductions.

Pipelining (``pipe`` > 1 or several microbatches): every device runs its stage's layers in
each of the ``R M + S - 1`` iterations (bubbles included), on a microbatch at a time, and one
``ppermute`` of the ``[mb, seq, d_local]`` residual (``d/p`` under ``btp``) per iteration each
way crosses the ``pipe`` axis. Gradients: one all-reduce per step of the local block
parameters over ``data``, and one of the parameters replicated over ``pipe`` (embedding, head,
final norm) plus the loss over ``data`` and ``pipe``.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from boost_jax.analysis.hlo import Collective
from boost_jax.config import Model, Parallel
from boost_jax.models.decoder import abstract_model
from boost_jax.parallel.plans import get_plan


@dataclasses.dataclass(frozen=True)
class Comm:
    """Communication of one train step, per device.

    ``layer_fwd`` / ``layer_bwd`` (and ``*_bytes``): tensor-axis elements (bytes) one decoder
    layer sends per token it processes, forward and backward; known from the compiled HLO only
    when the layers run in a loop (``looped``: the layers per loop, 0 when XLA unrolled it).
    ``steps``: elements per step by mesh-axes group (``"tensor"``, ``"pipe"``, ``"data"``,
    ``"data,pipe"``), counting only the model's collectives -- the per-layer traffic times the
    layer executions, the boundaries, pipeline permutes and gradient reductions.
    """

    layer_fwd: float
    layer_bwd: float
    layer_fwd_bytes: float
    layer_bwd_bytes: float
    looped: int
    steps: dict[str, float]


Collectives = list[tuple[float, int]]  # (elements per token, bytes per element)


def layer_collectives(model: Model, parallel: Parallel, dtype: str = "float32"
                      ) -> tuple[Collectives, Collectives]:
    """The tensor-axis collectives of one decoder layer, forward and backward: elements per
    token and bytes per element of each (the sizes the performance model times; their sums
    are the table above)."""
    d, dkv, dff, ra, rm = model.d_model, model.d_kv, model.d_ff, model.attn_rank, model.mlp_rank
    act = 2 if dtype == "bfloat16" else 4
    grouped = parallel.grouping
    plan = parallel.tp_plan if parallel.tensor > 1 else "none"
    if plan == "none":
        return [], []
    if plan == "fullrank":  # g after o and down; f at the q/k/v and gate/up inputs
        fwd, bwd = [d, d], ([d, d] if grouped else [d] * 5)
        fwd, bwd = [(w, act) for w in fwd], [(w, act) for w in bwd]
    elif plan == "vanilla":  # every B output; f at every A input
        fwd = [d, 2 * dkv, d, 2 * dff, d] if grouped else [d, dkv, dkv, d, dff, dff, d]
        bwd = [d, d, d, dff] if grouped else [d] * 6 + [dff]
        fwd, bwd = [(w, act) for w in fwd], [(w, act) for w in bwd]
    else:  # btp: latents (+ the online statistic); f at every B input
        widths = [3 * ra, ra, 2 * rm, rm] if grouped else [ra] * 4 + [rm] * 3
        norms = (0, 2) if grouped else (0, 1, 2, 4, 5)  # the norm_down collectives
        bwd = [(w, act) for w in widths]
        if parallel.rmsnorm == "online":
            payload = 4 if parallel.norm_payload == "float32" else act
            fwd = [(w + 1, payload) if i in norms else (w, act) for i, w in enumerate(widths)]
        else:  # sync: the statistic's fp32 all-reduce, once per norm (the members' copies are
            # one value), and in the backward pass one per norm_down (their cotangents differ)
            fwd = [(w, act) for w in widths] + [(1, 4)] * 2
            bwd = bwd + [(1, 4)] * len(norms)
    if parallel.remat == "full":
        # the recomputed forward replays its collectives, except the last one (down's output,
        # which only the next block reads) when it is full-width (vanilla, fullrank)
        bwd = bwd + (fwd if plan == "btp" else fwd[:-1])
    return fwd, bwd


def schedule(model: Model, parallel: Parallel, batch: int, seq_len: int) -> dict[str, int]:
    """How the layers run per device and step: ``tokens`` per layer execution (a microbatch
    under pipelining), layer ``executions`` (bubble iterations included), ``iterations`` of the
    pipeline loop (1 without), and ``looped``: layers per compiled loop (0 if unrolled)."""
    tokens = batch // parallel.data * seq_len
    if parallel.pipe == 1 and parallel.microbatches == 1:
        scanned = model.n_layers - (1 if model.arch == "lax" else 0)  # LaX: block 0 before
        return dict(tokens=tokens, executions=model.n_layers, iterations=1,
                    looped=scanned if scanned > 1 else 0)
    per_group = model.n_layers // (parallel.pipe * parallel.repeats)
    iterations = parallel.repeats * parallel.microbatches + parallel.pipe - 1
    return dict(tokens=tokens // parallel.microbatches, executions=iterations * per_group,
                iterations=iterations, looped=per_group if per_group > 1 else 0)


def _axes(*pairs: tuple[str, int]) -> str:
    return ",".join(name for name, size in pairs if size > 1)


def predict(model: Model, parallel: Parallel, batch: int, seq_len: int, dtype: str
            ) -> Comm:
    """The analytic communication of a train step (see the module docstring)."""
    tokens = batch // parallel.data * seq_len
    run = schedule(model, parallel, batch, seq_len)
    fwd_list, bwd_list = layer_collectives(model, parallel, dtype)
    fwd, bwd = sum(e for e, _ in fwd_list), sum(e for e, _ in bwd_list)
    fwd_bytes = sum(e * b for e, b in fwd_list)
    bwd_bytes = sum(e * b for e, b in bwd_list)
    d = model.d_model
    steps: dict[str, float] = collections.defaultdict(float)
    if parallel.tensor > 1:
        boundary = 2 * tokens * d + 3 * tokens  # embedding and head input, sharded CE
        if parallel.tp_plan == "btp":  # reduce-scatter/all-gather pairs, final norm gain
            boundary = 4 * tokens * d + 3 * tokens + d
        steps["tensor"] = (fwd + bwd) * run["tokens"] * run["executions"] + boundary
    if parallel.pipe > 1:  # the residual (shard) of a microbatch moves forward and back
        d_local = d // parallel.tensor if parallel.tp_plan == "btp" else d
        steps["pipe"] += 2 * run["iterations"] * run["tokens"] * d_local
    stage_local, global_local = local_parameters(model, parallel)
    if parallel.data > 1:
        steps["data"] += stage_local
    if (key := _axes(("data", parallel.data), ("pipe", parallel.pipe))):
        steps[key] += global_local + 1  # + the loss
    return Comm(fwd, bwd, fwd_bytes, bwd_bytes, run["looped"], dict(steps))


def local_parameters(model: Model, parallel: Parallel) -> tuple[int, int]:
    """Parameters one device holds: ``(block parameters of its stage, the others)``."""
    plan = get_plan(parallel)
    stage_local = global_local = 0
    for spec_def in abstract_model(model)[1].values():
        split = math.prod(parallel.tensor for a in plan.spec(spec_def.axes) if a is not None)
        size = math.prod(spec_def.shape) // split
        if spec_def.stacked:
            stage_local += size // parallel.pipe
        else:
            global_local += size
    return stage_local, global_local


def measure(colls: list[Collective], model: Model, parallel: Parallel, batch: int,
            seq_len: int, model_only: bool = True) -> Comm:
    """The same quantities read from compiled-HLO collectives (:func:`hlo.collectives`).

    Layer collectives are the tensor-axis ones inside a ``while`` loop whose trip count is the
    number of layers per loop. With ``model_only`` only collectives of the model's
    ``shard_map`` region count (the optimizer's reductions are not the plan's traffic); a GSPMD
    program has no such region, so everything counts there.
    """
    run = schedule(model, parallel, batch, seq_len)
    looped = run["looped"]
    layer = dict(fwd=0.0, bwd=0.0, fwd_bytes=0.0, bwd_bytes=0.0)
    steps: dict[str, float] = collections.defaultdict(float)
    for c in colls:
        if (model_only and "shard_map" not in c.op_name) or not c.axes:  # size-1 groups: none
            continue
        steps[",".join(c.axes)] += c.count * c.elements
        if c.axes == ("tensor",) and looped and c.trips and c.trips[-1] == looped:
            way = "bwd" if c.backward else "fwd"
            layer[way] += c.elements / run["tokens"]
            layer[f"{way}_bytes"] += c.bytes / run["tokens"]
    return Comm(layer["fwd"], layer["bwd"], layer["fwd_bytes"], layer["bwd_bytes"], looped,
                dict(steps))
