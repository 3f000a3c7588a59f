"""``vanilla``: low-rank TP done the naive way -- every (A, B) pair is one Megatron chunk.
The baseline BOOST is measured against.

A is column-split on the rank (``[d_in, r/p]``), B row-split on it (``[r/p, d_out]``); each
projection ends with an all-reduce of its full-width output. The residual stream, the attention
core and ``gate * up`` are replicated (computed redundantly on every rank). Per token per layer
(MHA): forward ``5 d + 2 d_ff``, backward ``3 d + d_ff`` elements.

LaX's crossing mixes the whole r-wide latent (the Kronecker or dense gate, the latent
LayerNorm), which this plan splits on the rank. It does what a naive plan does for an operation
it cannot split: all-gather the latent (``[b, s, c, r/p] -> [b, s, c, r]``, one collective per
projection) and compute the crossing on it replicated, with the single-device code, exactly as
``btp`` computes it on its replicated latents; each rank then keeps its ``r/p`` slice for its B
factor, and the whole crossed latent is what the next block crosses (so ``prev`` is never
gathered). In the backward pass the slice's transpose is *f*'s all-reduce of the ``[b, s, c, r]``
cotangent -- the collective ``btp`` has at its B inputs. LaX adds per token per layer
``3 r_a + r_a + 2 r_m + r_m`` elements each way, all-gathers forward and all-reduces backward:
``btp``'s latent traffic on top of vanilla's. The elementwise crossing (identity gate, no norm)
needs nothing and stays on the slices.

Why not cheaper: the gather is typed invariant (the same on every rank), so the gate and norm
parameters, replicated, get whole gradients; a varying gather (backward: a reduce-scatter, half
the all-reduce's wire bytes) would leave each rank a partial gradient of them and cost an
all-reduce of those gradients in every layer. For the norm alone (identity gate) an all-reduce
of its two statistics per token (``2 c`` elements) would replace the gather, but it splits the
norm's gain and bias on the rank -- again a per-layer all-reduce of their gradients, or a rank
split of those parameters that no other configuration has -- for a variant that is this
project's, not the LaX authors' (theirs, the Kronecker gate with the norm, needs the whole latent
anyway). One mechanism keeps the baseline's cost a single formula.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import jax
from jax import lax

from boost_jax.compat import all_gather_invariant
from boost_jax.kernels.reference import activate
from boost_jax.models.boundaries import Crossing
from boost_jax.models.norms import rms_norm
from boost_jax.models.remat import LATENT, REDUCED, tag
from boost_jax.parallel.plans.base import TENSOR, VocabParallelPlan, f_op, g_op

if TYPE_CHECKING:
    from boost_jax.models.config import Model


@dataclasses.dataclass(frozen=True)
class VanillaPlan(VocabParallelPlan):
    name: ClassVar[str] = "vanilla"
    archs: ClassVar[tuple[str, ...]] = ("svd", "cola", "lax")
    rules: ClassVar[Mapping[str, str | None]] = {"rank": TENSOR, "vocab": TENSOR}

    @classmethod
    def divisible(cls, model: Model):
        return [("Model.attn_rank", model.attn_rank), ("Model.mlp_rank", model.mlp_rank),
                *super().divisible(model)]

    def norm_down(self, h, scale, eps, gemm, act="identity"):
        return activate(tag(gemm(f_op(rms_norm(h, scale, eps))), LATENT), act)

    def down(self, x, gemm):
        """A factor: replicated input, latent split on the rank."""
        return tag(gemm(f_op(x)), LATENT)

    def up(self, z, gemm):
        """B factor: rank-split latent, full-width output all-reduced."""
        return tag(g_op(gemm(z)), REDUCED)

    def cross(self, z: jax.Array, prev: jax.Array | None, crossing: Crossing,
              elementwise: bool) -> tuple[jax.Array, jax.Array]:
        """LaX on the rank-split latent ``z [b, s, (c,) r/p]`` (split on ``tensor``).

        Elementwise: on the slices, ``prev`` the previous block's slice. Otherwise all-gather
        ``z`` to the replicated ``[b, s, (c,) r]`` (kept by the ``lowrank`` remat policy, so
        the recomputation gathers nothing), cross it with the whole ``prev`` (replicated) and
        return ``(this rank's r/p slice, split on tensor; the whole crossed latent,
        replicated)``.
        """
        if elementwise:
            return super().cross(z, prev, crossing, elementwise)
        width = z.shape[-1]
        y = crossing(tag(all_gather_invariant(z, TENSOR, z.ndim - 1), LATENT), prev)
        mine = lax.dynamic_slice_in_dim(f_op(y), lax.axis_index(TENSOR) * width, width, -1)
        return mine, y
