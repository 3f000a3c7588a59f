"""LORO: the low-rank Riemannian optimizer (Mo, Huang, Pan, "Parameter and Memory Efficient
Pretraining via Low-rank Riemannian Optimization", ICLR 2025), as one optax
``GradientTransformation`` for ``svd`` models, runnable inside the model's ``shard_map`` region
on each device's shards.

Source of every formula below: the authors' implementation, github.com/mzf666/LORO-main
at ``4da57b6`` (``loro_torch/loro_optim.py``: ``LOROAdamW``, ``loro_type='loro'``; ``run_c4.py``
and ``scripts/loro_c4/*.sh``: the exact-step cadence, the state refresh, the learning-rate
scaler and restart warm-up), written here in this repository's ``x @ W`` orientation: a
projection is ``W = A B`` with ``A [n_in, r]``, ``B [r, n_out]`` (their ``N = A``, ``M = B^T``).

Moments, refresh, restart warm-up and the rule of every other parameter: optim/loro_adam.py.
For a factor ``X`` in ``{A, B}`` LORO steps along ``D_X = m / (sqrt(v) + 1e-6)``
(``loro_optim.py:280-285``) with the bias-corrected step ``eta = lr * sqrt(1 - b2^t) / (1 -
b1^t)`` (``:287-291``, ``t``: updates since the last refresh).

*Approximate step* (their lazy update, the paper's eq. 12; ``loro_optim.py:56-66``), every step
but the exact ones::

    X <- X - eta * s * D_X;   X <- X - eta * wd * X

``s`` = ``Train.loro_lr_scaler``; a negative one (the default, -1, as every
``scripts/loro_c4/*.sh`` passes) means ``r / d_model`` (``loro_optim.py:293-297``:
``min(X.shape) / hidden_size``; the ``--loro_lr_scaler`` flag itself defaults to 1.0,
``run_c4.py:150-155``). It scales the direction only, never the decay or the exact step.

*Exact step* (the paper's eq. 10; ``loro_optim.py:68-126``), at updates ``k`` with ``(k + 1) %
K == 0`` (``Train.loro_exact_every``, ``run_c4.py:764``): the Riemannian step on the rank-r
manifold along the tangent projection of the gradient the directions imply, then a balanced
rank-r retraction::

    B^T = U Rm,  A = V Rn                                    QR of both factors
    K0 = Rm^-T D_A^T V                        [r, r]
    Q1 K1 = (I - V V^T) D_A Rm^-1             [n_in, r]       QR
    Q2 K2 = (I - U U^T) D_B^T Rn^-1           [n_out, r]      QR
    S = [[Rm Rn^T - eta K0, -eta K1^T], [-eta K2, 0]]         [2r, 2r]
    S = Us diag(sigma) Vs^T;  A <- [V, Q1] Vs_r sqrt(sigma_r);  B^T <- [U, Q2] Us_r sqrt(sigma_r)

(no scaler, no weight decay). ``[V, Q1]`` and its triangle are one QR of ``[A, D_A]`` (block
Gram-Schmidt: ``[A, D_A] = [V, Q1] [[Rn, X], [0, Z]]`` gives ``K0 = Rm^-T X^T`` and ``K1 = Z
Rm^-1``), likewise ``[U, Q2]`` of ``[B^T, D_B^T]`` (``K2 = Z' Rn^-1``), so the step is two
QRs of ``2r``-column blocks per pair, done by the distributed shifted CholeskyQR3 of
parallel/loro_qr.py. Singular vectors are signed so that each column of ``Us`` has its
largest entry positive (theirs are unsigned: a gauge that leaves ``A B`` unchanged). After the
exact step every moment is reset and ``t`` restarts unless ``Train.loro_reset_moments=False``;
the learning rate then warms up again (optim/loro_adam.py).

Sharding: under ``btp`` each factor is split on its full dim, so the QRs take three all-reduces
(one per CholeskyQR pass, every pair's Gram triangles in one): ``r (2r + 1)`` elements per
factor each, ``6 r^2 + 3 r`` per factor per exact step, nothing ``n``-sized. Under ``vanilla``
(rank split) the exact step all-gathers ``A, D_A, B, D_B`` over ``tensor`` (``2 (n_in + n_out)
r`` elements per pair) and runs replicated. The approximate step is elementwise, with no
collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import logging
from jax import lax

from boost_jax.config import ConfigError, Model, Parallel, Train
from boost_jax.optim.loro_adam import (
    LORO_EPS,
    adam_state,
    authors_regular,
    moments,
    refresh,
    restart_schedule,
)
from boost_jax.optim.optimizer import Optimizer, lr_schedule
from boost_jax.parallel.loro_qr import (
    HIGHEST,
    FactorSplit,
    cholesky_qr,
    gather_rank,
    lapack_threads_limited,
    local_rank,
    matrixwise,
)
from boost_jax.parallel.plans.base import as_entry, entry_axes

if TYPE_CHECKING:
    from boost_jax.parallel.runner import ShardedModel

#: the svd factor pairs under ``blocks``: (projection, A's member range on its grouped axis or
#: None for an ungrouped ``a [L, n_in, r]``, B's key); member order as models/decoder.py builds
#: the Fanouts (q then k, v; gate then up)
PAIRS = (("qkv", (0, 1), "b_q"), ("qkv", (1, 3), "b_kv"), ("gate_up", (0, 2), "b_gu"),
         ("o", None, "b"), ("down", None, "b"))
BLOCKS = "blocks"


@dataclasses.dataclass(frozen=True)
class Pair:
    """One projection's factor pair: ``A`` is ``params[blocks][proj]['a']`` (its ``members``
    slice on axis -2 when grouped ``[L, n_in, c, r]``), ``B`` is ``params[blocks][proj][b]``
    (``[L, m, r, n_out]`` grouped, ``[L, r, n_out]`` not). ``n_in``, ``n_out``, ``rank``:
    global sizes; ``split_a``, ``split_b``: their layout in the region."""

    proj: str
    members: tuple[int, int] | None
    b: str
    n_in: int
    n_out: int
    rank: int
    split_a: FactorSplit = FactorSplit()
    split_b: FactorSplit = FactorSplit()


class LoroState(NamedTuple):
    """``count``: updates made (int32), equal to the count of ``adamw``'s schedule, the count
    :meth:`Optimizer.lr` reads ``lr`` at (``eta``'s ``lr``, restart warm-up included);
    ``adamw``: the state of loro_adam.moments over every parameter -- the moments of both
    groups, its Adam count the updates since the last refresh."""

    count: jax.Array
    adamw: optax.OptState


# --- factor pairs: recognised from the params, laid out canonically --------------------------
def _canonical_a(a: jax.Array, pair: Pair) -> jax.Array:
    """``a`` -> ``[L, m, n_in, r]``."""
    if pair.members is None:
        return a[..., None, :, :]
    lo, hi = pair.members
    return jnp.moveaxis(a[..., lo:hi, :], -2, -3)


def _canonical_b(b: jax.Array, pair: Pair) -> jax.Array:
    """``b`` -> ``B^T [L, m, n_out, r]``."""
    bt = jnp.swapaxes(b, -1, -2)
    return bt if pair.members is not None else bt[..., None, :, :]


def find_pairs(shapes: dict, specs: dict | None = None) -> tuple[Pair, ...]:
    """The factor pairs of an ``svd`` model's ``shapes`` (global ShapeDtypeStructs, blocks
    ``[L, ...]``); ``specs``: the PartitionSpecs the region sees (None: unsharded). Raises
    ConfigError for layouts the exact step does not handle."""
    blocks, out = shapes[BLOCKS], []
    for proj, members, b in PAIRS:
        a_shape, b_shape = blocks[proj]["a"].shape, blocks[proj][b].shape
        grouped = members is not None
        if grouped and members[1] > a_shape[-2]:
            raise ConfigError(f"loro: {proj}/a has {a_shape[-2]} members, expected more")
        splits = []
        for key, ndim, rows_dim, rank_dim in (("a", len(a_shape), 1, -1),
                                             (b, len(b_shape), -1, -2)):
            spec = tuple(specs[BLOCKS][proj][key]) if specs is not None else ()
            spec = spec + (None,) * (ndim - len(spec))
            entries = [as_entry(entry_axes(e)) for e in spec]
            named = {i % ndim: e for i, e in enumerate(entries) if e is not None}
            rows, rank = named.pop(rows_dim % ndim, None), named.pop(rank_dim % ndim, None)
            if named or any(isinstance(e, tuple) for e in (rows, rank)) or (rows and rank):
                raise ConfigError(f"Train.optimizer='loro' is not implemented for the layout "
                                  f"{_spec_str(spec)} of {proj}/{key}")
            splits.append(FactorSplit(rows, rank))
        pair = Pair(proj, members, b, a_shape[1], b_shape[-1], a_shape[-1], *splits)
        if 2 * pair.rank > min(pair.n_in, pair.n_out):
            raise ConfigError(f"Train.optimizer='loro': rank {pair.rank} of {proj} is above half "
                              f"of its width min({pair.n_in}, {pair.n_out}); the exact step's QR "
                              "of [A, dA] needs 2 r <= n")
        out.append(pair)
    return tuple(out)


def _spec_str(spec) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _factor_keys(pairs: tuple[Pair, ...]) -> set[tuple[str, str]]:
    return {(p.proj, k) for p in pairs for k in ("a", p.b)}


# --- the exact step ---------------------------------------------------------------------------
def _sign_fix(us: jax.Array, vs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Flip singular-vector pairs so each column of ``us`` has its largest-|.| entry > 0."""
    idx = jnp.argmax(jnp.abs(us), axis=-2, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(us, idx, axis=-2))
    sign = jnp.where(sign == 0, 1.0, sign)
    return us * sign, vs * sign


