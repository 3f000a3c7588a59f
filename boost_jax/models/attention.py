"""Causal self-attention core with grouped-query attention (GQA), optionally over packed
sequences.

Works on whatever heads are local to the device: under tensor parallelism the caller passes the
``h/p`` query heads and ``n_kv/p`` key/value heads of its shard.

Packed rows (``Data.packing='document'``) hold several documents; :class:`Segments` says which
token belongs to which (``ids``, 0 = padding) and where it sits in its document
(``positions``). A token then attends only to earlier tokens of its own segment, and RoPE rotates
by its position in the document, so each document is computed exactly as if it were alone.

Generation (models/decode.py) runs :func:`cached_attention`: new tokens at explicit positions
write their rotated keys and values into a per-layer cache and attend to every cached position
up to their own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from absl import logging

from boost_jax.config import ConfigError
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


def resolve_attention(choice: str, dtype, platform: str) -> str:
    """``Parallel.attention`` -> the implementation used (``'xla'`` or ``'cudnn'``) for the
    compute ``dtype`` on ``platform`` (``jax.default_backend()``); ``auto`` logs its choice."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if choice == "cudnn":
        if platform != "gpu":
            raise ConfigError("Parallel.attention='cudnn' needs a GPU (cuDNN flash attention); "
                              f"this host runs on {platform}: use 'auto' or 'xla'")
        if not half:
            raise ConfigError("Parallel.attention='cudnn' needs a 16-bit compute dtype: set "
                              "Train.dtype='bfloat16', or use 'auto' or 'xla'")
        return "cudnn"
    if choice == "auto":
        impl = "cudnn" if platform == "gpu" and half else "xla"
        logging.log_first_n(logging.INFO, "Parallel.attention='auto': %s attention (%s, %s)",
                            1, impl, platform, jnp.dtype(dtype).name)
        return impl
    return "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, theta: float,
                     segments: Segments | None = None, implementation: str = "xla"
                     ) -> jax.Array:
    """RoPE + causal softmax attention (within segments when ``segments`` is given).

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]`` with ``heads % kv_heads == 0``.
      theta: RoPE base.
      segments: the packed rows' document layout, or ``None`` (one sequence per row).
      implementation: ``xla`` or ``cudnn`` (flash attention on a GPU, 16-bit inputs; packed
        rows pass their ``[batch, 1, seq, seq]`` segment mask to it).
    Returns:
      ``[batch, seq, heads * head_dim]``, in the dtype of ``q``.
    """
    b, s, h, dh = q.shape
    q, k = _rotate(q, k, theta, segments)
    out = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segments), is_causal=True,
                                       implementation=None if implementation == "xla"
                                       else implementation)
    return out.reshape(b, s, h * dh).astype(q.dtype)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array,
                     cache_v: jax.Array, positions: jax.Array, theta: float
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE + softmax attention of new tokens over a key/value cache they are written into.

    Row ``i``'s new tokens sit at the consecutive positions ``positions[i, 0] + j``; their
    rotated keys and values are written there (``lax.dynamic_update_slice``), then each attends
    to the cached positions up to its own. Positions past a row's tokens hold stale values that
    the mask hides until they are overwritten.

    Args:
      q: ``[batch, s, heads, head_dim]``; k, v: ``[batch, s, kv_heads, head_dim]``.
      cache_k, cache_v: ``[batch, max_len, kv_heads, head_dim]`` (rotated keys).
      positions: int ``[batch, s]``, consecutive in each row, ``positions[:, -1] < max_len``.
      theta: RoPE base.
    Returns:
      ``(out [batch, s, heads * head_dim] in q's dtype, cache_k, cache_v)``, the caches updated.
    """
    b, s, h, dh = q.shape
    cos, sin = rope_tables(s, dh, theta, positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write = jax.vmap(lambda c, new, start: jax.lax.dynamic_update_slice(c, new, (start, 0, 0)))
    start = positions[:, 0]
    cache_k = write(cache_k, k.astype(cache_k.dtype), start)
    cache_v = write(cache_v, v.astype(cache_v.dtype), start)
    keys = jnp.arange(cache_k.shape[1])
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [b, 1, s, max_len]
    out = jax.nn.dot_product_attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
                                       mask=mask)
    return out.reshape(b, s, h * dh).astype(q.dtype), cache_k, cache_v


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
