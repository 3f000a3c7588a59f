"""``fullrank``: Megatron tensor parallelism for ``Model.arch='dense'``.

The residual stream is replicated. q/k/v and gate/up are column-split (heads and d_ff local),
o and down row-split; one all-reduce after attention and one after the MLP (*g*), and their
transposes at the two column-parallel inputs (*f*): ``4 d`` elements per token per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from boost_jax.models.remat import REDUCED, tag
from boost_jax.parallel.plans.base import TENSOR, VocabParallelPlan, f_op, g_op

if TYPE_CHECKING:
    from boost_jax.models.config import Model


@dataclasses.dataclass(frozen=True)
class FullRankPlan(VocabParallelPlan):
    name: ClassVar[str] = "fullrank"
    archs: ClassVar[tuple[str, ...]] = ("dense",)
    rules: ClassVar[Mapping[str, str | None]] = {
        "q_heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR, "vocab": TENSOR}

    @classmethod
    def divisible(cls, model: Model):
        return [("Model.n_heads", model.n_heads), ("Model.n_kv_heads", model.n_kv_heads),
                ("Model.d_ff", model.d_ff), *super().divisible(model)]

    def up(self, z, gemm):
        """Column-parallel: replicated input, output split on heads / d_ff."""
        return gemm(f_op(z))

    def down(self, x, gemm):
        """Row-parallel: split input, partial products summed."""
        return tag(g_op(gemm(x)), REDUCED)
