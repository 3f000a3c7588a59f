"""AdamW with linear warm-up, cosine decay to a floor, weight decay and global-norm clipping
(CoLA's recipe: betas 0.9/0.999, weight decay 0.01, clip 0.5, floor 0.1 x peak), optionally
with the low-rank factors' steps scaled (``Train.factor_lr_scale``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from boost_jax.config import ConfigError, Model, Train
from boost_jax.optim.optimizer import Optimizer, lr_schedule, weight_decay_mask

if TYPE_CHECKING:
    from boost_jax.parallel.runner import ShardedModel

#: the low-rank factors' leaves of a projection under ``blocks`` (models/projections.py)
FACTORS = frozenset({"a", "b", "b_q", "b_kv", "b_gu"})
ATTENTION_PROJECTIONS = frozenset({"qkv", "o"})

def make_adamw(train: Train, model: ShardedModel | Model | None = None) -> Optimizer:
    """Masked AdamW on :func:`lr_schedule`, its factors' steps scaled by
    ``Train.factor_lr_scale`` (which, negative, needs ``model``: a ShardedModel or a Model)."""
    schedule = lr_schedule(train)
    tx = optax.adamw(schedule, b1=train.beta1, b2=train.beta2, eps=1e-8,
                     weight_decay=train.weight_decay,
                     mask=weight_decay_mask(train))
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
    steps (optim/loro.py). Stateless; runs on any shard of the parameters (names, not
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
