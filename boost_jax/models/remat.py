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

Under FSDP (``Parallel.zero=3``) a block starts by all-gathering its parameters (tagged
``gathered``), which must never be kept for the backward pass -- that would hold every layer's
whole parameters at once. So the block is always checkpointed: ``none`` becomes "keep every
matmul output and every tagged activation, recompute the elementwise rest and gather the
parameters again"; the other policies keep what they keep anyway, which never includes them.
The same holds for a block that slices its parameters out of a pipeline stage's in every
pipeline iteration (the circular schedule, and FSDP under a pipeline: ``Decoder.run_blocks``'
``repeat``): a kept slice, or any value made from it, is a copy of the layer's parameters per
iteration, so such a block is checkpointed in the same way (``gathers``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from boost_jax.compat import (
    dots_saveable,
    nothing_saveable,
    save_from_both_policies,
    save_only_these_names,
)

LATENT = "latent"
REDUCED = "reduced"
NORM_STAT = "norm_stat"
RESIDUAL = "residual"
ATTENTION = "attention"
GATHERED = "gathered"  # a layer's parameters all-gathered over data (FSDP)

SAVED = {
    "lowrank": (LATENT, REDUCED, NORM_STAT, RESIDUAL),
    "lowrank_attn": (LATENT, REDUCED, NORM_STAT, RESIDUAL, ATTENTION),
}


def tag(x, name: str):
    """Name a value (or every leaf of a pytree) for the remat policies."""
    return jax.tree.map(lambda v: checkpoint_name(v, name), x)


def checkpointed(fn: Callable, remat: str, in_loop: bool = True, gathers: bool = False
                 ) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the policy named ``remat`` (``none``: as is).

    ``in_loop``: ``fn`` is a ``lax.scan`` body, where common-subexpression elimination cannot
    merge the recomputation into the forward pass, so ``prevent_cse`` may stay off.
    ``gathers``: ``fn`` all-gathers its parameters (FSDP), or slices them out of a pipeline
    stage's in every iteration (see the module docstring).
    """
    if remat == "none" and not gathers:
        return fn
    if remat == "none":
        every_tag = {n for names in SAVED.values() for n in names}
        policy = save_from_both_policies(dots_saveable(), save_only_these_names(*every_tag))
    elif remat == "full":
        policy = nothing_saveable()
    else:
        policy = save_only_these_names(*SAVED[remat])
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_loop)
