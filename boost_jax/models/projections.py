"""The projection factory: dense, SVD, CoLA and LaX versions of the seven projections.

Kernels use ``x @ W`` orientation. A low-rank projection is ``y = sigma(x A) B`` with the *down*
factor ``A [d_in, r]`` and the *up* factor ``B [r, d_out]``; sigma is the identity
for ``svd`` and SiLU for ``cola`` and ``lax``. Projections that read the same input are stored
grouped, as BOOST computes them:

* :class:`Fanout` -- q/k/v or gate/up. Low-rank: one grouped ``A [d_in, c, r]`` (c = 3 or 2
  members) and, per output width, a batched ``B [m, r, d_out]`` (``b_q [1, r, d]`` and
  ``b_kv [2, r, d_kv]``; ``b_gu [2, r, d_ff]``). Dense: ``w_* [d_in, m, d_out]``.
* :class:`Single` -- o and down. Low-rank ``a [d_in, r]``, ``b [r, d]``; dense ``w [d_in, d]``.

Where a projection's GEMMs sit relative to collectives is the plan's business: the projection
hands each local matrix product to ``plan.norm_down`` / ``plan.down`` / ``plan.up``, and LaX's
crossing to ``plan.cross`` (which gathers the latent where the plan splits it).

LaX adds to each projection's pre-activation latent the post-activation latent
of the same projection in the previous block, through a gate, then LayerNorms the sum over its
r dims (eps 1e-6, affine); block 0 has no crossing. This follows the authors' ``TensorizedLinear``
(K1seki221/Latent_Crossing ``vits_pretraining/timm/models/lax_vit.py``: the forward at
303-318, the Kronecker gate at 200-205 and 269-277, the norm at 187) with their LaX-CoLA
config (``vits_pretraining/config/Lax_CoLA_vit_base_16_224.yaml:29-59``: crossing, gate and
Kronecker gate at all six ViT projections). The identity and dense r x r gates and the crossing
without norm are this project's variants.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.kernels.reference import activate
from boost_jax.models.boundaries import Plan
from boost_jax.models.init import Init, param
from boost_jax.models.norms import layer_norm

LAX_NORM_EPS = 1e-6


def cola_std(d_in: int, d_out: int, rank: int) -> float:
    """CoLA's init std for both factors: ``(d_in + d_out)^(-1/4) * r^(-1/4)``."""
    return (d_in + d_out) ** -0.25 * rank ** -0.25


def factor_stds(init: str, d_in: int, d_out: int, rank: int) -> tuple[float, float]:
    """Init std of ``(A [d_in, r], B [r, d_out])`` (``Model.lowrank_init``; normal draws).

    ``cola``: :func:`cola_std` for both. ``loro``: Xavier normal on each factor,
    ``sqrt(2 / (fan_in + fan_out))`` -- LORO's default ``xavier`` init
    (mzf666/LORO-main ``loro_torch/lowrank_module.py:40-42``, ``run_c4.py:139-143``).
    """
    if init == "loro":
        return math.sqrt(2 / (d_in + rank)), math.sqrt(2 / (rank + d_out))
    std = cola_std(d_in, d_out, rank)
    return std, std


def balanced_factors(n: int) -> tuple[int, int]:
    """``(a, b)`` with ``a * b == n``, ``a <= b`` and ``b - a`` minimal."""
    a = max(i for i in range(1, math.isqrt(n) + 1) if n % i == 0)
    return a, n // a


#: the activation between the factors (boost_jax.kernels.reference.activate names)
LATENT_ACTS = {"svd": "identity", "cola": "silu", "lax": "silu"}


def latent_act(arch: str, z: jax.Array) -> jax.Array:
    return activate(z, LATENT_ACTS[arch])


