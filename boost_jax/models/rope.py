"""Rotary position embeddings in the Hugging Face LLaMA convention (rotate-half)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(seq_len: int, head_dim: int, theta: float, positions: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables (fp32): ``[1, seq_len, head_dim]`` for positions ``0..seq_len-1``, or
    ``[batch, seq_len, head_dim]`` for explicit int ``positions [batch, seq_len]`` (packed
    rows, where positions restart at each document)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if positions is None:
        positions = jnp.arange(seq_len)[None]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [batch, seq, heads, head_dim]`` by the tables of :func:`rope_tables`."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