def _batched(fn, args: list[tuple[jax.Array, ...]]) -> list[tuple[jax.Array, ...]]:
    """``fn(*args[k])`` for every ``k`` (arrays ``[*lead_k, ...]``, ``fn`` batched over a
    leading axis and returning a tuple), those with equal trailing shapes in one call."""
    groups: dict[tuple, list[int]] = {}
    for k, xs in enumerate(args):
        groups.setdefault(tuple(x.shape[-2:] for x in xs), []).append(k)
    out: list = [None] * len(args)
    for shapes, idx in groups.items():
        inputs = [jnp.concatenate([args[k][j].reshape(-1, *shape) for k in idx])
                  for j, shape in enumerate(shapes)]
        results = fn(*inputs)
        start = 0
        for k in idx:
            lead = args[k][0].shape[:-2]
            n = math.prod(lead)
            out[k] = tuple(y[start:start + n].reshape(*lead, *y.shape[1:]) for y in results)
            start += n
    return out


@matrixwise
def _retraction(s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(Us, sigma, Vs)`` of ``s [N, 2r, 2r]``, signed by :func:`_sign_fix`."""
    us, sigma, vst = jnp.linalg.svd(s, full_matrices=False)
    us, vs = _sign_fix(us, jnp.swapaxes(vst, -1, -2))
    return us, sigma, vs


@matrixwise
def _solve_rt(r: jax.Array, x: jax.Array) -> jax.Array:
    """``R^-T X`` for upper-triangular ``R``."""
    return lax.linalg.triangular_solve(r, x, left_side=True, lower=False, transpose_a=True)


def exact_step(pairs: tuple[Pair, ...], factors: dict, dirs: dict, eta: jax.Array) -> dict:
    """The exact Riemannian step of every pair (module docstring): ``factors`` and ``dirs``
    (the Adam directions) as ``{(proj, key): local leaf}``; returns the new leaves."""
    blocks, axes, rows = [], [], []
    for p in pairs:
        a = gather_rank(_canonical_a(factors[p.proj, "a"], p), p.split_a.rank)
        da = gather_rank(_canonical_a(dirs[p.proj, "a"], p), p.split_a.rank)
        bt = gather_rank(_canonical_b(factors[p.proj, p.b], p), p.split_b.rank)
        dbt = gather_rank(_canonical_b(dirs[p.proj, p.b], p), p.split_b.rank)
        blocks += [jnp.concatenate([a, da], -1), jnp.concatenate([bt, dbt], -1)]
        axes += [p.split_a.rows, p.split_b.rows]
        rows += [p.n_in, p.n_out]
    qr = cholesky_qr(blocks, axes, rows)
    # Rm^-T [X^T, Z^T] = [K0, K1^T] and Rn^-T [Z'^T, 0] = [K2^T, 0], all pairs in one solve
    solves = []
    for i, p in enumerate(pairs):
        ra, rb, r = qr[2 * i][1], qr[2 * i + 1][1], p.rank
        t = lambda x: jnp.swapaxes(x, -1, -2)  # noqa: E731
        solves += [(rb[..., :r, :r], jnp.concatenate([t(ra[..., :r, r:]), t(ra[..., r:, r:])], -1)),
                   (ra[..., :r, :r], t(rb[..., r:, r:]))]
    solved = _batched(lambda t, x: (_solve_rt(t, x),), solves)
    mats = []
    for i, p in enumerate(pairs):
        ra, rb, r = qr[2 * i][1], qr[2 * i + 1][1], p.rank
        (k0_k1t,), (k2t,) = solved[2 * i], solved[2 * i + 1]
        rn, rm = ra[..., :r, :r], rb[..., :r, :r]
        top = jnp.matmul(rm, jnp.swapaxes(rn, -1, -2), precision=HIGHEST) - eta * k0_k1t[..., :r]
        k2 = jnp.swapaxes(k2t, -1, -2)
        mats.append(jnp.concatenate([
            jnp.concatenate([top, -eta * k0_k1t[..., r:]], -1),
            jnp.concatenate([-eta * k2, jnp.zeros_like(k2)], -1)], -2))
    new: dict = {}
    retractions = _batched(_retraction, [(m,) for m in mats])
    for i, (p, (us, sigma, vs)) in enumerate(zip(pairs, retractions)):
        qa, qb, r = qr[2 * i][0], qr[2 * i + 1][0], p.rank
        root = jnp.sqrt(sigma[..., None, :r])
        a_new = local_rank(jnp.matmul(qa, vs[..., :r] * root, precision=HIGHEST),
                           p.split_a.rank)
        bt_new = local_rank(jnp.matmul(qb, us[..., :r] * root, precision=HIGHEST),
                            p.split_b.rank)
        # back to the stored layouts
        b_new = jnp.swapaxes(bt_new, -1, -2)
        new[p.proj, p.b] = b_new if p.members is not None else b_new[..., 0, :, :]
        if p.members is None:
            new[p.proj, "a"] = a_new[..., 0, :, :]
        else:
            new.setdefault((p.proj, "a"), []).append(jnp.moveaxis(a_new, -3, -2))
    return {k: jnp.concatenate(v, -2) if isinstance(v, list) else v for k, v in new.items()}


# --- the transformation -----------------------------------------------------------------------
def loro(train: Train, schedule: optax.Schedule, pairs: tuple[Pair, ...], d_model: int
         ) -> optax.GradientTransformation:
    """LORO over a parameter tree with the ``pairs`` (module docstring); ``schedule``: the
    learning rate of update ``k`` (restart warm-up included). ``update`` runs per device on the
    local shards the pairs' splits describe (inside the region), or on whole arrays."""
    adamw = moments(train, schedule)
    keys, every = _factor_keys(pairs), train.loro_exact_every
    scaler = train.loro_lr_scaler
    scale = {(p.proj, k): p.rank / d_model if scaler < 0 else scaler
             for p in pairs for k in ("a", p.b)}
    b1, b2, wd = train.beta1, train.beta2, train.weight_decay

    def init(params):
        return LoroState(jnp.zeros([], jnp.int32), adamw.init(params))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("loro needs the parameters")
        updates, inner = adamw.update(grads, state.adamw, params)
        adam = adam_state(inner)
        t = adam.count.astype(jnp.result_type(float))  # updates since the refresh, this one incl.
        lr = schedule(state.count)
        eta = lr * jnp.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
        if train.loro_regular == "authors":  # the factors' entries are replaced below
            updates = authors_regular(params, adam, lr, eta, wd)
        blocks, mu, nu = params[BLOCKS], adam.mu[BLOCKS], adam.nu[BLOCKS]
        factors = {k: blocks[k[0]][k[1]] for k in keys}
        dirs = {k: mu[k[0]][k[1]] / (jnp.sqrt(nu[k[0]][k[1]]) + LORO_EPS) for k in keys}

        def lazy(factors, dirs, eta):
            out = {}
            for k, x in factors.items():
                x = x - eta * scale[k] * dirs[k]
                out[k] = x - eta * wd * x if wd else x
            return out

        exact = (state.count + 1) % every == 0
        with jax.named_scope("loro_exact"):
            new = lax.cond(exact, functools.partial(exact_step, pairs), lazy, factors, dirs,
                           eta)
        out_blocks = {k: dict(v) if isinstance(v, dict) else v for k, v in updates[BLOCKS].items()}
        for (proj, key), x in new.items():
            out_blocks[proj][key] = (x - factors[proj, key]).astype(x.dtype)
        updates = dict(updates, **{BLOCKS: out_blocks})
        inner = refresh(inner, exact) if train.loro_reset_moments else inner
        return updates, LoroState(state.count + 1, inner)

    return optax.GradientTransformation(init, update)


# --- construction and validation --------------------------------------------------------------
def check_loro(model: Model, parallel: Parallel | None = None, gspmd: bool = False) -> None:
    """ConfigError (one line, before compilation) for what LORO does not run."""
    if model.arch != "svd":
        raise ConfigError(f"Train.optimizer='loro' trains svd factor pairs (W = A B, nothing "
                          f"between them); Model.arch={model.arch!r} needs 'adamw'")
    if parallel is None:
        return
    if parallel.zero:
        raise ConfigError(f"Train.optimizer='loro' with Parallel.zero={parallel.zero} is not "
                          "implemented (the exact step needs whole factor rows); use zero=0")
    if parallel.pipe > 1:
        raise ConfigError("Train.optimizer='loro' with pipeline parallelism (Parallel.pipe="
                          f"{parallel.pipe}) is not implemented")
    if gspmd:
        raise ConfigError("Train.optimizer='loro' under the GSPMD baseline is not implemented; "
                          "use the explicit plans")


def make_loro(train: Train, model: ShardedModel | Model | None) -> Optimizer:
    """The LORO :class:`Optimizer` for ``model`` (a ShardedModel: its plan's layout; a Model
    config: unsharded, one device)."""
    if model is None:
        raise ConfigError("Train.optimizer='loro' needs the model: make_optimizer(train, model)")
    if isinstance(model, Model):
        from boost_jax.parallel.runner import canonical_shapes
        cfg, shapes, specs = model, canonical_shapes(model), None
        check_loro(cfg)
    else:
        cfg, shapes, specs = model.cfg, model.param_shapes(), model.param_specs
        check_loro(cfg, model.parallel, model.gspmd)
    if jax.default_backend() == "cpu" and not lapack_threads_limited():
        logging.warning("Train.optimizer='loro' on CPU without OPENBLAS_NUM_THREADS: scipy's "
                        "OpenBLAS threads may slow the exact step several times over; start "
                        "with OPENBLAS_NUM_THREADS=1 (python -m boost_jax.train sets it)")
    pairs = find_pairs(shapes, specs)
    schedule = restart_schedule(lr_schedule(train), train.loro_exact_every)
    return Optimizer(loro(train, schedule, pairs, cfg.d_model), schedule, train.grad_clip)