class Crossing(nnx.Module):
    """LaX latent crossing for ``members`` projections (``None``: no member axis).

    ``LayerNorm(z + gate(prev))`` with the Kronecker gate ``dec^T H enc`` (``H`` the latent
    reshaped row-major to ``[a, b]``, ``a * b = r``, ``a <= b`` closest) as the LaX authors'.
    Latents are ``[b, s, (members,) r]``; every parameter has a leading member axis when
    ``members`` is set.
    """

    def __init__(self, rank: int, members: int | None, gate: str, norm: bool):
        self.gate, self.use_norm, self.rank = gate, norm, rank
        self.grouped = members is not None
        lead, lead_axes = ((members,), (None,)) if self.grouped else ((), ())
        if gate == "dense":  # torch nn.Linear(r, r) default init: U(+-1/sqrt(r))
            bound = 1.0 / math.sqrt(rank)
            self.gate_w = param((*lead, rank, rank), Init("uniform", bound),
                                (*lead_axes, None, None))
            self.gate_b = param((*lead, rank), Init("uniform", bound), (*lead_axes, None))
        elif gate == "kronecker":  # kaiming-uniform factors of an (a x b)-reshaped latent
            a, b = balanced_factors(rank)
            self.gate_enc = param((*lead, b, b), Init("uniform", math.sqrt(6 / b)),
                                  (*lead_axes, None, None))
            self.gate_dec = param((*lead, a, a), Init("uniform", math.sqrt(6 / a)),
                                  (*lead_axes, None, None))
        if norm:
            self.norm_scale = param((*lead, rank), Init("ones"), (*lead_axes, None))
            self.norm_bias = param((*lead, rank), Init("zeros"), (*lead_axes, None))

    def _gate(self, prev: jax.Array) -> jax.Array:
        m = "m" if self.grouped else ""
        if self.gate == "identity":
            return prev
        if self.gate == "dense":
            out = jnp.einsum(f"bs{m}r,{m}rt->bs{m}t", prev, self.gate_w[...])
            return out + self.gate_b[...]
        a, b = balanced_factors(self.rank)
        grid = prev.reshape(*prev.shape[:-1], a, b)
        out = jnp.einsum(f"bs{m}cd,{m}cf,{m}de->bs{m}fe", grid, self.gate_dec[...],
                         self.gate_enc[...])
        return out.reshape(prev.shape)

    @property
    def elementwise(self) -> bool:
        """Does each latent coordinate cross on its own (identity gate, no norm)? Otherwise
        the crossing needs the whole r-wide latent (a plan that splits it gathers it)."""
        return self.gate == "identity" and not self.use_norm

    def __call__(self, z: jax.Array, prev: jax.Array | None) -> jax.Array:
        """``z`` pre-activation latent; ``prev`` the previous block's post-activation latent
        (``None`` in block 0, which has nothing to cross)."""
        if prev is None:
            return z
        y = z + self._gate(prev)
        if self.use_norm:
            y = layer_norm(y, self.norm_scale[...], self.norm_bias[...], LAX_NORM_EPS)
        return y


class _LowRankLatent:
    """Shared latent handling: crossing (LaX) then the latent activation."""

    arch: str

    def _latent(self, z: jax.Array, prev: jax.Array | None, plan: Plan
                ) -> tuple[jax.Array, jax.Array | None]:
        """Latent ``z`` in the plan's layout -> ``(sigma(z) for the B factor, the latent the next
        block crosses)``; LaX crosses through ``plan.cross``, which owns any collective the
        crossing needs."""
        if self.arch != "lax":
            return latent_act(self.arch, z), None
        return plan.cross(z, prev, lambda v, p: latent_act(self.arch, self.crossing(v, p)),
                          self.crossing.elementwise)


