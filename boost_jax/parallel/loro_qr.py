"""The collectives of LORO's exact step (optim/loro.py): a distributed QR of tall factor blocks
whose rows may be split over a mesh axis, and the rank-dim gathers of the vanilla plan.

Every function runs per device inside the model's ``shard_map`` region, or on global arrays
(one device, no TP) where every ``axis`` is ``None`` and nothing is communicated.

**Shifted CholeskyQR3** (Fukaya, Kannan, Nakatsukasa, Yamamoto, Yanagisawa, "Shifted Cholesky
QR for computing the QR factorization of ill-conditioned matrices", SIAM J. Sci. Comput. 42(1),
2020). For ``X [m, c]`` row-split over ``axis`` (device ``i`` holds ``X_i [m/p, c]``)::

    G = psum_i X_i^T X_i                 one all-reduce of its c (c + 1) / 2 upper triangle
    G~ = D^-1 G D^-1,  D = sqrt(diag G)  column equilibration (Cholesky is scale-blind)
    L L^T = G~ (+ s I in the first pass)
    R = L^T D;  X_i <- X_i R^-1          local triangular solve

run three times: a first pass with the shift ``s = 11 (m c + c (c + 1)) u c`` (their eq. 4.2
with ``||X~||_2^2 <= c`` for the equilibrated matrix; ``u`` the fp32 unit roundoff), which
does not break down however ill-conditioned ``X`` is and leaves a better-conditioned ``Q``,
then CholeskyQR2 (two plain passes), which makes the columns orthonormal to working precision
while ``kappa(Q)`` stays below ~``u^-1/2`` (tests: ``kappa(X) = 1e3`` in fp32). ``X = Q R``
with ``R = R_3 R_2 R_1`` upper triangular with a positive diagonal (the unique QR). Per pass,
the Gram matrices of every block in one call travel in a single all-reduce per mesh axis --
``c (c + 1) / 2`` elements per block, nothing of size ``m``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

#: fp32 unit roundoff
FP32_UNIT_ROUNDOFF = 2.0 ** -24
#: Fukaya et al. (2020), eq. (4.2): the shift that keeps the first Cholesky pass alive
SHIFT_CONSTANT = 11.0
#: shifted pass + CholeskyQR2
PASSES = 3
HIGHEST = lax.Precision.HIGHEST
#: the module whose import loads the LAPACK jaxlib's CPU kernels call (scipy's OpenBLAS)
LAPACK_MODULE = "scipy.linalg.cython_lapack"


@dataclasses.dataclass(frozen=True)
class FactorSplit:
    """How one low-rank factor is laid out inside the region, in its canonical orientation
    (``[..., n, r]``: ``n`` its full dim, ``r`` the rank): ``rows`` is the mesh axis ``n``
    is split over (BTP), ``rank`` the one ``r`` is split over (vanilla); ``None``: whole."""

    rows: str | None = None
    rank: str | None = None


def _transpose(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def psum_grouped(values: Sequence[jax.Array], axes: Sequence[str | None]) -> list[jax.Array]:
    """``psum(values[k], axes[k])`` for every ``k``, as one all-reduce per distinct axis (the
    values flattened and concatenated); ``None``: no reduction."""
    out = list(values)
    for axis in {a for a in axes if a is not None}:
        idx = [k for k, a in enumerate(axes) if a == axis]
        flat = jnp.concatenate([values[k].reshape(-1) for k in idx])
        flat = lax.psum(flat, axis)
        start = 0
        for k in idx:
            size = values[k].size
            out[k] = flat[start:start + size].reshape(values[k].shape)
            start += size
    return out


def _cholesky_r(gram: jax.Array, shift: float) -> jax.Array:
    """Upper-triangular ``R`` with ``R^T R = G (+ shift * D^2)`` for a batch of Gram matrices
    ``[..., c, c]``, computed on the column-equilibrated Gram."""
    d = jnp.sqrt(jnp.diagonal(gram, axis1=-2, axis2=-1))
    d = jnp.where(d > 0, d, 1.0)
    scaled = gram / (d[..., :, None] * d[..., None, :])
    if shift:
        scaled = scaled + shift * jnp.eye(gram.shape[-1], dtype=gram.dtype)
    lower = matrixwise(jnp.linalg.cholesky)(scaled)
    return _transpose(lower) * d[..., None, :]


def matrixwise(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` of arrays batched on one leading axis (``[N, ...]``), which on XLA:CPU runs one
    matrix at a time (``lax.map``) and elsewhere batched.

    Why: jaxlib's CPU LAPACK kernels (Cholesky, triangular solve, SVD; jaxlib 0.10.2) split a
    batch over XLA's intra-op thread pool and block the pool thread that called them until the
    pieces finish. When every pool thread is such a caller -- several simulated devices, or
    independent chains of the exact step running concurrently -- nothing is left to run the
    pieces and the step deadlocks (reproduced with each kernel alone, no collective involved).
    One matrix per call never waits on the pool. The batches here are ``L x members`` small
    ``r``-sized problems, so the CPU loses little; GPUs (cuSOLVER) keep the batched calls.
    """
    def run(*xs):
        def mapped(*args):
            return lax.map(lambda one: fn(*one), args)
        return lax.platform_dependent(*xs, cpu=mapped, default=fn)
    return run


