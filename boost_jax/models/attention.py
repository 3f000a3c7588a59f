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
                     cache_v: jax.Array, layer: jax.Array | int, positions: jax.Array,
                     theta: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE + softmax attention of new tokens over a key/value cache they are written into.

    Row ``i``'s new tokens sit at the consecutive positions ``positions[i, 0] + j``; their
    rotated keys and values are written there in layer ``layer`` of the caches (in place: the
    caches of every layer travel together, so a loop over the layers updates one buffer), then
    each token attends to its layer's cached positions up to its own. Positions past a row's
    tokens hold stale values that the mask hides until they are overwritten.

    Args:
      q: ``[batch, s, heads, head_dim]``; k, v: ``[batch, s, kv_heads, head_dim]``.
      cache_k, cache_v: every layer's ``[n_layers, batch, kv_heads, max_len, head_dim]``
        (rotated keys; position-major per head, as the attention products read them).
      layer: this layer's index (int32, may be traced).
      positions: int ``[batch, s]``, consecutive in each row, ``positions[:, -1] < max_len``.
      theta: RoPE base.
    Returns:
      ``(out [batch, s, heads * head_dim] in q's dtype, cache_k, cache_v)``, the caches updated.
    """
    b, s, h, dh = q.shape
    cos, sin = rope_tables(s, dh, theta, positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    zero = jnp.zeros((), jnp.int32)
    for i in range(b):  # one in-place slab write per row (a scatter would rewrite the cache)
        at = (jnp.asarray(layer, jnp.int32), jnp.int32(i), zero, positions[i, 0], zero)
        cache_k = jax.lax.dynamic_update_slice(
            cache_k, k[i].swapaxes(0, 1)[None, None].astype(cache_k.dtype), at)
        cache_v = jax.lax.dynamic_update_slice(
            cache_v, v[i].swapaxes(0, 1)[None, None].astype(cache_v.dtype), at)
    keys, values = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False).astype(q.dtype)
                    for c in (cache_k, cache_v))  # [b, kv_heads, max_len, head_dim]
    kv = keys.shape[1]
    grouped = q.reshape(b, s, kv, h // kv, dh)  # GQA: the query heads of each kv head
    scores = jnp.einsum("bqgrd,bgkd->bgrqk", grouped, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(dh)
    mask = jnp.arange(keys.shape[2])[None, None, :] <= positions[:, :, None]  # [b, s, max_len]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bgrqk,bgkd->bqgrd", probs.astype(values.dtype), values)
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
