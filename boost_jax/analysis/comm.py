"""Communication of a train step: the analytic prediction and the HLO measurement.

Elements are counted as :mod:`boost_jax.analysis.hlo` counts them (an all-reduce's array, a
reduce-scatter's full input, an all-gather's result). ``T`` is the number of tokens one
tensor-parallel group processes per step (``batch / data * seq_len``).

Tensor axis, per decoder layer per token (grouping on):

==========================  =======================================  ========================
plan                        forward                                  backward
==========================  =======================================  ========================
``fullrank``                ``2 d``  (o, down)                        ``2 d``  (qkv, gate/up)
``vanilla``                 ``3 d + 2 d_kv + 2 d_ff``                ``3 d + d_ff``
``vanilla`` LaX (gathered)  ``+ 3 r_a + r_a + 2 r_m + r_m``          ``+ 3 r_a + r_a + 2 r_m + r_m``
``btp`` online              ``(3 r_a + k) + r_a + (2 r_m + k) + r_m``  ``3 r_a + r_a + 2 r_m + r_m``
``btp`` sync                ``7 r`` + 2 statistics                   ``7 r`` + 2 statistics
==========================  =======================================  ========================

``k``: the online statistic's elements -- 1, or ``3 p`` under ``Parallel.norm_payload='lanes'``
with a bf16 payload (every rank's exact fp32 statistic as three bf16 lanes in its own slot,
parallel/online_rmsnorm.py).

``vanilla`` LaX: a crossing that needs the whole latent (a gate other than identity, or the
latent norm) all-gathers each projection's rank-split latent forward (grouping or not) and
all-reduces its cotangent backward (*f* at the slice each rank keeps; parallel/plans/vanilla.py).

Without grouping every member of q/k/v and gate/up has its own collective (the online
statistic then rides in each A factor's all-reduce). With ``Parallel.remat='full'`` the
backward pass recomputes each block and replays its forward collectives (all of them under
``btp``; under ``vanilla``/``fullrank`` all but the last, whose full-width output only the next
block reads); ``lowrank`` keeps every collective's output and replays none.

Per step, outside the layers: the vocab-parallel embedding (an all-reduce of ``[T, d]``, or
for ``btp`` a reduce-scatter into the residual shard whose backward is an all-gather), the
head's input (``fullrank``/``vanilla``: the backward all-reduce of ``[T, d]``; ``btp``: the
final norm's ``[T]`` statistic forward and backward -- it normalises the shards -- and the
all-gather of its output with its backward reduce-scatter), and the sharded cross-entropy's
three ``[T]`` reductions.

Pipelining (``pipe`` > 1): every device runs its stage's layers in each of the ``R M + S - 1``
iterations (bubbles included), on a microbatch at a time, and one ``ppermute`` of the
``[mb, seq, d_local]`` residual (``d/p`` under ``btp``) per iteration each way crosses the
``pipe`` axis. The boundaries run sharded over ``pipe`` (parallel/pipeline.py): each stage
embeds, normalises and runs the head and loss on ``T / S`` of the tokens, so the tensor-axis
boundary collectives above are on ``T / S`` tokens, and ``pipe`` carries four ``[T,
d_local]`` collectives more per step -- the all-gather of the embedded chunks (backward: its
reduce-scatter) and the reduce-scatter of the last stage's final residuals into each stage's
chunk (backward: its all-gather). Gradient accumulation (``Parallel.grad_accum = K``) runs
all of the above ``K`` times per step, on ``1/K`` of the tokens each.

Gradients and parameters over ``data`` (and ``pipe`` for what every stage holds), by
``Parallel.zero`` (:func:`gradient_transfers`): all-reduces, or ZeRO-1's reduce-scatters +
all-gather, or FSDP's per-layer gathers and reduce-scatters. Where: FSDP's layer collectives in
the layer loops; without pipelining or accumulation, stage 0's and 1's layer gradients too, one
layer at a time in the backward loop (``Transfer.in_loop``: under the next layer's backward);
everything else once per step, after the last micro-step. Every
gradient reduction sums in ``Parallel.reduce_dtype`` (fp32 by default); FSDP gathers the
parameters in the compute dtype, ZeRO-1 the updated fp32 slices. Two fp32 scalars: the loss
over ``data`` (and ``pipe``), the gradient norm over every axis -- with the stop flags riding
in the same all-reduce (:func:`scalar_transfers`). :func:`data_parallel_bytes` sums their
bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax

from boost_jax.analysis.hlo import Collective
from boost_jax.config import Model, Parallel
from boost_jax.parallel.online_rmsnorm import LANES
from boost_jax.parallel.plans.base import DATA, MESH_AXES, PIPE
from boost_jax.parallel.zero import Leaf


@dataclasses.dataclass(frozen=True)
class Comm:
    """Communication of one train step, per device.

    ``layer_fwd`` / ``layer_bwd`` (and ``*_bytes``): tensor-axis elements (bytes) one decoder
    layer sends per token it processes, forward and backward; known from the compiled HLO only
    when the layers run in a loop (``looped``: the layers per loop, 0 when XLA unrolled it).
    ``steps``: elements per step by mesh-axes group (``"tensor"``, ``"pipe"``, ``"data"``,
    ``"data,pipe"``, ...), every collective of the step -- the per-layer traffic times the
    layer executions, the boundaries, pipeline permutes, the gradient and parameter
    collectives of the zero stage and the two scalars.
    """

    layer_fwd: float
    layer_bwd: float
    layer_fwd_bytes: float
    layer_bwd_bytes: float
    looped: int
    steps: dict[str, float]


Collectives = list[tuple[float, int]]  # (elements per token, bytes per element)


def gathers_latents(model: Model) -> bool:
    """Does ``vanilla`` all-gather LaX's latents (a crossing that mixes the r coordinates: a
    gate other than identity, or the latent norm)?"""
    return model.arch == "lax" and (model.lax_gate != "identity" or model.lax_latent_norm)


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
        if gathers_latents(model):  # LaX: each latent gathered; f's all-reduce at its slice
            fwd, bwd = [3 * ra, ra, 2 * rm, rm] + fwd, [3 * ra, ra, 2 * rm, rm] + bwd
        fwd, bwd = [(w, act) for w in fwd], [(w, act) for w in bwd]
    else:  # btp: latents (+ the online statistic); f at every B input
        widths = [3 * ra, ra, 2 * rm, rm] if grouped else [ra] * 4 + [rm] * 3
        norms = (0, 2) if grouped else (0, 1, 2, 4, 5)  # the norm_down collectives
        bwd = [(w, act) for w in widths]
        if parallel.rmsnorm == "online":
            payload = 4 if parallel.norm_payload == "float32" else act
            # the statistic: one element, or exact bf16 lanes in a slot per rank
            stat = LANES * parallel.tensor if (payload < 4 and
                                               parallel.norm_payload == "lanes") else 1
            fwd = [(w + stat, payload) if i in norms else (w, act)
                   for i, w in enumerate(widths)]
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
    """How the layers run per device and step: ``tokens`` per layer execution (a micro-step's
    rows, or a pipeline microbatch of them), layer ``executions`` per step (accumulation
    micro-steps and bubble iterations included), ``iterations`` of the pipeline loop per pass
    (1 without), ``micro_steps`` (``Parallel.grad_accum``) and ``looped``: layers per compiled
    loop (0 if unrolled)."""
    k = parallel.grad_accum
    tokens = batch // parallel.data // k * seq_len
    loops = (k > 1) + (parallel.pipe > 1)  # loops around the layer loop
    if parallel.pipe == 1:
        scanned = model.n_layers - (1 if model.arch == "lax" else 0)  # LaX: block 0 before
        return dict(tokens=tokens, executions=k * model.n_layers, iterations=1, micro_steps=k,
                    looped=scanned if scanned > 1 else 0, depth=loops + 1)
    per_group = model.n_layers // (parallel.pipe * parallel.repeats)
    iterations = parallel.repeats * parallel.microbatches + parallel.pipe - 1
    return dict(tokens=tokens // parallel.microbatches, executions=k * iterations * per_group,
                iterations=iterations, micro_steps=k, looped=per_group if per_group > 1 else 0,
                depth=loops + 1)


def in_layer_loop(c: Collective, run: dict, first: bool = False) -> bool:
    """Does a compiled collective run in the layer loop (:func:`schedule`'s ``looped`` trips,
    nested in the accumulation and pipeline loops)? ``first``: or in the layer loop of the
    pipeline's first iteration when that runs before the pipeline loop (parallel/pipeline.py
    ``FIRST_ITERATION``: a copy of the layer loop, one loop shallower)."""
    from boost_jax.parallel.pipeline import FIRST_ITERATION

    if not run["looped"] or not c.trips or c.trips[-1] != run["looped"]:
        return False
    return len(c.trips) == run["depth"] or (
        first and len(c.trips) == run["depth"] - 1 and FIRST_ITERATION in c.op_name)


def pipelined_share(c: Collective, run: dict) -> float:
    """The share of one layer's run that a compiled collective moved by XLA's collective
    pipeliner is (the GPU compiler with the launchers' ``xla_gpu_enable_pipelined_*`` flags):
    it runs a layer loop collective of iteration ``i`` in iteration ``i + 1``, so the loop keeps
    it for ``looped - 1`` trips and one copy runs outside (before or after it). Such a
    collective has the layer scan's body in its op name (JAX's ``while/body``, as many times as
    the layer loop is deep) without the layer loop's trip count; its share is its runs per step
    over the layer loop's (``looped`` x the accumulation micro-steps). 0 for any other (and
    under a pipeline schedule, whose loops the pipeliner is not read for here)."""
    if not run["looped"] or run["iterations"] != 1 or in_layer_loop(c, run):
        return 0.0
    if c.op_name.count("while/body") != run["depth"]:
        return 0.0
    return c.count / (run["looped"] * run["micro_steps"])


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of data-parallel collective of a step: ``op``, the mesh ``axes`` (joined with
    ``,``), ``elements`` per step (counted as :mod:`boost_jax.analysis.hlo` counts them),
    ``group``: devices per collective, ``itemsize``: bytes per element, and ``in_loop``: it
    runs per layer inside a layer loop (where a GPU can overlap it with the neighbouring
    layers' compute), not once after the backward pass."""

    op: str
    axes: str
    elements: float
    group: int
    itemsize: int = 4
    in_loop: bool = False

    @property
    def bytes(self) -> float:
        return self.elements * self.itemsize


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def gradient_transfers(model: Model, parallel: Parallel, dtype: str = "float32"
                       ) -> list[Transfer]:
    """The gradient and parameter collectives of a step over ``data`` (and ``pipe`` for the
    parameters every stage holds) by ``Parallel.zero`` -- the rules of parallel/zero.py,
    counted per parameter (gradients reduced in ``Parallel.reduce_dtype``, FSDP's gathers in
    the compute ``dtype``, ZeRO-1's of the updated fp32 slices):

    * replicated (stage 0, or no dimension divides by ``data``): one all-reduce of the local
      gradient over the axes the parameter is replicated over, after accumulation;
    * ZeRO-1: a reduce-scatter over ``data`` (the all-reduce's bytes in half the wire time), an
      all-reduce of the slice over ``pipe`` if replicated there, and the all-gather of the
      updated slices (the other half); FSDP's non-layer parameters the same (gathered before
      the step's micro-steps instead of after the update);
    * stages 0 and 1 without pipelining or accumulation: a layer parameter's reduction is one
      collective per layer in the backward loop (the same bytes), except for what LaX's block
      0 leaves unused (its crossing: nothing to cross), whose zero gradient is not reduced;
    * FSDP's layer parameters: per micro-step, an all-gather where the layer runs, one more
      by its recomputation in the backward pass (for the layers in the compiled layer loop;
      outside a loop XLA merges the two), and the reduce-scatter of its gradient -- under
      pipelining in every one of the ``R M + S - 1`` iterations that runs the layer (bubbles
      included): ``(R M + S - 1) / R`` times the stage's parameters per micro-step.
    """
    from boost_jax.parallel.runner import data_layout

    k, sizes = parallel.grad_accum, dict(zip(MESH_AXES, parallel.shape))
    grad, act = _itemsize(parallel.reduce_dtype), _itemsize(dtype)
    layout = data_layout(model, parallel)
    run = schedule(model, parallel, parallel.data * k * parallel.microbatches, 1)
    # FSDP: a pipeline stage runs 1/R of its layers per iteration, gathering each again
    per_pass = run["iterations"] / parallel.repeats
    # layers outside a compiled loop (LaX's block 0, a loop XLA unrolled) gather once: XLA
    # merges the recomputation's gather with the forward one there -- not across the
    # pipeline's forward and backward loops
    looped = run["looped"]
    gathers = 2.0 if parallel.pipe > 1 else (2 * looped + (model.n_layers - looped)) / \
        model.n_layers
    out: list[Transfer] = []
    for path, lf in jax.tree_util.tree_leaves_with_path(
            layout.leaves, is_leaf=lambda x: isinstance(x, Leaf)):
        v = layout.local_size(lf)
        if layout.fsdp(lf) and lf.layer_dims:
            n = k * per_pass * v
            out += [Transfer("all-gather", DATA, gathers * n, parallel.data, act, True),
                    Transfer("reduce-scatter", DATA, n, parallel.data, grad, True)]
            continue
        looping = layout.reduced_in_loop(lf)
        reduced = v
        if looping and model.arch == "lax" and "crossing" in jax.tree_util.keystr(path):
            reduced = v * (model.n_layers - 1) / model.n_layers  # block 0 has no crossing
        if layout.sharded(lf):
            gathered = act if layout.fsdp(lf) else 4  # FSDP's parameters, ZeRO-1's updates
            out += [Transfer("reduce-scatter", DATA, reduced, parallel.data, grad, looping),
                    Transfer("all-gather", DATA, v, parallel.data, gathered)]
            if PIPE in lf.reduce:
                out.append(Transfer("all-reduce", PIPE, v / parallel.data, parallel.pipe, grad))
        elif lf.reduce:
            group = math.prod(sizes[a] for a in lf.reduce)
            out.append(Transfer("all-reduce", ",".join(lf.reduce), reduced, group, grad,
                                looping))
    return out


