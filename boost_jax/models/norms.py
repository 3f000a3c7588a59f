"""RMSNorm (the residual stream) and LayerNorm (LaX's optional r-dim latent norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_squares(x: jax.Array) -> jax.Array:
    """Per-token sum of squares in fp32: ``[..., d] -> [..., 1]``."""
    xf = x.astype(jnp.float32)
    return jnp.sum(xf * xf, axis=-1, keepdims=True)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last dim, statistics in fp32."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last dim (mean and variance in fp32)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
