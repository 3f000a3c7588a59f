"""``vanilla``: low-rank TP done the naive way -- every (A, B) pair is one Megatron chunk.
The baseline BOOST is measured against.

A is column-split on the rank (``[d_in, r/p]``), B row-split on it (``[r/p, d_out]``); each
projection ends with an all-reduce of its full-width output. The residual stream, the attention
core and ``gate * up`` are replicated (computed redundantly on every rank). Per token per layer
(MHA): forward ``5 d + 2 d_ff``, backward ``3 d + d_ff`` elements.
"""

from __future__ import annotations

from boost_jax.config import ConfigError, Model
from boost_jax.kernels.reference import activate
from boost_jax.models.norms import rms_norm
from boost_jax.parallel.plans.base import TENSOR, VocabParallelPlan, f_op, g_op
from boost_jax.parallel.remat import LATENT, REDUCED, tag


class VanillaPlan(VocabParallelPlan):
    name = "vanilla"
    archs = ("svd", "cola", "lax")
    rules = {"rank": TENSOR, "vocab": TENSOR}

    def check(self, model: Model, tensor: int) -> None:
        super().check(model, tensor)
        if model.arch == "lax" and (model.lax_gate != "identity" or model.lax_latent_norm):
            raise ConfigError("Parallel.tp_plan='vanilla' splits latents on the rank, so LaX's "
                              f"Model.lax_gate={model.lax_gate!r} / lax_latent_norm="
                              f"{model.lax_latent_norm} (the defaults are the authors' "
                              "kronecker / True) would need the whole latent; use "
                              "tp_plan='btp', or this project's variant "
                              "Model.lax_gate='identity', Model.lax_latent_norm=False")

    def divisible(self, model: Model):
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