STOP_FLAGS = 2  # per-signal stop flags beside the squared norm (train/step.py STOP_SIGNALS)


def scalar_transfers(parallel: Parallel, packed: bool = False) -> list[Transfer]:
    """The step's scalar all-reduces: the loss over ``data`` (and ``pipe``), the global
    gradient norm over every axis (its all-reduce also sums the :data:`STOP_FLAGS` stop
    flags), and for packed rows the count of non-padding tokens over ``data`` (sizes > 1)."""
    sizes = dict(zip(MESH_AXES, parallel.shape))
    out = []
    for axes, width in ([((DATA,), 1)] * packed + [((DATA, PIPE), 1),
                                                    (MESH_AXES, 1 + STOP_FLAGS)]):
        kept = tuple(a for a in axes if sizes[a] > 1)
        if kept:
            out.append(Transfer("all-reduce", ",".join(kept), width,
                                math.prod(sizes[a] for a in kept)))
    return out


def data_parallel_bytes(model: Model, parallel: Parallel, dtype: str = "float32",
                        packed: bool = False) -> dict[str, float]:
    """Bytes per step, by mesh-axes group, of :func:`gradient_transfers` (compute ``dtype``)
    and :func:`scalar_transfers`; the ``data`` group holds every collective of the step over
    ``data`` alone."""
    out: dict[str, float] = collections.defaultdict(float)
    for t in gradient_transfers(model, parallel, dtype) + scalar_transfers(parallel, packed):
        out[t.axes] += t.bytes
    return dict(out)


