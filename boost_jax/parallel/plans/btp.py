"""``btp``: Bottleneck-aware tensor parallelism (BOOST, arXiv 2512.12131).

Every chunk boundary is shifted by one factor: a chunk starts at a B factor, column-split on
its full output dim (``d`` or ``d_ff``), and ends at the next A factor, row-split on its full
input dim; the only collective is the all-reduce of that A's partial output -- an ``r``-wide
latent. The residual stream stays split on ``d`` between layers (rank ``i`` holds columns
``[i d/p, (i+1) d/p)``), heads and ``d_ff`` are local, and no layer parameter is replicated.

Per token per layer (online RMSNorm, grouping on): forward all-reduces of widths
``3r+k, r, 2r+k, r`` and backward ones of ``3r, r, 2r, r`` (the transposes of *f* at the B
inputs) -- ``14 r + 2k`` elements, ``k`` the statistic's elements (1, or ``3p`` bf16 lanes:
parallel/online_rmsnorm.py). The embedding reduce-scatters straight into the residual
shard; the final norm runs on the shards (its statistic all-reduced) and its output is
all-gathered for the vocab-parallel head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import jax.numpy as jnp
from jax import lax

from boost_jax.models.norms import sum_squares
from boost_jax.models.remat import LATENT, NORM_STAT, tag
from boost_jax.parallel.online_rmsnorm import online_norm_down, sync_norm_down
from boost_jax.parallel.plans.base import TENSOR, VocabParallelPlan, f_op, g_op
from boost_jax.parallel.vocab import vocab_embed

if TYPE_CHECKING:
    from boost_jax.models.config import Model


@dataclasses.dataclass(frozen=True)
class BTPPlan(VocabParallelPlan):
    name: ClassVar[str] = "btp"
    archs: ClassVar[tuple[str, ...]] = ("svd", "cola", "lax")
    rules: ClassVar[Mapping[str, str | None]] = {
        "embed": TENSOR, "q_heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR, "vocab": TENSOR}
    #: the all-gathered hidden state is already 'varying'
    replicated_hidden: ClassVar[bool] = False

    #: ``online`` | ``sync``: where the RMSNorm statistic of a norm_down travels
    rmsnorm: str = "online"
    #: the online payload's dtype (fp32 for ``norm_payload='float32'``; None: the compute dtype)
    payload_dtype: Any = None
    #: ``xla`` | ``triton``: who runs the online norm's local pass and recovery
    kernels: str = "xla"
    #: the CUDA compute capability the Triton kernels are compiled for (``90``: sm_90; from the
    #: mesh's devices, mock GPUs of a deviceless compile included; None: jax-triton asks)
    compute_capability: int | None = None
    #: ``lanes`` | ``compute``: how the online statistic rides in a bf16 payload
    stat: str = "lanes"

    @classmethod
    def divisible(cls, model: Model):
        # d_model = n_heads * head_dim, so heads dividing implies d does
        return [("Model.n_heads", model.n_heads), ("Model.n_kv_heads", model.n_kv_heads),
                ("Model.d_ff", model.d_ff), *super().divisible(model)]

    def embed(self, tokens, table):
        """This rank's ``[b, s, d/p]`` block of the embedding (one reduce-scatter)."""
        return vocab_embed(tokens, table, scatter=True)

    def norm_down(self, h, scale, eps, gemm, act="identity"):
        if self.rmsnorm == "online":
            return online_norm_down(h, scale, eps, gemm, self.payload_dtype, act, self.kernels,
                                    self.stat, self.compute_capability)
        return sync_norm_down(h, scale, eps, gemm, act)

    def down(self, x, gemm):
        """A factor: row-split on its full input dim; the r-wide latent is all-reduced."""
        return tag(g_op(gemm(x)), LATENT)

    def up(self, z, gemm):
        """B factor: replicated latent in, output split on its full dim (no collective)."""
        return gemm(f_op(z))

    def final_norm(self, h, scale, eps):
        """Normalise the residual shards where they are (the statistic all-reduced, ``[b, s,
        1]``; the gain split like the residual), then all-gather ``[b, s, d/p] -> [b, s, d]``
        for the vocab-parallel head: the norm's work and activations stay ``1/p`` wide."""
        d = h.shape[-1] * lax.axis_size(TENSOR)
        s = tag(lax.psum(sum_squares(h), TENSOR), NORM_STAT)
        y = h.astype(jnp.float32) * lax.rsqrt(s / d + eps) * scale.astype(jnp.float32)
        return lax.all_gather(y.astype(h.dtype), TENSOR, axis=h.ndim - 1, tiled=True)
