"""AdamW with linear warm-up, cosine decay to a floor, weight decay and global-norm clipping
(CoLA's recipe: betas 0.9/0.999, weight decay 0.01, clip 0.5, floor 0.1 x peak).

The optimizer is an elementwise optax transformation, so it runs unchanged on any shard of the
parameters (inside the model's ``shard_map`` region, on a ZeRO slice). Clipping needs the
global norm, which on sharded gradients takes a collective: the train step computes it (with
:meth:`DataLayout.global_norm <boost_jax.parallel.zero.DataLayout.global_norm>`, or
``optax.global_norm`` on global arrays) and clips with :func:`clip_by_norm`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from boost_jax.config import ConfigError, Model, Train

if TYPE_CHECKING:
    from boost_jax.parallel.runner import ShardedModel

#: the state of optax's ``scale_by_schedule``, whose ``count`` the learning rate is read at
_SCHEDULE_STATE = optax.ScaleByScheduleState.__name__
#: the low-rank factors' leaves of a projection under ``blocks`` (models/projections.py)
FACTORS = frozenset({"a", "b", "b_q", "b_kv", "b_gu"})
ATTENTION_PROJECTIONS = frozenset({"qkv", "o"})
#: parameters without weight decay (norm gains/biases and LaX gate biases)
NO_DECAY = frozenset({"attn_norm", "mlp_norm", "final_norm", "norm_scale", "norm_bias", "gate_b"})


def lr_schedule(train: Train) -> optax.Schedule:
    """Learning rate of the update made *at* optimizer step ``count`` (0-based).

    Warm-up is linear and the first update already uses ``lr / warmup_steps``; the cosine runs
    to ``min_lr_ratio * lr`` at ``Train.horizon`` and stays there.
    """
    peak, floor = train.learning_rate, train.learning_rate * train.min_lr_ratio
    if train.warmup_steps == 0:
        base = optax.cosine_decay_schedule(peak, train.horizon, alpha=train.min_lr_ratio)
        return lambda count: base(count)
    base = optax.warmup_cosine_decay_schedule(0.0, peak, train.warmup_steps, train.horizon, floor)
    return lambda count: base(count + 1)


def decay_mask(params: dict) -> dict:
    """True for every parameter that gets weight decay."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in NO_DECAY for k in path), params)


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


def make_optimizer(train: Train, model: ShardedModel | Model | None = None) -> Optimizer:
    """The optimizer ``train`` names: AdamW (any model), or LORO (train/loro.py), which needs
    ``model`` -- the ShardedModel whose layout the update runs on, or a Model config for one
    unsharded device -- and raises ConfigError for what it does not run."""
    if train.optimizer == "loro":
        from boost_jax.train.loro import make_loro
        return make_loro(train, model)
    schedule = lr_schedule(train)
    tx = optax.adamw(schedule, b1=train.beta1, b2=train.beta2, eps=1e-8,
                     weight_decay=train.weight_decay, mask=decay_mask)
    if train.factor_lr_scale != 1.0:
        cfg = model if isinstance(model, Model) else getattr(model, "cfg", None)
        if cfg is None and train.factor_lr_scale < 0:
            raise ConfigError("Train.factor_lr_scale < 0 (rank/d_model) needs the model: "
                              "make_optimizer(train, model)")
        tx = optax.chain(tx, scale_factors(train.factor_lr_scale, cfg))
    return Optimizer(tx, schedule, train.grad_clip)


def scale_factors(scale: float, model: Model | None) -> optax.GradientTransformation:
    """Multiply the updates of the low-rank factors (the A and B leaves of every projection,
    :data:`FACTORS`) by ``scale``; a negative ``scale`` means ``rank / d_model`` per projection
    (the attention rank for q, k, v, o, the MLP rank for the rest), as LORO scales its factors'
    steps (train/loro.py). Stateless; runs on any shard of the parameters (names, not
    shapes)."""

    def factor(path) -> float:
        keys = [getattr(k, "key", None) for k in path]
        if keys[0] != "blocks" or keys[-1] not in FACTORS:
            return 1.0
        if scale > 0:
            return scale
        rank = model.attn_rank if keys[1] in ATTENTION_PROJECTIONS else model.mlp_rank
        return rank / model.d_model

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u * jnp.asarray(factor(path), u.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """``optax.clip_by_global_norm`` with the norm given: gradients scaled by
    ``max_norm / norm`` when ``norm`` exceeds it. (A scalar factor times each gradient: XLA
    fuses the product into the update instead of writing the clipped gradients out.)"""
    scale = jnp.where(norm >= max_norm, max_norm / norm, 1.0)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
