"""Tensor-parallel plans, chosen with ``Parallel.tp_plan``: ``none`` (no TP, the reference),
``fullrank`` (Megatron, dense), ``vanilla`` (naive low-rank TP) and ``btp`` (BOOST)."""

from __future__ import annotations

import jax.numpy as jnp

from boost_jax.config import ConfigError, Parallel
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
    return BTPPlan(parallel.rmsnorm, payload, _kernels(parallel), parallel.norm_payload,
                   **options)


def _kernels(parallel: Parallel) -> str:
    """``Parallel.kernels`` resolved for btp: the Triton recovery reads the statistic as the
    payload's last element, so the statistic's lanes (``norm_payload='lanes'``) run on XLA
    (``auto``), and ``triton`` asks for another payload."""
    lanes = parallel.rmsnorm == "online" and parallel.norm_payload == "lanes"
    if lanes and parallel.kernels == "triton":
        raise ConfigError("Parallel.kernels='triton' needs Parallel.norm_payload='float32' or "
                          "'compute': the Triton recovery kernel does not read the statistic's "
                          "lanes (norm_payload='lanes'); or use Parallel.kernels='xla'")
    return resolve_kernels("xla" if lanes and parallel.kernels == "auto" else parallel.kernels)