def predict(model: Model, parallel: Parallel, batch: int, seq_len: int, dtype: str,
            packed: bool = False) -> Comm:
    """The analytic communication of a train step (see the module docstring; ``packed``:
    document-packed rows)."""
    run = schedule(model, parallel, batch, seq_len)
    k = run["micro_steps"]
    tokens = batch // parallel.data * seq_len
    fwd_list, bwd_list = layer_collectives(model, parallel, dtype)
    fwd, bwd = sum(e for e, _ in fwd_list), sum(e for e, _ in bwd_list)
    fwd_bytes = sum(e * b for e, b in fwd_list)
    bwd_bytes = sum(e * b for e, b in bwd_list)
    d = model.d_model
    steps: dict[str, float] = collections.defaultdict(float)
    edge = tokens // parallel.pipe  # tokens of the boundaries (a stage's share when pipelined)
    if parallel.tensor > 1:
        boundary = 2 * edge * d + 3 * edge  # embedding and head input, sharded CE
        if parallel.tp_plan == "btp":  # reduce-scatter/all-gather pairs, final norm statistic
            boundary = 4 * edge * d + 3 * edge + 2 * edge
        steps["tensor"] = (fwd + bwd) * run["tokens"] * run["executions"] + boundary
    if parallel.pipe > 1:  # the residual (shard) of a microbatch moves forward and back
        d_local = d // parallel.tensor if parallel.tp_plan == "btp" else d
        steps["pipe"] += 2 * k * run["iterations"] * run["tokens"] * d_local
        # the embedded chunks all-gathered, the final residuals reduce-scattered (and back)
        steps["pipe"] += 4 * tokens * d_local
    for t in gradient_transfers(model, parallel) + scalar_transfers(parallel, packed):
        steps[t.axes] += t.elements
    return Comm(fwd, bwd, fwd_bytes, bwd_bytes, run["looped"], dict(steps))


