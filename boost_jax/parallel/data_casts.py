"""The cast-and-collective pairs of the ``data`` axis whose transposes reduce in
``Parallel.reduce_dtype`` (parallel/zero.py uses them per layer): FSDP's cast-then-gather and
the in-loop reduction's cast, each a ``custom_vjp`` so that the forward moves the compute dtype
and the backward sums in the reduce dtype."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from boost_jax import compat
from boost_jax.parallel.plans.base import DATA


def varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` marked varying over every axis of ``axes`` (a psum over them needs that)."""
    have = compat.varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x


@functools.cache
def cast_gather(axis: int, src: jnp.dtype, dtype: jnp.dtype, reduce_dtype: jnp.dtype):
    """``x -> all_gather(x.astype(dtype))`` over ``data`` on ``axis`` (tiled: this device's
    ``[..., n / data, ...]`` shard of ``src`` dtype in, ``[..., n, ...]`` out), whose transpose
    reduce-scatters the cotangent in ``reduce_dtype`` and returns it in ``src``.

    The transpose of a plain gather of the cast value would reduce-scatter in ``dtype``
    (bf16 in a bf16 run); a gather of ``x`` followed by the cast would move ``src``'s bytes
    (fp32). The cotangent of the gathered value varies over the axes the gather's result
    does, so its reduce-scatter varies over the input's: the rule needs no ``pcast``."""
    @jax.custom_vjp
    def gather(x):
        return lax.all_gather(x.astype(dtype), DATA, axis=axis, tiled=True)

    def fwd(x):
        return gather(x), None

    def bwd(_, ct):
        g = lax.psum_scatter(ct.astype(reduce_dtype), DATA, scatter_dimension=axis, tiled=True)
        return (g.astype(src),)

    gather.defvjp(fwd, bwd)
    return gather


@functools.cache
def cast_reduce(axis: int | None, src: jnp.dtype, dtype: jnp.dtype, reduce_dtype: jnp.dtype,
                keep: bool = False):
    """``x -> x.astype(dtype)``, marked varying over ``data``, whose transpose sums the
    cotangent over ``data`` in ``reduce_dtype`` and returns it in ``src``: one layer's gradient
    reduced where its backward ends (``in_loop``, see parallel/zero.py).

    ``axis=None``: an all-reduce; ``x`` is invariant over ``data`` (a replicated parameter
    whose gradient is the same on every rank). Else ZeRO-1's reduce-scatter onto ``axis``:
    ``x`` varies over ``data`` and its cotangent is this rank's reduced slice put back at its
    offset in zeros (``DataLayout.reduce`` then takes the slice, all the optimizer reads).

    ``keep``: returns the cast twice, ``(used, kept)``; the transpose reduces the sum of both
    cotangents (the kept copy is what a pipeline's later iterations use).
    """
    @jax.custom_vjp
    def cast(x):
        y = varying(x.astype(dtype), (DATA,))
        return (y, y) if keep else y

    def fwd(x):
        return cast(x), None

    def bwd(_, ct):
        ct = (ct[0].astype(reduce_dtype) + ct[1].astype(reduce_dtype) if keep
              else ct.astype(reduce_dtype))
        if axis is None:
            return (lax.psum(ct, DATA).astype(src),)
        part = lax.psum_scatter(ct, DATA, scatter_dimension=axis, tiled=True)
        start = lax.axis_index(DATA) * part.shape[axis]
        return (lax.dynamic_update_slice_in_dim(jnp.zeros_like(ct), part, start, axis)
                .astype(src),)

    cast.defvjp(fwd, bwd)
    return cast
