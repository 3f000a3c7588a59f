"""Tensor-parallel plans, chosen with ``Parallel.tp_plan``: ``none`` (no TP, the reference),
``fullrank`` (Megatron, dense), ``vanilla`` (naive low-rank TP) and ``btp`` (BOOST)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp

from boost_jax.errors import ConfigError
from boost_jax.kernels import compute_capability
from boost_jax.kernels import resolve as resolve_kernels
from boost_jax.models.boundaries import Plan
from boost_jax.parallel.plans.btp import BTPPlan
from boost_jax.parallel.plans.fullrank import FullRankPlan
from boost_jax.parallel.plans.vanilla import VanillaPlan

if TYPE_CHECKING:
    from boost_jax.models.config import Model
    from boost_jax.parallel.config import Parallel

#: ``Parallel.tp_plan`` -> the plan's class
PLANS: dict[str, type[Plan]] = {cls.name: cls for cls in (Plan, FullRankPlan, VanillaPlan,
                                                          BTPPlan)}


def check(model: Model, parallel: Parallel) -> None:
    """Raise ConfigError (one line) if ``model`` cannot run under ``parallel``'s plan: the
    archs it runs, the sizes it splits over ``tensor``, and (btp) the kernels' payload. Static:
    nothing is built and no device is asked (``Config`` calls it when it is made)."""
    PLANS[parallel.tp_plan].check(model, parallel.tensor)
    if parallel.tp_plan == "btp":
        _check_kernels(parallel)


def get_plan(parallel: Parallel, device=None) -> Plan:
    """The plan for ``parallel.tp_plan`` and its options (how the blocks run -- remat,
    attention, the per-layer hook -- is the runner's :class:`~boost_jax.models.execution.
    Execution`). ``Parallel.kernels`` is resolved here (btp) for ``device`` (one of the mesh's;
    ``None``: the default backend's), whose compute capability the Triton kernels are compiled
    for."""
    options = dict(grouped=parallel.grouping)
    if parallel.tp_plan != "btp":
        return PLANS[parallel.tp_plan](**options)
    payload = jnp.float32 if parallel.norm_payload == "float32" else None
    kernels = _kernels(parallel, None if device is None else device.platform)
    return BTPPlan(rmsnorm=parallel.rmsnorm, payload_dtype=payload, kernels=kernels,
                   compute_capability=compute_capability(device) if kernels == "triton"
                   else None, stat=parallel.norm_payload, **options)


def _lanes(parallel: Parallel) -> bool:
    """Does the online statistic ride in the payload's lanes (``norm_payload='lanes'``)?"""
    return parallel.rmsnorm == "online" and parallel.norm_payload == "lanes"


def _kernels(parallel: Parallel, platform: str | None) -> str:
    """``Parallel.kernels`` resolved for btp: the Triton recovery reads the statistic as the
    payload's last element, so the statistic's lanes (``norm_payload='lanes'``) run on XLA
    under ``auto``, and ``triton`` asks for another payload (:func:`_check_kernels`)."""
    _check_kernels(parallel)
    return resolve_kernels("xla" if _lanes(parallel) and parallel.kernels == "auto"
                           else parallel.kernels, platform)


def _check_kernels(parallel: Parallel) -> None:
    if _lanes(parallel) and parallel.kernels == "triton":
        raise ConfigError("Parallel.kernels='triton' needs Parallel.norm_payload='float32' or "
                          "'compute': the Triton recovery kernel does not read the statistic's "
                          "lanes (norm_payload='lanes'); or use Parallel.kernels='xla'")