class Fanout(nnx.Module, _LowRankLatent):
    """Projections that read one normalised input: q/k/v or gate/up.

    Args:
      arch: dense | svd | cola | lax.
      d_in: input width (d_model).
      outs: output groups ``(name, members, d_out, logical_axis)``, e.g.
        ``(("q", 1, d, "q_heads"), ("kv", 2, d_kv, "kv_heads"))``.
      rank: latent width r (ignored for dense).
      init_std: std of dense weights.
      lax_gate, lax_norm: LaX options.
      init: ``Model.lowrank_init`` (:func:`factor_stds`).
    """

    def __init__(self, arch: str, d_in: int, outs: tuple, rank: int, init_std: float,
                 lax_gate: str = "kronecker", lax_norm: bool = True, init: str = "cola"):
        self.arch, self.outs, self.rank = arch, tuple(outs), rank
        self.members = sum(m for _, m, _, _ in outs)
        if arch == "dense":
            for name, m, d_out, axis in outs:
                setattr(self, f"w_{name}",
                        param((d_in, m, d_out), Init("normal", init_std), ("embed", None, axis)))
            return
        stds = {name: factor_stds(init, d_in, d_out, rank) for name, _, d_out, _ in outs}
        a_stds = tuple(stds[name][0] for name, m, _, _ in outs for _ in range(m))
        self.a = param((d_in, self.members, rank), Init("normal", a_stds, scale_axis=1),
                       ("embed", None, "rank"))
        for name, m, d_out, axis in outs:
            setattr(self, f"b_{name}", param((m, rank, d_out), Init("normal", stds[name][1]),
                                             (None, "rank", axis)))
        if arch == "lax":
            self.crossing = Crossing(rank, self.members, lax_gate, lax_norm)

    def __call__(self, h: jax.Array, scale: jax.Array, eps: float, plan: Plan,
                 prev: jax.Array | None = None) -> tuple[dict[str, jax.Array], jax.Array | None]:
        """Residual ``h [b, s, d_local]`` -> ``({name: [b, s, m, d_out_local]}, latent)``.

        ``latent`` (LaX only) is the post-activation ``[b, s, c, r]`` the next block crosses.
        ``plan.grouped`` chooses one GEMM (and collective) per group or one per member.
        """
        grouped = plan.grouped
        if self.arch == "dense":
            x = plan.norm(h, scale, eps)
            weights = {name: getattr(self, f"w_{name}")[...] for name, *_ in self.outs}
            if grouped:  # one f for all members: q and kv (or gate and up) read one input
                return plan.up(x, lambda v: {n: jnp.einsum("bsd,dmf->bsmf", v, w)
                                             for n, w in weights.items()}), None
            return {n: jnp.stack([plan.up(x, lambda v, wj=w[:, j]: v @ wj)
                                  for j in range(w.shape[1])], axis=2)
                    for n, w in weights.items()}, None
        a = self.a[...]
        # the plan applies sigma with the norm's recovery (one kernel on GPUs), except for
        # LaX, whose crossing comes between the two
        act = "identity" if self.arch == "lax" else LATENT_ACTS[self.arch]
        if grouped:
            z = plan.norm_down(h, scale, eps, lambda x: jnp.einsum("bsd,dcr->bscr", x, a), act)
        else:
            z = jnp.stack([plan.norm_down(h, scale, eps, lambda x, i=i: x @ a[:, i], act)
                           for i in range(self.members)], axis=2)
        z, latent = self._latent(z, prev, plan) if self.arch == "lax" else (z, None)
        b = {name: getattr(self, f"b_{name}")[...] for name, *_ in self.outs}
        slices, start = {}, 0
        for name, m, _, _ in self.outs:
            slices[name] = slice(start, start + m)
            start += m
        if grouped:  # one collective boundary for the whole [b, s, c, r] latent
            # split (not slices): its transpose concatenates the members' cotangents in one
            # buffer instead of padding each to [b, s, c, r] and adding them
            cuts = [sl.stop for sl in slices.values()][:-1]

            def gemm(v):
                parts = jnp.split(v, cuts, axis=2)
                return {n: jnp.einsum("bsmr,mrf->bsmf", part, b[n])
                        for n, part in zip(slices, parts)}
            return plan.up(z, gemm), latent
        return {n: jnp.stack([plan.up(z[:, :, sl.start + j], lambda v, bj=b[n][j]: v @ bj)
                              for j in range(sl.stop - sl.start)], axis=2)
                for n, sl in slices.items()}, latent


class Single(nnx.Module, _LowRankLatent):
    """One projection into the residual stream: o (``d -> d``) or down (``d_ff -> d``).

    Args:
      arch: dense | svd | cola | lax.
      d_in, d_out: widths; ``in_axis`` is the logical axis of the input (q_heads or mlp).
      rank, init_std, lax_gate, lax_norm, init: as for :class:`Fanout`.
    """

    def __init__(self, arch: str, d_in: int, d_out: int, in_axis: str, rank: int,
                 init_std: float, lax_gate: str = "kronecker", lax_norm: bool = True,
                 init: str = "cola"):
        self.arch, self.rank = arch, rank
        if arch == "dense":
            self.w = param((d_in, d_out), Init("normal", init_std), (in_axis, "embed"))
            return
        a_std, b_std = factor_stds(init, d_in, d_out, rank)
        self.a = param((d_in, rank), Init("normal", a_std), (in_axis, "rank"))
        self.b = param((rank, d_out), Init("normal", b_std), ("rank", "embed"))
        if arch == "lax":
            self.crossing = Crossing(rank, None, lax_gate, lax_norm)

    def __call__(self, x: jax.Array, plan: Plan, prev: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        """``x [b, s, d_in_local]`` -> ``(residual update [b, s, d_local], latent)``."""
        if self.arch == "dense":
            w = self.w[...]
            return plan.down(x, lambda v: v @ w), None
        a, b = self.a[...], self.b[...]
        z = plan.down(x, lambda v: v @ a)
        z, latent = self._latent(z, prev, plan)
        return plan.up(z, lambda v: v @ b), latent
