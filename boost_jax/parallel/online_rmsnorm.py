"""RMSNorm of a residual stream split on ``d`` over ``tensor``, fused into the next A factor.

Rank ``i`` holds ``x_i [T, d/p]``, ``gamma_i`` and the matching rows ``A_i [d/p, c r]`` of the
(grouped) A factor. With ``s_i = ||x_i||^2`` and ``rho = sqrt(sum_i s_i / d + eps)``::

    RMSNorm(x) A = sum_i (x_i * gamma_i) A_i / rho

**online**: each rank normalises by its *local* RMS ``rho_i = sqrt(s_i/(d/p) + eps)``
(keeping the GEMM input well scaled in bf16), multiplies its partial product back by
``rho_i``, and appends ``s_i``; ONE all-reduce of ``[T, c r + 1]`` then yields both
``sum_i (x_i/rho_i * gamma_i) A_i rho_i = sum_i (x_i * gamma_i) A_i`` and ``S = sum_i s_i``, and
dividing by ``rho = sqrt(S/d + eps)`` recovers ``RMSNorm(x) A`` exactly (eps included). The
statistic needs no backward collective: the all-reduce's transpose is free and ``s_i`` depends
on ``x_i`` alone. ``rho_i`` cancels exactly, so it is a constant for differentiation: the
gradient is the exact one without the two large, cancelling terms (which cost accuracy in bf16).

**sync**: all-reduce the ``[T, 1]`` statistic first, normalise exactly, then all-reduce the
product: one more (latency-bound) collective in the forward pass, and one in the backward pass
(the cotangent of the shared ``rho`` is a sum over ranks).

Two hand-written derivatives save activation memory (the math is JAX's): the last step,
``H / rho`` (:func:`divide_by_rms`), keeps its *output* for the backward pass rather than
``H`` -- the output is kept anyway (the latent activation and the B factor's gradient read
it), so each fused norm keeps one ``[T, c r]`` activation less; and the fused all-reduce
(:func:`psum_together`) hands back the two cotangents without concatenating them.

With ``impl='triton'`` (``Parallel.kernels``, GPUs) the local pass and the recovery are one
Triton kernel each (boost_jax/kernels: the local pass reads the residual shard once and writes
the GEMM input and the statistic; the recovery reads the all-reduced payload once, divides by
the global RMS and applies the latent activation); the payload is then all-reduced as one
``[T, c r + 1]`` buffer whose cotangent the recovery kernel writes whole.

The fused payload travels in ``payload_dtype``, the compute dtype or float32. The statistic is
always accumulated locally in fp32; how it rides in a bf16 payload is ``stat``
(``Parallel.norm_payload``):

- ``lanes`` (default): exactly, at fp32 precision. A bf16 all-reduce rounds every partial sum
  it forms, so no split of ``s_i`` into a high and a low bf16 part survives it. But a sum of
  one value and zeros is exact in any arithmetic: each rank writes its fp32 ``s_i``, split
  exactly into :data:`LANES` bf16 values (:func:`split_exactly`, by bit masks, which no
  compiler's excess precision can round), into a slot of its own of ``p`` slots, zeros
  elsewhere; after the all-reduce every rank holds every ``s_i`` exactly and sums them in fp32.
  The payload is ``[T, c r + 3 p]``: ``3 p - 1`` elements more than ``compute``, where
  ``float32`` doubles the whole payload and ``sync`` adds a latency-bound collective.
- ``compute``: ``s_i`` rounded to bf16 (8 significant bits) -- the payload ``[T, c r + 1]``.
- with a float32 payload (``Parallel.norm_payload='float32'``, or fp32 training) the statistic
  is one exact fp32 element.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from boost_jax.kernels.ops import norm_local, recover
from boost_jax.kernels.reference import activate
from boost_jax.models.norms import sum_squares
from boost_jax.models.remat import LATENT, NORM_STAT, tag

TENSOR = "tensor"
#: bf16 holds 8 significant bits and fp32 24: three bf16 values hold an fp32 value exactly
LANES = 3
_BF16_BITS = 0xFFFF0000  # the bits of an fp32 value that a bf16 holds (sign, exponent, 7 bits)


def split_exactly(s: jax.Array) -> jax.Array:
    """fp32 ``s [..., 1] >= 0`` -> fp32 ``[..., LANES]``, each value exactly a bf16 value,
    summing to ``s`` exactly: the top 8 significant bits (truncated by a bit mask), then the
    top 8 of the rest, then the rest (at most 8 bits). No gradient."""
    parts, rest = [], lax.stop_gradient(s)
    for _ in range(LANES - 1):
        bits = lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(_BF16_BITS)
        top = lax.bitcast_convert_type(bits, jnp.float32)
        parts.append(top)
        rest = rest - top  # exact: top is rest with low bits cleared
    return jnp.concatenate([*parts, rest], axis=-1)


def stat_lanes(s_i: jax.Array, dtype) -> jax.Array:
    """This rank's statistic ``s_i [..., 1]`` (fp32) as ``[..., p * LANES]`` in ``dtype``
    (bf16): :func:`split_exactly` in this rank's slot, zeros in the others. Its gradient is
    the cotangent of this rank's first lane (the lanes sum to ``s_i``)."""
    p, me = lax.axis_size(TENSOR), lax.axis_index(TENSOR)
    first = jnp.zeros((LANES,), jnp.float32).at[0].set(1.0)
    # value: the exact split; derivative: through the first lane only (s_i - s_i is 0 exactly)
    lanes = split_exactly(s_i) + (s_i - lax.stop_gradient(s_i)) * first
    slot = (jnp.arange(p) == me).astype(jnp.float32)[:, None]  # [p, 1]: 1 in this rank's slot
    out = slot * lanes[..., None, :]  # [..., p, LANES]
    return out.reshape(*s_i.shape[:-1], p * LANES).astype(dtype)


