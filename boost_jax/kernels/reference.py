"""The math of BTP's two chunk-boundary kernels in plain ``jnp``, forward and backward written
out: the reference the Triton kernels (:mod:`boost_jax.kernels.triton_kernels`) are tested
against, and the ``xla`` path's backward formulas checked against JAX's autodiff.

Shapes are 2-D: ``T`` tokens (batch x sequence, flattened) by features.

**Online-RMSNorm local pass** (:func:`norm_local_fwd`), on rank ``i``'s residual shard
``x [T, D]`` (``D = d/p``, split on ``tensor``) with the gain shard ``gamma [D]``::

    s = sum(x^2)               fp32 [T, 1]   (rides in the A factor's all-reduce)
    rho = sqrt(s / D + eps)    fp32 [T, 1]   (local RMS; a constant for differentiation)
    x_hat = x / rho * gamma    [T, D]        (the A GEMM's input, well scaled in bf16)

Backward, ``rho`` held constant (it cancels exactly, parallel/online_rmsnorm.py)::

    dx = dx_hat * gamma / rho + 2 x ds          dgamma = sum_T dx_hat * x / rho

**Post-psum recovery + sigma** (:func:`recover_fwd`), on the all-reduced payload
``p [T, C + 1]`` = ``[sum_i (x_i gamma_i) A_i || S]`` (``C = c r``, replicated)::

    rms = sqrt(S / d + eps);   z = p[:, :C] / rms;   y = sigma(z)   (SiLU, or the identity)

Backward (``sigma'(z) = sig(z) (1 + z (1 - sig(z)))`` for SiLU)::

    dz = dy sigma'(z);   dp[:, :C] = dz / rms;   dp[:, C] = -sum(dz z) / (2 d rms^2)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("identity", "silu")


def norm_local_fwd(x: jax.Array, gamma: jax.Array, eps: float
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x [T, D]``, ``gamma [D]`` -> ``(x_hat [T, D] in x's dtype, s [T, 1], rho [T, 1])``
    (``s`` and ``rho`` fp32)."""
    x32 = x.astype(jnp.float32)
    s = jnp.sum(jnp.square(x32), axis=-1, keepdims=True)
    rho = jnp.sqrt(s / x.shape[-1] + eps)
    return (x32 / rho * gamma.astype(jnp.float32)).astype(x.dtype), s, rho


def norm_local_bwd(x: jax.Array, gamma: jax.Array, rho: jax.Array, dx_hat: jax.Array,
                   ds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cotangents ``(dx [T, D] in x's dtype, dgamma [D] in gamma's dtype)`` of
    :func:`norm_local_fwd` for ``dx_hat [T, D]`` and ``ds [T, 1]`` (``rho`` constant)."""
    x32, g32, dxh = (v.astype(jnp.float32) for v in (x, gamma, dx_hat))
    dx = dxh * g32 / rho + 2.0 * x32 * ds.astype(jnp.float32)
    dgamma = jnp.sum(dxh * x32 / rho, axis=0)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype)


def activate(z: jax.Array, act: str) -> jax.Array:
    return jax.nn.silu(z) if act == "silu" else z


def recover_fwd(payload: jax.Array, d: int, eps: float, act: str, dtype
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``payload [T, C + 1]`` -> ``(y [T, C] in dtype, z [T, C] in dtype, rms [T, 1] fp32)``:
    the latent divided by the global RMS of the ``d``-wide residual, then ``act``."""
    p32 = payload.astype(jnp.float32)
    rms = jnp.sqrt(p32[:, -1:] / d + eps)
    z = p32[:, :-1] / rms
    return activate(z, act).astype(dtype), z.astype(dtype), rms


def recover_bwd(z: jax.Array, rms: jax.Array, dy: jax.Array, d: int, act: str,
                payload_dtype) -> jax.Array:
    """Cotangent ``dpayload [T, C + 1]`` (in ``payload_dtype``) of :func:`recover_fwd` for
    ``dy [T, C]``, from the saved pre-activation ``z`` and ``rms``."""
    z32, dy32 = z.astype(jnp.float32), dy.astype(jnp.float32)
    if act == "silu":
        sig = jax.nn.sigmoid(z32)
        dz = dy32 * sig * (1.0 + z32 * (1.0 - sig))
    else:
        dz = dy32
    ds = -jnp.sum(dz * z32, axis=-1, keepdims=True) / (2.0 * d * jnp.square(rms))
    return jnp.concatenate([dz / rms, ds], axis=-1).astype(payload_dtype)
