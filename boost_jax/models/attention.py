"""Causal self-attention core with grouped-query attention (GQA).

Works on whatever heads are local to the device: under tensor parallelism the caller passes the
``h/p`` query heads and ``n_kv/p`` key/value heads of its shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from boost_jax.models.rope import apply_rope, rope_tables


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, theta: float) -> jax.Array:
    """RoPE + causal softmax attention.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]`` with ``heads % kv_heads == 0``.
      theta: RoPE base.
    Returns:
      ``[batch, seq, heads * head_dim]``, in the dtype of ``q``.
    """
    b, s, h, dh = q.shape
    cos, sin = rope_tables(s, dh, theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return out.reshape(b, s, h * dh).astype(q.dtype)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, theta: float) -> jax.Array:
    """Plain einsum implementation of :func:`causal_attention` (used by tests)."""
    b, s, h, dh = q.shape
    cos, sin = rope_tables(s, dh, theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = h // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    logits = logits / jnp.sqrt(dh)
    mask = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))
    return out.reshape(b, s, h * dh).astype(q.dtype)