def lanes_used(stat: str, payload_dtype) -> bool:
    """Whether the statistic rides in lanes: ``stat='lanes'`` with a payload narrower than
    fp32 (an fp32 payload carries it exactly as one element)."""
    return stat == "lanes" and jnp.dtype(payload_dtype).itemsize < 4


def stat_payload(s_i: jax.Array, dtype, stat: str) -> jax.Array:
    """This rank's part of the fused payload for its statistic ``s_i [..., 1]`` (fp32):
    ``[..., p * LANES]`` lanes, or ``s_i`` in ``dtype`` (``[..., 1]``)."""
    return stat_lanes(s_i, dtype) if lanes_used(stat, dtype) else s_i.astype(dtype)


def global_stat(total: jax.Array, stat: str) -> jax.Array:
    """The all-reduced statistic part of the payload -> ``sum_i s_i [..., 1]`` in fp32 (the
    lanes' exact parts summed in fp32, or the all-reduced value)."""
    if lanes_used(stat, total.dtype):
        return jnp.sum(total.astype(jnp.float32), axis=-1, keepdims=True)
    return total.astype(jnp.float32)


def online_norm_down(x: jax.Array, scale: jax.Array, eps: float, gemm: Callable,
                     payload_dtype=None, act: str = "identity", impl: str = "xla",
                     stat: str = "lanes", compute_capability: int | None = None) -> jax.Array:
    """``act(gemm(RMSNorm(x)))`` for ``x [b, s, d/p]`` sharded on ``tensor``, with one
    all-reduce.

    ``gemm`` maps ``[b, s, d/p]`` to this rank's partial product ``[b, s, ...]`` (e.g.
    ``[b, s, 3, r]``); the result has the same shape, replicated over ``tensor``. ``impl``:
    ``xla`` or ``triton`` (:func:`boost_jax.kernels.resolve`). ``stat``: ``lanes`` or
    ``compute``, how the statistic rides in a bf16 payload (the module docstring).
    ``compute_capability``: the GPU the Triton kernels are compiled for (``None``: the device's).
    """
    if impl == "triton":
        if lanes_used(stat, payload_dtype or x.dtype):
            raise NotImplementedError("the Triton recovery reads the statistic as the "
                                      "payload's last element: not in lanes")
        return _online_norm_down_kernels(x, scale, eps, gemm, payload_dtype, act,
                                         compute_capability)
    d = x.shape[-1] * lax.axis_size(TENSOR)
    s_i = sum_squares(x)  # [b, s, 1] fp32
    # rho_i cancels exactly ((x_i / rho_i) A_i rho_i = x_i A_i): it only conditions the GEMM,
    # so it carries no gradient (differentiating both sides would cancel two large terms)
    rho_i = lax.stop_gradient(jnp.sqrt(s_i / x.shape[-1] + eps))
    x_hat = (x.astype(jnp.float32) / rho_i * scale.astype(jnp.float32)).astype(x.dtype)
    h_i = gemm(x_hat)
    lead, tail = h_i.shape[:2], h_i.shape[2:]
    dtype = payload_dtype or h_i.dtype
    h, s = tag(psum_together((h_i.reshape(*lead, -1) * rho_i).astype(dtype),
                             stat_payload(s_i, dtype, stat)), LATENT)
    return activate(divide_by_rms(h.astype(jnp.float32).reshape(*lead, *tail),
                                  global_stat(s, stat), d, eps, h_i.dtype), act)