def lapack_threads_limited() -> bool:
    """Whether the LAPACK that XLA:CPU calls (scipy's OpenBLAS, which jaxlib's CPU kernels use)
    is kept to the thread count the user chose: ``OPENBLAS_NUM_THREADS`` is set.

    Why it matters: XLA already runs every device's kernels on its own pool, and OpenBLAS's
    spinning worker threads on top of it slowed a 6-step LORO run by 6x on two cores,
    approximate steps included; one thread per call is right. OpenBLAS reads the variable once,
    when scipy's LAPACK loads, and it is process-wide: the entry points set it
    (:func:`boost_jax.cli.limit_lapack_threads`, ``OPENBLAS_NUM_THREADS=1`` for
    ``Train.optimizer='loro'`` on CPU, before anything loads scipy's LAPACK). This function
    only reads the environment, so a library caller can warn."""
    return "OPENBLAS_NUM_THREADS" in os.environ


def _gram(x: jax.Array) -> jax.Array:
    """The upper triangle ``[..., c (c + 1) / 2]`` of this device's ``x^T x`` (what travels:
    the Gram matrix is symmetric)."""
    i, j = jnp.triu_indices(x.shape[-1])
    return jnp.einsum("...nc,...nd->...cd", x, x, precision=HIGHEST)[..., i, j]


def _symmetric(packed: jax.Array, c: int) -> jax.Array:
    """``[..., c (c + 1) / 2]`` upper triangle -> the symmetric ``[..., c, c]``."""
    i, j = jnp.triu_indices(c)
    upper = jnp.zeros((*packed.shape[:-1], c, c), packed.dtype).at[..., i, j].set(packed)
    return upper + jnp.swapaxes(upper, -1, -2) * (1 - jnp.eye(c, dtype=packed.dtype))


@matrixwise
def _solve_right(r: jax.Array, x: jax.Array) -> jax.Array:
    """``X R^-1`` for upper-triangular ``R``."""
    return lax.linalg.triangular_solve(r, x, left_side=False, lower=False)


def _qr3(blocks: list[jax.Array], axes: list[str | None], rows: list[int]
         ) -> list[tuple[jax.Array, jax.Array]]:
    qs, rs = list(blocks), [None] * len(blocks)
    for i in range(PASSES):
        grams = psum_grouped([_gram(q) for q in qs], axes)
        grams = [_symmetric(g, q.shape[-1]) for g, q in zip(grams, qs)]
        for k, (g, m) in enumerate(zip(grams, rows)):
            c = g.shape[-1]
            shift = SHIFT_CONSTANT * (m * c + c * (c + 1)) * FP32_UNIT_ROUNDOFF * c if i == 0 \
                else 0.0
            r = _cholesky_r(g, shift)
            qs[k] = _solve_right(r, qs[k])
            rs[k] = r if rs[k] is None else jnp.matmul(r, rs[k], precision=HIGHEST)
    return list(zip(qs, rs))


def cholesky_qr(blocks: Sequence[jax.Array], axes: Sequence[str | None],
                rows: Sequence[int]) -> list[tuple[jax.Array, jax.Array]]:
    """Shifted CholeskyQR3 (see the module docstring) of each ``blocks[k] [..., m_k/p, c_k]``
    (this device's rows; ``axes[k]`` the mesh axis they are split over, ``rows[k] = m_k`` the
    global row count). Returns ``(Q [..., m_k/p, c_k], R [..., c_k, c_k])`` per block, ``Q``
    split like the block and ``R`` replicated. Blocks of one local shape, axis and row count
    are stacked into one batch; three all-reduces per call and axis."""
    groups: dict[tuple, list[int]] = {}
    for k, (x, axis, m) in enumerate(zip(blocks, axes, rows)):
        groups.setdefault((x.shape[-2:], axis, m), []).append(k)
    keys = list(groups)
    stacked = [jnp.concatenate([blocks[k].reshape(-1, *key[0]) for k in groups[key]])
               for key in keys]
    results = _qr3(stacked, [key[1] for key in keys], [key[2] for key in keys])
    out: list = [None] * len(blocks)
    for key, (q, r) in zip(keys, results):
        start = 0
        for k in groups[key]:
            lead = blocks[k].shape[:-2]
            size = math.prod(lead)
            out[k] = (q[start:start + size].reshape(blocks[k].shape),
                      r[start:start + size].reshape(*lead, *r.shape[-2:]))
            start += size
    return out


# --- the vanilla plan: the rank dim is split -------------------------------------------------
def gather_rank(x: jax.Array, axis: str | None) -> jax.Array:
    """``x [..., n, r/p]`` (rank split over ``axis``) -> the whole ``[..., n, r]`` on every
    device: an all-gather of the factor, ``n r`` elements (the vanilla plan's price for the
    exact step; ``None``: ``x`` itself)."""
    if axis is None:
        return x
    return lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)


def local_rank(x: jax.Array, axis: str | None) -> jax.Array:
    """This device's slice ``[..., n, r/p]`` of a whole ``x [..., n, r]`` (inverse of
    :func:`gather_rank`, no communication)."""
    if axis is None:
        return x
    n = x.shape[-1] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * n, n, axis=x.ndim - 1)
