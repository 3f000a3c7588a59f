"""Causal self-attention core with grouped-query attention (GQA), optionally over packed
sequences.

Works on whatever heads are local to the device: under tensor parallelism the caller passes the
``h/p`` query heads and ``n_kv/p`` key/value heads of its shard.

Packed rows (``Data.packing='document'``) hold several documents; :class:`Segments` says which
token belongs to which (``ids``, 0 = padding) and where it sits in its document
(``positions``). A token then attends only to earlier tokens of its own segment, and RoPE rotates
by its position in the document, so each document is computed exactly as if it were alone.

On a GPU, ``Parallel.attention`` picks the core (:func:`resolve_attention`): cuDNN flash
attention through JAX's public API for unpacked rows; for packed rows, cuDNN's packed
("ragged") layout, which takes each row's segment offsets and lengths instead of a dense
``[batch, 1, seq, seq]`` mask (:func:`packed_layout`, boost_jax/compat.py
:func:`~boost_jax.compat.cudnn_packed_attention`); or XLA's attention.

Generation (models/decode.py) runs :func:`cached_attention`: new tokens at explicit positions
write their rotated keys and values into a per-layer cache and attend to every cached position
up to their own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from absl import logging

from boost_jax import compat, gpu_verified
from boost_jax.errors import ConfigError
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


def packed_slots(max_segments: int) -> int:
    """``M``, the runs of equal ids per packed row that cuDNN's packed path is built for: the
    row's documents, at most ``Data.max_segments`` (the packer's bound), and the padding at
    its end.

    A bound is needed because cuDNN's softmax statistics are ``[batch * M, heads, seq]`` fp32,
    as large as a dense mask when ``M ~ seq``; only ``seq`` would bound the runs otherwise (a
    one-token document is possible).
    """
    return max_segments + 1


def packed_layout(ids: jax.Array, bound: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed layout of rows whose segments are runs of equal ``ids``.

    Args:
      ids: int32 ``[batch, seq]`` segment ids (runs of equal id; 0 = padding, a run too).
      bound: ``M``, the static bound on runs per row.
    Returns:
      ``(seqlens, offsets, overflow)``: int32 ``[batch, M]`` run lengths then ``-1``; int32
      ``[batch, M + 1]`` run starts then ``-1``; bool ``[batch]``, rows with more than ``M``
      runs (only their first ``M`` are listed, so the other rows stay aligned).
    """
    b, s = ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [b, s]: each token's run
    count = run[:, -1] + 1
    slots = jnp.arange(bound, dtype=jnp.int32)
    lengths = jnp.sum(run[:, :, None] == slots, axis=1, dtype=jnp.int32)  # [b, M]
    listed = slots < count[:, None]
    seqlens = jnp.where(listed, lengths, -1)
    offsets = jnp.where(listed, jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths, -1)
    offsets = jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return seqlens, offsets, count > bound


def resolve_attention(choice: str, dtype, platform: str, bounded: bool = True
                      ) -> tuple[str, str]:
    """``Parallel.attention`` -> the implementations used, ``(unpacked rows, packed rows)``,
    each ``'xla'`` or ``'cudnn'``, for the compute ``dtype`` on ``platform``
    (``jax.default_backend()``).

    ``cudnn`` needs a GPU and a 16-bit dtype (ConfigError otherwise). ``auto`` on a GPU in a
    16-bit dtype takes cuDNN, as the Triton kernels are taken, only once its GPU parity test
    is recorded in boost_jax/gpu_verified.py: for unpacked rows ``cudnn_attention`` (JAX's
    public path), for packed rows also ``cudnn_packed_attention`` and only when they are
    ``bounded`` (``Data.max_segments`` set); else XLA. It logs its choice once.
    """
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if choice == "cudnn":
        if platform != "gpu":
            raise ConfigError("Parallel.attention='cudnn' needs a GPU (cuDNN flash attention); "
                              f"this host runs on {platform}: use 'auto' or 'xla'")
        if not half:
            raise ConfigError("Parallel.attention='cudnn' needs a 16-bit compute dtype: set "
                              "Train.dtype='bfloat16', or use 'auto' or 'xla'")
        return "cudnn", "cudnn"
    if choice == "auto":
        gpu_half = platform == "gpu" and half
        plain = gpu_verified.verified("cudnn_attention")
        unpacked = "cudnn" if gpu_half and plain else "xla"
        record = gpu_verified.verified("cudnn_packed_attention")
        packed = "cudnn" if unpacked == "cudnn" and record and bounded else "xla"
        no_record = " has no GPU parity record in boost_jax/gpu_verified.py"
        why = ("" if not gpu_half else f", cuDNN attention{no_record}" if not plain else
               f", cuDNN's packed path{no_record}" if not record else
               ", Data.max_segments is not set" if not bounded else
               f", its GPU parity test passed on {record.gpu} {record.date}")
        logging.log_first_n(logging.INFO, "Parallel.attention='auto': %s attention for "
                            "unpacked rows, %s for packed rows (%s, %s%s)", 1, unpacked,
                            packed, platform, jnp.dtype(dtype).name, why)
        return unpacked, packed
    return "xla", "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, theta: float,
                     segments: Segments | None = None, implementation: str = "xla",
                     bound: int | None = None) -> jax.Array:
    """RoPE + causal softmax attention (within segments when ``segments`` is given).

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k, v: ``[batch, seq, kv_heads, head_dim]`` with ``heads % kv_heads == 0``.
      theta: RoPE base.
      segments: the packed rows' document layout, or ``None`` (one sequence per row).
      implementation: ``xla`` or ``cudnn`` (flash attention on a GPU, 16-bit inputs; packed
        rows take cuDNN's packed layout, no dense mask: :func:`packed_layout`).
      bound: cuDNN's packed path: ``M``, the static bound on runs of equal ids per row
        (:func:`packed_slots`); a row with more (which the packer rules out) gets NaN
        outputs rather than wrong ones.
    Returns:
      ``[batch, seq, heads * head_dim]``, in the dtype of ``q``.
    """
    b, s, h, dh = q.shape
    q, k = _rotate(q, k, theta, segments)
    if implementation == "cudnn" and segments is not None:
        if bound is None:
            raise ValueError("cuDNN's packed attention needs the bound on segments per row")
        seqlens, offsets, overflow = packed_layout(segments.ids, bound)
        out = compat.cudnn_packed_attention(q, k, v, seqlens, offsets, scale=dh ** -0.5)
        out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
    else:
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
