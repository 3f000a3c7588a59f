"""BTP's chunk-boundary ops as JAX functions with custom VJPs, on Triton (``jax_triton``) or
XLA (the ``jnp`` reference, fused by XLA).

* :func:`norm_local` -- the online-RMSNorm local pass: ``x [..., D]`` -> ``(x_hat, s, rho)``;
* :func:`recover` -- the post-psum recovery + sigma: ``payload [..., C + 1]`` -> ``y [..., C]``.

The math and its derivatives are in :mod:`boost_jax.kernels.reference`. Both ops take leading
axes (``[b, s, ...]``) and run on ``T = b * s`` rows. ``impl='triton'`` needs a GPU and
jax-triton (:func:`boost_jax.kernels.resolve` chooses); each kernel launch is one read of
its inputs and one write of its outputs.

Calls follow ``jax_triton.triton_call`` (0.3.1): the arrays positionally (the kernel's pointers,
inputs then outputs, in ``out_shape`` order), everything else by keyword -- jax-triton hands
keyword arguments to Triton as ``tl.constexpr`` values, so they must be plain Python ``int`` /
``float`` / ``bool`` (Triton cannot make a constant of a NumPy scalar such as ``np.float32``).
tests/kernels/test_triton_call.py checks these calls on CPU: bound to jax-triton's signature,
compiled by Triton for sm_90 as jax-triton would, and run in Triton's interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from boost_jax import compat
from boost_jax.kernels import reference as ref

#: values one Triton program holds (its token rows x the next power of two of the width): a
#: starting point that keeps a 2048-wide row block in registers, to be tuned on a GPU
BLOCK_VALUES = 8192
MAX_ROWS = 16
IMPLS = ("xla", "triton")


def _rows(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block_rows(width: int) -> int:
    """Token rows per Triton program for rows ``width`` wide."""
    return max(1, min(MAX_ROWS, BLOCK_VALUES // _pow2(width)))


def _grid(t: int, width: int) -> tuple[int]:
    return (-(-t // block_rows(width)),)


def _triton():
    import jax_triton as jt

    from boost_jax.kernels import triton_kernels as tk

    return jt, tk


def _call(*args, **kwargs):
    """``jax_triton.triton_call(*args, **kwargs)`` whose outputs vary over the mesh axes its
    inputs do inside a ``shard_map`` (jax-triton types its outputs as varying over none, which
    a custom VJP's cotangent check refuses: ``float32[...]`` for ``float32[...]{V:data}``); a
    type cast, no data moves."""
    jt, _ = _triton()
    axes = frozenset().union(*(compat.varying_axes(a) for a in args))
    out = jt.triton_call(*args, **kwargs)
    if not axes:
        return out
    return jax.tree.map(lambda o: lax.pcast(o, tuple(sorted(axes)), to="varying"), out)


# --- online-RMSNorm local pass -------------------------------------------------------------
def _norm_fwd_triton(x, gamma, eps, cc):
    _, tk = _triton()
    t, width = x.shape
    f32 = jax.ShapeDtypeStruct((t,), jnp.float32)
    x_hat, s, rho = _call(
        x, gamma, kernel=tk.norm_local_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), f32, f32), grid=_grid(t, width),
        T=t, D=width, eps=float(eps), BLOCK_T=block_rows(width), BLOCK_D=_pow2(width),
        compute_capability=cc)
    return x_hat, s[:, None], rho[:, None]


def _norm_bwd_triton(x, gamma, rho, dx_hat, ds, cc):
    _, tk = _triton()
    t, width = x.shape
    programs = _grid(t, width)[0]
    dx, dg = _call(
        x, gamma, rho.reshape(t), dx_hat, ds.reshape(t).astype(jnp.float32),
        kernel=tk.norm_local_bwd_kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((programs, width), jnp.float32)),
        grid=(programs,), T=t, D=width, BLOCK_T=block_rows(width), BLOCK_D=_pow2(width),
        compute_capability=cc)
    return dx, jnp.sum(dg, axis=0).astype(gamma.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _norm_local_2d(x, gamma, eps, impl, cc):
    return _norm_local_2d_fwd(x, gamma, eps, impl, cc)[0]


def _norm_local_2d_fwd(x, gamma, eps, impl, cc):
    out = (_norm_fwd_triton(x, gamma, eps, cc) if impl == "triton"
           else ref.norm_local_fwd(x, gamma, eps))
    return out, (x, gamma, out[2])


def _norm_local_2d_bwd(eps, impl, cc, res, cts):
    x, gamma, rho = res
    dx_hat, ds, _ = cts  # rho is a constant for differentiation
    if impl == "triton":
        return _norm_bwd_triton(x, gamma, rho, dx_hat, ds, cc)
    return ref.norm_local_bwd(x, gamma, rho, dx_hat, ds)


_norm_local_2d.defvjp(_norm_local_2d_fwd, _norm_local_2d_bwd)


def norm_local(x: jax.Array, gamma: jax.Array, eps: float, impl: str = "xla",
               compute_capability: int | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x [..., D]``, ``gamma [D]`` -> ``(x_hat [..., D], s [..., 1], rho [..., 1])``; ``rho``
    carries no gradient. ``compute_capability`` (Triton: e.g. ``90``; ``None``: the
    device's) is the GPU the kernels are compiled for."""
    rows, lead = _rows(x)
    x_hat, s, rho = _norm_local_2d(rows, gamma, eps, impl, compute_capability)
    return x_hat.reshape(x.shape), s.reshape(*lead, 1), rho.reshape(*lead, 1)


# --- post-psum recovery + sigma ------------------------------------------------------------
def _recover_fwd_triton(payload, d, eps, act, dtype, cc):
    _, tk = _triton()
    t, width = payload.shape
    c = width - 1
    y, z, rms = _call(
        payload, kernel=tk.recover_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((t, c), dtype), jax.ShapeDtypeStruct((t, c), dtype),
                   jax.ShapeDtypeStruct((t,), jnp.float32)),
        grid=_grid(t, c), T=t, C=c, d=int(d), eps=float(eps), SILU=act == "silu",
        BLOCK_T=block_rows(c), BLOCK_C=_pow2(c), compute_capability=cc)
    return y, z, rms[:, None]


