"""Tensor-parallel plans, chosen with ``Parallel.tp_plan``."""

from __future__ import annotations

from boost_jax.config import Parallel
from boost_jax.parallel.plans.base import Plan


def get_plan(parallel: Parallel) -> Plan:
    """The plan object for ``parallel.tp_plan``."""
    if parallel.tp_plan == "none":
        return Plan()
    raise NotImplementedError(f"Parallel.tp_plan={parallel.tp_plan!r} is not implemented yet")