def local_parameters(model: Model, parallel: Parallel) -> tuple[int, int]:
    """Parameters one device holds before any ``data`` split: ``(block parameters of its
    stage, the others)``."""
    from boost_jax.parallel.runner import data_layout

    layout = data_layout(model, parallel)
    stage_local = global_local = 0
    for lf in layout.items():
        if lf.layer_dims:
            stage_local += layout.local_size(lf)
        else:
            global_local += layout.local_size(lf)
    return stage_local, global_local


def measure(colls: list[Collective], model: Model, parallel: Parallel, batch: int,
            seq_len: int) -> Comm:
    """The same quantities read from compiled-HLO collectives (:func:`hlo.collectives`): every
    collective of the step counts.

    Layer collectives are the tensor-axis ones inside a ``while`` loop whose trip count is the
    number of layers per loop, and those XLA's collective pipeliner moved partly out of it
    (:func:`pipelined_share`).
    """
    run = schedule(model, parallel, batch, seq_len)
    looped = run["looped"]
    layer = dict(fwd=0.0, bwd=0.0, fwd_bytes=0.0, bwd_bytes=0.0)
    steps: dict[str, float] = collections.defaultdict(float)
    for c in colls:
        if not c.axes:  # size-1 groups: nothing moves
            continue
        steps[",".join(c.axes)] += c.count * c.elements
        share = 1.0 if in_layer_loop(c, run) else pipelined_share(c, run)
        if c.axes == ("tensor",) and share:
            way = "bwd" if c.backward else "fwd"
            layer[way] += share * c.elements / run["tokens"]
            layer[f"{way}_bytes"] += share * c.bytes / run["tokens"]
    return Comm(layer["fwd"], layer["bwd"], layer["fwd_bytes"], layer["bwd_bytes"], looped,
                dict(steps))
