"""Pipeline parallelism over the ``pipe`` mesh axis: GPipe and the circular schedule, inside the
model's one ``shard_map`` region.

Layout. The ``L`` decoder blocks are split into ``S`` stages; with ``R`` repeats (circular) each
stage holds ``R`` groups of ``L / (S R)`` consecutive layers, group ``r`` of stage ``s`` being
layers ``r L/R + s L/(S R) ...`` -- the stacked block parameters are laid out
``[R, L/R, ...]`` with the second axis split over ``pipe`` (``[L, ...]`` when ``R = 1``), so
every stage holds its own layers and no layer parameter is replicated over ``pipe``.

Schedule. A data shard's batch is cut into ``M`` microbatches. At iteration ``i`` stage ``s``
works on item ``g = i - s`` (microbatch ``g mod M``, repeat ``g div M``) if ``0 <= g < R M``;
its output moves to stage ``s + 1`` with one ``ppermute`` -- under ``btp`` that is the
``[mb, seq, d/p]`` residual shard, ``p`` times less than a replicated residual. Stage 0 takes
a fresh microbatch for repeat 0 and, for later repeats, the microbatch the last stage sent
back around the ring (kept in a buffer until its turn, which needs ``M >= S``). ``R M + S - 1``
iterations in all: the bubble is ``(S - 1) / (R M + S - 1)``. Every stage runs every
iteration; idle ones compute on zeros whose results are discarded.

Memory. The backward pass keeps every iteration's activations, the bubbles' included --
``R M + S - 1`` microbatches' worth per stage, where 1F1B keeps at most ``S`` -- and, without
FSDP, one iteration's more: XLA builds an iteration's layer-loop residuals in a buffer of their
own and copies them into this loop's stacked residuals (the paper's 13B TP4xPP2 row compiled
for A100s holds three passes' activations at ``M = 1``: docs/BENCHMARKS.md, ``bench memory``).
Unrolling this loop in Python removes that copy but keeps a stage-sized gradient buffer per
iteration instead (measured, issue 45): not done. The stage's parameters are never kept per
iteration: GPipe uses its layers as they are; the circular schedule (repeat ``rep``'s layers)
and FSDP (whose gathers would be hoisted out of the loop from loop-invariant layers) slice each
layer inside its checkpointed block (``Decoder.run_blocks``' ``repeat``), so the backward pass
slices it again (the 30B TP4xPP4 row with FSDP over data=2, compiled for A100s: 20.4 -> 9.3
GiB per device; ``tests/parallel/test_pipeline.py``).

Gradient reduction (GPipe at zero stages 0 and 1, no accumulation). Iteration 0 runs before
the loop: it casts each layer through ``execution.layer_params(..., keep=True)`` and the
loop's iterations use the kept casts (``execution.prepared()``). Iteration 0 is the last one of
the backward pass, and the later iterations' cotangents reach the kept casts first, so each
layer's gradient is complete in iteration 0's backward and reduced over ``data`` there, layer
by layer, under the backward of the layers below it (parallel/zero.py ``in_loop``). Stages
other than 0 are idle in iteration 0 (their cotangents there are zeros), yet they run its
backward like every other iteration, so their reductions hide under it too.

Boundaries. The embedding, the final norm, the head and the loss are per-token work, run
sharded over ``pipe`` (as MaxText runs its non-pipelined layers): the data shard's ``b s``
tokens are cut into ``S`` equal chunks (``Config`` checks that ``S`` divides ``b s``), and stage
``s`` handles chunk ``s`` only. Each stage embeds its chunk (the plan's collective included) and
one tiled ``all_gather`` over ``pipe`` rebuilds the ``[b, s, d_local]`` residual that stage 0
feeds in; the last stage's outputs buffer (zeros on the other stages) is ``psum_scatter``-ed
over ``pipe``, so that each stage runs the final norm, the LM head and the cross-entropy on
the final residuals of its own chunk, and returns their losses at its chunk's positions of
``[b, s]``, zeros elsewhere. Over the ``S`` stages the head GEMM runs once per token, and no
conditional on the stage index is needed. The transposes -- a reduce-scatter of the
embedding's cotangent, an all-gather of the head input's, and those of ``ppermute`` --
carry the gradients back through the stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from boost_jax.compat import varying_axes
from boost_jax.models.attention import Segments
from boost_jax.models.boundaries import Plan
from boost_jax.models.decoder import Decoder
from boost_jax.models.execution import Execution
from boost_jax.parallel.plans.base import PIPE

#: the name scope of the pipeline's first iteration when it runs before the loop (its layer
#: loop is one loop shallower than the other iterations'; analysis/comm.py finds it by name)
FIRST_ITERATION = "pipeline_first_iteration"


def stage_layout(x: jax.Array, repeats: int) -> jax.Array:
    """Stacked block parameter ``[L, ...]`` -> the pipeline layout ``[R, L/R, ...]``."""
    return x if repeats == 1 else x.reshape(repeats, x.shape[0] // repeats, *x.shape[1:])


def canonical_layout(x: jax.Array, repeats: int) -> jax.Array:
    """Inverse of :func:`stage_layout`."""
    return x if repeats == 1 else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def pipeline_token_loss(model: Decoder, plan: Plan, execution: Execution, inputs: jax.Array,
                        targets: jax.Array, microbatches: int, repeats: int,
                        segments: Segments | None = None) -> jax.Array:
    """Per-token loss ``[b, s]`` of this data shard: on stage ``k``, the losses of the
    ``k``-th of ``S`` chunks of its ``b s`` tokens (row-major), zero elsewhere.

    ``inputs``/``targets`` ``[b, s]`` are this data shard's rows; ``model`` holds this
    stage's block parameters in the :func:`stage_layout`. ``segments`` (packed rows): every
    stage holds the whole data shard's, and takes those of the microbatch it works on.
    """
    stages, stage = lax.axis_size(PIPE), lax.axis_index(PIPE)
    b, s = inputs.shape
    m_count, mb = microbatches, b // microbatches
    chunk = b * s // stages
    if chunk * stages != b * s:
        raise ValueError(f"pipe={stages} stages do not divide the data shard's {b}x{s} tokens")
    start = stage * chunk

    def mine(x):  # this stage's chunk of a per-token array: [b, s, ...] -> [1, chunk, ...]
        x = x.reshape(1, b * s, *x.shape[2:])
        return lax.dynamic_slice_in_dim(_vary(x), start, chunk, axis=1)

    # each stage embeds its chunk; the all-gather (backward: reduce-scatter) rebuilds the rows
    own = model.embed_tokens(mine(inputs), plan)  # [1, chunk, d_loc]
    fresh = lax.all_gather(own, PIPE, axis=1, tiled=True)
    fresh = fresh.reshape(m_count, mb, s, -1)  # [M, mb, s, d_loc]
    if segments is not None:  # [M, mb, s] each
        segments = Segments(*(x.reshape(m_count, mb, s) for x in segments))
    _, blocks = nnx.split(model.blocks)
    sliced = repeats > 1 or execution.layer_gathers  # run_blocks slices each layer (below)
    if repeats == 1 and execution.layer_gathers:
        blocks = jax.tree.map(lambda x: x[None], blocks)
    zeros = fresh * 0  # carries with the values' varying-axes type
    forward = [(k, k + 1) for k in range(stages - 1)]
    ring = forward + ([(stages - 1, 0)] if repeats > 1 else [])
    items = repeats * m_count

    def iteration(carry, i, layers, execution, keep=False):
        received, waiting, outputs = carry
        g = jnp.clip(i - stage, 0, items - 1)
        mbatch, rep = g % m_count, g // m_count
        first_in = jnp.where(rep == 0, fresh[mbatch], waiting[mbatch])
        x = jnp.where(stage == 0, first_in, received)
        # GPipe: the stage's layers as they are. The circular schedule takes repeat `rep`'s
        # layers, and FSDP too (`rep` = 0): a gather of loop-invariant parameters would be
        # hoisted out of the loop, holding the whole stage gathered. Each layer is sliced
        # inside its checkpointed block (run_blocks' `repeat`): a slice taken here would be
        # kept for the backward pass once per iteration, a copy of the stage's parameters.
        seg = None if segments is None else Segments(*(x[mbatch] for x in segments))
        y = model.run_blocks(x, plan, execution, layers, seg, keep,
                             repeat=rep if sliced else None)
        y, kept = y if keep else (y, None)
        done = (i - stage >= 0) & (stage == stages - 1) & (rep == repeats - 1)
        outputs = outputs.at[mbatch].set(jnp.where(done, y, outputs[mbatch]))
        received = lax.ppermute(y, PIPE, ring)
        if repeats > 1:  # stage 0 keeps what comes back around the ring for its next repeat
            back = i - (stages - 1)
            bm, brep = jnp.clip(back, 0, items - 1) % m_count, back // m_count
            keep = (stage == 0) & (back >= 0) & (brep < repeats - 1)
            waiting = waiting.at[bm].set(jnp.where(keep, received, waiting[bm]))
        return (received, waiting, outputs), kept

    carry, first, later = (zeros[0], zeros, zeros), 0, execution
    if execution.reduces_in_loop:  # GPipe (runner.reduces_in_loop)
        # iteration 0, the last in the backward pass, casts the layers and keeps the casts for
        # the later iterations: their cotangents reach it summed, and each layer's gradient is
        # reduced over data in this iteration's backward, layer by layer (parallel/zero.py)
        with jax.named_scope(FIRST_ITERATION):
            carry, blocks = iteration(carry, 0, blocks, execution, keep=True)
        first, later = 1, execution.prepared()
    (_, _, outputs), _ = lax.scan(lambda c, i: (iteration(c, i, blocks, later)[0], None), carry,
                                  jnp.arange(first, items + stages - 1))
    # the last stage's final residuals (zeros elsewhere), each stage's chunk of them
    final = lax.psum_scatter(outputs.reshape(1, b * s, -1), PIPE, scatter_dimension=1,
                             tiled=True)  # [1, chunk, d_loc]
    per_token = model.hidden_loss(model.finish(final, plan), mine(targets), plan)
    out = jnp.zeros((1, b * s), per_token.dtype)
    return lax.dynamic_update_slice_in_dim(_vary(out), per_token, start, axis=1).reshape(b, s)


def _vary(x: jax.Array) -> jax.Array:
    """``x`` typed as varying over ``pipe``: a per-token array about to be sliced or updated at
    this stage's (pipe-varying) chunk."""
    return x if PIPE in varying_axes(x) else lax.pcast(x, (PIPE,), to="varying")
