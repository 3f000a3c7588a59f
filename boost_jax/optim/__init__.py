"""Optimizers, each an optax transformation that runs unchanged on any shard of the parameters:
the :class:`~boost_jax.optim.optimizer.Optimizer` record every builder returns, with the
schedule, the weight-decay mask and clipping (:mod:`.optimizer`); AdamW (:mod:`.adamw`); LORO
(:mod:`.loro`, :mod:`.loro_adam`; its collectives in parallel/loro_qr.py). The one that
``Train.optimizer`` names is chosen here (:func:`make_optimizer`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from boost_jax.config import Model, Train
from boost_jax.optim.adamw import make_adamw
from boost_jax.optim.loro import make_loro
from boost_jax.optim.optimizer import Optimizer

if TYPE_CHECKING:
    from boost_jax.parallel.runner import ShardedModel

#: ``Train.optimizer`` -> its builder ``(train, model) -> Optimizer``
BUILDERS: dict[str, Callable[..., Optimizer]] = {"adamw": make_adamw, "loro": make_loro}


def make_optimizer(train: Train, model: ShardedModel | Model | None = None) -> Optimizer:
    """The optimizer ``train`` names: AdamW (any model), or LORO, which needs ``model`` -- the
    ShardedModel whose layout the update runs on, or a Model config for one unsharded device --
    and raises ConfigError for what it does not run."""
    return BUILDERS[train.optimizer](train, model)