def _online_norm_down_kernels(x, scale, eps, gemm, payload_dtype, act, cc):
    """:func:`online_norm_down` on the Triton kernels: local pass, GEMM, one all-reduce of the
    ``[b, s, c r + 1]`` payload, recovery + ``act``."""
    d = x.shape[-1] * lax.axis_size(TENSOR)
    x_hat, s_i, rho_i = norm_local(x, scale, eps, "triton", cc)
    h_i = gemm(x_hat)
    lead, tail = h_i.shape[:2], h_i.shape[2:]
    dtype = payload_dtype or h_i.dtype
    payload = jnp.concatenate([(h_i.reshape(*lead, -1) * rho_i).astype(dtype),
                               s_i.astype(dtype)], axis=-1)
    payload = tag(lax.psum(payload, TENSOR), LATENT)
    return recover(payload, d, eps, act, h_i.dtype, "triton", cc).reshape(*lead, *tail)


@jax.custom_vjp
def psum_together(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(psum(a), psum(b))`` over ``tensor`` as ONE all-reduce of ``[a || b]`` (concatenated
    on the last axis). The backward pass is JAX's own transpose of a psum (each cotangent
    enters this rank's partial as is, no collective), written out so that it never builds
    the concatenated cotangent."""
    total = lax.psum(jnp.concatenate([a, b], axis=-1), TENSOR)
    return total[..., :a.shape[-1]], total[..., a.shape[-1]:]


def _psum_together_fwd(a, b):
    return psum_together(a, b), None


def _psum_together_bwd(_, cts):
    return tuple(lax.pcast(ct, (TENSOR,), to="varying") for ct in cts)


psum_together.defvjp(_psum_together_fwd, _psum_together_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def divide_by_rms(h: jax.Array, s: jax.Array, d: int, eps: float, dtype) -> jax.Array:
    """``h / sqrt(s / d + eps)`` in ``dtype``, for ``h [b, s, ...]`` and the sum of squares
    ``s [b, s, 1]`` (fp32). Its backward pass reads the output, not ``h``."""
    return _divide(h, s, d, eps, dtype)[0]


def _divide(h, s, d, eps, dtype):
    rms = jnp.sqrt(s / d + eps)
    y = (h / rms.reshape(rms.shape[:2] + (1,) * (h.ndim - 2))).astype(dtype)
    return y, (y, rms)


def _divide_bwd(d, eps, dtype, res, dy):
    y, rms = res
    rms_b = rms.reshape(rms.shape[:2] + (1,) * (y.ndim - 2))
    dy32 = dy.astype(jnp.float32)
    # y = h / rms with rms = sqrt(s/d + eps): dh = dy / rms, ds = -sum(dy * y) / (2 d rms^2)
    dot = jnp.sum(dy32 * y.astype(jnp.float32), axis=tuple(range(2, y.ndim)))[..., None]
    return dy32 / rms_b, -dot / (2 * d * jnp.square(rms))


divide_by_rms.defvjp(lambda h, s, d, eps, dtype: _divide(h, s, d, eps, dtype), _divide_bwd)


def sync_norm_down(x: jax.Array, scale: jax.Array, eps: float, gemm: Callable,
                   act: str = "identity") -> jax.Array:
    """The same result as :func:`online_norm_down` with the statistic all-reduced first."""
    d = x.shape[-1] * lax.axis_size(TENSOR)
    s = tag(lax.psum(sum_squares(x), TENSOR), NORM_STAT)
    inv = lax.rsqrt(s / d + eps)
    x_hat = (x.astype(jnp.float32) * inv * scale.astype(jnp.float32)).astype(x.dtype)
    return activate(tag(lax.psum(gemm(x_hat), TENSOR), LATENT), act)
