"""Vocab-parallel embedding lookup and cross-entropy over the ``tensor`` axis.

Rank ``i`` of ``p`` holds vocabulary rows ``[i V/p, (i+1) V/p)`` of the embedding table and the
matching columns of the LM head. Per token, the loss needs three ``[b, s]`` reductions (max,
sum of exponentials, target logit); the logits themselves stay sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

TENSOR = "tensor"


def _local_ids(tokens: jax.Array, vocab_local: int) -> tuple[jax.Array, jax.Array]:
    """Token ids relative to this rank's vocabulary slice, and whether they fall in it."""
    ids = tokens - lax.axis_index(TENSOR) * vocab_local
    inside = (ids >= 0) & (ids < vocab_local)
    return jnp.clip(ids, 0, vocab_local - 1), inside


def vocab_embed(tokens: jax.Array, table: jax.Array, scatter: bool) -> jax.Array:
    """Embedding lookup with ``table [V/p, d]`` sharded on the vocabulary.

    Returns the full rows ``[b, s, d]`` (one all-reduce) or, with ``scatter``, this rank's
    ``[b, s, d/p]`` column block (one reduce-scatter: half the all-reduce's traffic; its
    backward pass is the matching all-gather).
    """
    ids, inside = _local_ids(tokens, table.shape[0])
    rows = jnp.where(inside[..., None], jnp.take(table, ids, axis=0), 0).astype(table.dtype)
    if scatter:
        return lax.psum_scatter(rows, TENSOR, scatter_dimension=rows.ndim - 1, tiled=True)
    return lax.psum(rows, TENSOR)


def vocab_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy ``[b, s]`` (fp32) from vocab-sharded ``logits [b, s, V/p]``."""
    logits = logits.astype(jnp.float32)
    # the max only stabilises the exponentials: no gradient flows through it
    peak = lax.pmax(jnp.max(lax.stop_gradient(logits), axis=-1), TENSOR)
    sum_exp = lax.psum(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1), TENSOR)
    ids, inside = _local_ids(targets, logits.shape[-1])
    target = jnp.take_along_axis(logits, ids[..., None], axis=-1)[..., 0]
    target = lax.psum(jnp.where(inside, target, 0.0), TENSOR)
    return jnp.log(sum_exp) + peak - target