def _recover_bwd_triton(z, rms, dy, d, act, payload_dtype, cc):
    _, tk = _triton()
    t, c = z.shape
    return _call(
        z, rms.reshape(t), dy, kernel=tk.recover_bwd_kernel,
        out_shape=jax.ShapeDtypeStruct((t, c + 1), payload_dtype), grid=_grid(t, c),
        T=t, C=c, d=int(d), SILU=act == "silu", BLOCK_T=block_rows(c), BLOCK_C=_pow2(c),
        compute_capability=cc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _recover_2d(payload, d, eps, act, dtype, impl, cc):
    return _recover_2d_fwd(payload, d, eps, act, dtype, impl, cc)[0]


def _recover_2d_fwd(payload, d, eps, act, dtype, impl, cc):
    y, z, rms = (_recover_fwd_triton(payload, d, eps, act, dtype, cc) if impl == "triton"
                 else ref.recover_fwd(payload, d, eps, act, dtype))
    # the identity activation's y is z: keep one of them
    return y, (y if act == "identity" else z, rms, jnp.zeros((0,), payload.dtype))


def _recover_2d_bwd(d, eps, act, dtype, impl, cc, res, dy):
    z, rms, like = res
    if impl == "triton":
        return (_recover_bwd_triton(z, rms, dy, d, act, like.dtype, cc),)
    return (ref.recover_bwd(z, rms, dy, d, act, like.dtype),)


_recover_2d.defvjp(_recover_2d_fwd, _recover_2d_bwd)


def recover(payload: jax.Array, d: int, eps: float, act: str, dtype, impl: str = "xla",
            compute_capability: int | None = None) -> jax.Array:
    """``payload [..., C + 1]`` (the all-reduced ``[latent || sum of squares]``) ->
    ``act(latent / rms) [..., C]`` in ``dtype``; ``d`` is the full residual width;
    ``compute_capability`` as :func:`norm_local`'s."""
    if act not in ref.ACTIVATIONS:
        raise ValueError(f"act={act!r} is not one of {', '.join(ref.ACTIVATIONS)}")
    rows, lead = _rows(payload)
    return _recover_2d(rows, d, eps, act, jnp.dtype(dtype), impl,
                       compute_capability).reshape(*lead, -1)
