"""Causal self-attention core with grouped-query attention (GQA), optionally over packed
sequences.

Works on whatever heads are local to the device: under tensor parallelism the caller passes the
``h/p`` query heads and ``n_kv/p`` key/value heads of its shard.

Packed rows (``Data.packing='document'``) hold several documents; :class:`Segments` says which
token belongs to which (``ids``, 0 = padding) and where it sits in its document
(``positions``). A token then attends only to earlier tokens of its own segment, and RoPE rotates
by its position in the document, so each document is computed exactly as if it were alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from boost_jax.models.rope import apply_rope, rope_tables


class Segments(NamedTuple):
    """Document layout of packed rows: ``ids`` and ``positions`` int32 ``[batch, seq]``
    (sharded like the tokens: on ``data``)."""

    ids: jax.Array
    positions: jax.Array


def segment_mask(segments: Segments | None) -> jax.Array | None:
    """``[batch, 1, seq, seq]`` bool: query and key in the same segment (``None``: no mask)."""
    if segments is None:
        return None
    ids = segments.ids
    return (ids[:, :, None] == ids[:, None, :])[:, None]


def _rotate(q: jax.Array, k: jax.Array, theta: float, segments: Segments | None):
    s, dh = q.shape[1], q.shape[3]
    positions = None if segments is None else segments.positions
    cos, sin = rope_tables(s, dh, theta, positions)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, theta: float,
                     segments: Segments | None = None) -> jax.Array:
    """RoPE + causal softmax attention (within segments when ``segments`` is given).

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]`` with ``heads % kv_heads == 0``.
      theta: RoPE base.
      segments: the packed rows' document layout, or ``None`` (one sequence per row).
    Returns:
      ``[batch, seq, heads * head_dim]``, in the dtype of ``q``.
    """
    b, s, h, dh = q.shape
    q, k = _rotate(q, k, theta, segments)
    out = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segments), is_causal=True)
    return out.reshape(b, s, h * dh).astype(q.dtype)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, theta: float,
                        segments: Segments | None = None) -> jax.Array:
    """Plain einsum implementation of :func:`causal_attention` (used by tests)."""
    b, s, h, dh = q.shape
    q, k = _rotate(q, k, theta, segments)
    rep = h // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    logits = logits / jnp.sqrt(dh)
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
    if segments is not None:
        mask = mask & segment_mask(segments)
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))
    return out.reshape(b, s, h * dh).astype(q.dtype)
