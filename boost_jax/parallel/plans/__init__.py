"""Tensor-parallel plans, chosen with ``Parallel.tp_plan``: ``none`` (no TP, the reference),
``fullrank`` (Megatron, dense), ``vanilla`` (naive low-rank TP) and ``btp`` (BOOST)."""

from __future__ import annotations

import jax.numpy as jnp

from boost_jax.config import Parallel
from boost_jax.kernels import resolve as resolve_kernels
from boost_jax.parallel.plans.base import Plan
from boost_jax.parallel.plans.btp import BTPPlan
from boost_jax.parallel.plans.fullrank import FullRankPlan
from boost_jax.parallel.plans.vanilla import VanillaPlan


def get_plan(parallel: Parallel) -> Plan:
    """The plan object for ``parallel.tp_plan`` (and its options)."""
    options = dict(grouped=parallel.grouping, remat=parallel.remat)
    if parallel.tp_plan == "none":
        return Plan(**options)
    if parallel.tp_plan == "fullrank":
        return FullRankPlan(**options)
    if parallel.tp_plan == "vanilla":
        return VanillaPlan(**options)
    payload = jnp.float32 if parallel.norm_payload == "float32" else None
    return BTPPlan(parallel.rmsnorm, payload, resolve_kernels(parallel.kernels), **options)
