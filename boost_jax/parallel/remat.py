"""Activation checkpointing of decoder blocks (``Parallel.remat``), aligned with the chunks of
the tensor-parallel plan.

Values at chunk boundaries are tagged with :func:`jax.ad_checkpoint.checkpoint_name` where they
are made: the plans tag every collective's output (and the low-rank latents), the block tags
the residual stream between attention and MLP. The policies:

``none``
    keep every activation.
``full``
    keep only the block input; the backward pass recomputes the whole block -- under tensor
    parallelism that replays the forward collectives (the baseline of BOOST §5).
``lowrank``
    keep only what crosses a chunk boundary -- ``latent`` (the r-wide post-collective latents
    and low-rank A outputs), ``reduced`` (full-width post-collective outputs: vanilla's B
    outputs, fullrank's o/down), ``norm_stat`` (RMS statistics that crossed a collective) and
    ``residual`` -- and recompute the rest. Every collective's output is kept, so the
    recomputation is rank-local: the backward pass issues no collective that ``none`` does not.
    On one device (plan ``none``) this is CoLA-M; under ``btp`` it is BOOST's
    communication-free low-rank checkpointing.
``lowrank_attn``
    ``lowrank`` plus the attention core's output (``attention``): trades memory for not
    recomputing attention.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from boost_jax.compat import nothing_saveable, save_only_these_names

LATENT = "latent"
REDUCED = "reduced"
NORM_STAT = "norm_stat"
RESIDUAL = "residual"
ATTENTION = "attention"

SAVED = {
    "lowrank": (LATENT, REDUCED, NORM_STAT, RESIDUAL),
    "lowrank_attn": (LATENT, REDUCED, NORM_STAT, RESIDUAL, ATTENTION),
}


def tag(x, name: str):
    """Name a value (or every leaf of a pytree) for the remat policies."""
    return jax.tree.map(lambda v: checkpoint_name(v, name), x)


def checkpointed(fn: Callable, remat: str, in_loop: bool = True) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the policy named ``remat`` (``none``: as is).

    ``in_loop``: ``fn`` is a ``lax.scan`` body, where common-subexpression elimination cannot
    merge the recomputation into the forward pass, so ``prevent_cse`` may stay off.
    """
    if remat == "none":
        return fn
    policy = nothing_saveable() if remat == "full" else save_only_these_names(*SAVED[remat])
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_loop)
