"""AdamW with linear warm-up, cosine decay to a floor, weight decay and global-norm clipping
(CoLA's recipe: betas 0.9/0.999, weight decay 0.01, clip 0.5, floor 0.1 x peak)."""

from __future__ import annotations

import jax
import optax

from boost_jax.config import Train

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


def make_optimizer(train: Train) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = lr_schedule(train)
    tx = optax.chain(
        optax.clip_by_global_norm(train.grad_clip),
        optax.adamw(schedule, b1=train.beta1, b2=train.beta2, eps=1e-8,
                    weight_decay=train.weight_decay, mask=decay_mask),
    )
    return tx, schedule
