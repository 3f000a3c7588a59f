"""The optimizer ``Train.optimizer`` names, chosen in this one place: AdamW (train/adamw.py)
or LORO (train/loro.py). Both return the :class:`~boost_jax.train.optimizer.Optimizer` record
(train/optimizer.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from boost_jax.config import Model, Train
from boost_jax.train.adamw import make_adamw
from boost_jax.train.loro import make_loro
from boost_jax.train.optimizer import Optimizer

if TYPE_CHECKING:
    from boost_jax.parallel.runner import ShardedModel

#: ``Train.optimizer`` -> its builder ``(train, model) -> Optimizer``
BUILDERS: dict[str, Callable[..., Optimizer]] = {"adamw": make_adamw, "loro": make_loro}


def make_optimizer(train: Train, model: ShardedModel | Model | None = None) -> Optimizer:
    """The optimizer ``train`` names: AdamW (any model), or LORO, which needs ``model`` -- the
    ShardedModel whose layout the update runs on, or a Model config for one unsharded device --
    and raises ConfigError for what it does not run."""
    return BUILDERS[train.optimizer](train, model)
