"""The :class:`Optimizer` record every optimizer builder returns (AdamW, optim/adamw.py; LORO,
optim/loro.py), and what they share: the learning-rate schedule, the weight-decay mask and
clipping by a given global norm.

An optimizer is an elementwise optax transformation, so it runs unchanged on any shard of the
parameters (inside the model's ``shard_map`` region, on a ZeRO slice). Clipping needs the
global norm, which on sharded gradients takes a collective: the train step computes it (with
:meth:`DataLayout.global_norm <boost_jax.parallel.zero.DataLayout.global_norm>`, or
``optax.global_norm`` on global arrays) and clips with :func:`clip_by_norm`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from boost_jax.config import Train

#: the state of optax's ``scale_by_schedule``, whose ``count`` the learning rate is read at
_SCHEDULE_STATE = optax.ScaleByScheduleState.__name__
#: parameters without weight decay (norm gains/biases and LaX gate biases)
NO_DECAY = frozenset({"attn_norm", "mlp_norm", "final_norm", "norm_scale", "norm_bias", "gate_b"})



def lr_schedule(train: Train) -> optax.Schedule:
    """Learning rate of the update made *at* optimizer step ``count`` (0-based).

    Warm-up is linear and the first update already uses ``lr / warmup_steps`` -- or, with
    ``Train.warmup_from_zero``, uses 0 and update ``k`` uses ``k / warmup_steps * lr``, as the
    low-rank papers' ``LambdaLR`` (alvin-zyl/CoLA ``pretraining_utils/training_utils.py``
    lines 133-144: ``cycle_step / warmup``, then the same cosine); the cosine runs to
    ``min_lr_ratio * lr`` at ``Train.horizon`` and stays there (theirs restarts a cycle).
    """
    peak, floor = train.learning_rate, train.learning_rate * train.min_lr_ratio
    if train.warmup_steps == 0:
        base = optax.cosine_decay_schedule(peak, train.horizon, alpha=train.min_lr_ratio)
        return lambda count: base(count)
    base = optax.warmup_cosine_decay_schedule(0.0, peak, train.warmup_steps, train.horizon, floor)
    offset = 0 if train.warmup_from_zero else 1
    return lambda count: base(count + offset)


def decay_mask(params: dict) -> dict:
    """True for every parameter that gets weight decay (all but :data:`NO_DECAY`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in NO_DECAY for k in path), params)


def weight_decay_mask(train: Train):
    """The mask AdamW's weight decay takes: :func:`decay_mask`, or ``None`` (every parameter)
    with ``Train.decay_norms``."""
    return None if train.decay_norms else decay_mask


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """``tx``: the elementwise update (masked AdamW on the schedule); ``schedule``: its learning
    rate per optimizer step; ``max_norm``: the global gradient norm clipped to before ``tx``."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    max_norm: float

    def lr(self, opt_state: optax.OptState) -> jax.Array:
        """The learning rate of the next update ``tx`` makes from ``opt_state``: ``schedule``
        at the optimizer's own count (its ``ScaleByScheduleState``'s), which a skipped
        (non-finite) step does not advance, unlike the train state's step."""
        count = optax.tree_utils.tree_get(
            opt_state, "count",
            filtering=lambda path, _: getattr(path[-1], "tuple_name", None) == _SCHEDULE_STATE)
        return self.schedule(count)


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """``optax.clip_by_global_norm`` with the norm given: gradients scaled by
    ``max_norm / norm`` when ``norm`` exceeds it; unchanged when ``max_norm`` is 0 (no
    clipping, as the papers' ``--grad_clipping 0``). (A scalar factor times each gradient:
    XLA fuses the product into the update instead of writing the clipped gradients out.)"""
    if max_norm <= 0:
        return grads
    scale = jnp.where(norm >= max_norm, max_norm / norm, 1.0)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
