"""LORO's Adam side (optim/loro.py holds the factor pairs and their Riemannian steps): the
moments every parameter keeps, the rule of the *regular* group (every parameter that is not an
svd factor: embeddings, norms, head), the state refresh after an exact step and the restart
warm-up of the learning rate.

References are to the authors' code, github.com/mzf666/LORO-main at ``4da57b6``.

*Moments.* One ``optax.adamw`` chain holds them for every parameter: ``m <- b1 m + (1 - b1)
g``, ``v <- b2 v + (1 - b2) g^2``, uncorrected, and the count ``t`` of updates since the last
refresh. The factors' directions and the regular group's rule both read them from there.

*Regular group* (``Train.loro_regular``):

- ``'authors'`` (default): ``LOROAdamW._regular_step`` (``loro_torch/loro_optim.py:197-252``)
  with the eps of the constructor (``eps=1e-6``, ``loro_optim.py:140``; ``run_c4.py:617-623``
  passes none). The eps is added to the square root of the *uncorrected* ``v`` (``:227``), the
  bias correction is folded into the step size (``:229-234``), and the decoupled decay uses the
  scheduled ``lr`` (not the corrected one) on the value *after* the Adam step (``:248-252``)::

      eta = lr sqrt(1 - b2^t) / (1 - b1^t)
      p <- p - eta m / (sqrt(v) + 1e-6);   p <- p - lr wd p

  on every regular parameter, norms included: the group is every parameter that is not a
  factor (``loro_torch/lowrank_module.py:178-179, 185-192``), with no exclusion list.
  Equivalently ``mhat / (sqrt(vhat) + 1e-6 / sqrt(1 - b2^t))``: the effective eps is
  ``3.2e-5`` at ``t = 1`` and recurs after every refresh.
- ``'adamw'``: the masked ``optax.adamw`` of optim/adamw.py (eps ``1e-8`` on the corrected
  ``sqrt(vhat)``, decay ``lr wd p`` on the value before the step, none on norms).

*Refresh* (``Train.loro_reset_moments``, default True as the authors' scripts run it:
``scripts/loro_c4/*.sh`` pass ``--loro_refresh all --loro_refresh_freq`` equal to
``--loro_freq``): after the update that made an exact step every moment and every count is
zeroed, factors and regular group alike (``loro_optim.py:182-195``, called at
``run_c4.py:767-772``; the flag's own default, ``run_c4.py:117-121``, is no refresh).

*Restart warm-up*: one schedule drives every group (``run_c4.py:656-667``, a ``LambdaLR``,
``peft_pretraining/training_utils.py:134-144``); after each exact step its ``cosine_restart``
warms the rate up again over :data:`RESTART_WARMUP` steps from :data:`RESTART_EPS` of its value
(``training_utils.py:309-323``), here on top of the repository's cosine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from boost_jax.config import Train
from boost_jax.optim.optimizer import weight_decay_mask

#: LOROAdamW's eps (loro_optim.py:140): the factors' directions and the 'authors' regular rule
LORO_EPS = 1e-6
#: AdamW's eps (optim/adamw.py), the 'adamw' regular rule
ADAMW_EPS = 1e-8
#: run_c4.py --cosine_restart_warmup default: steps of learning-rate warm-up after a refresh
RESTART_WARMUP = 5
#: training_utils.py:239: the restart warm-up starts from this fraction of the learning rate
RESTART_EPS = 1e-6


def moments(train: Train, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The ``optax.adamw`` whose state holds every parameter's moments (and whose updates are
    the 'adamw' regular rule)."""
    return optax.adamw(schedule, b1=train.beta1, b2=train.beta2, eps=ADAMW_EPS,
                       weight_decay=train.weight_decay, mask=weight_decay_mask(train))


def adam_state(state: optax.OptState) -> optax.ScaleByAdamState:
    """The ``ScaleByAdamState`` (count, ``m``, ``v``) inside :func:`moments`' state."""
    found = [s for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)]
    return found[0]


def authors_regular(params, adam: optax.ScaleByAdamState, lr: jax.Array, eta: jax.Array,
                    weight_decay: float):
    """The updates of LOROAdamW's regular group (module docstring) for every leaf of
    ``params``; ``lr``: the scheduled rate, ``eta``: it bias-corrected at ``adam.count``."""
    def update(p, m, v):
        step = eta * (m / (jnp.sqrt(v) + LORO_EPS))
        decay = weight_decay * jnp.asarray(lr, step.dtype)  # not rounded to lr's fp32
        out = -step - decay * (p - step) if weight_decay else -step
        return out.astype(p.dtype)
    return jax.tree.map(update, params, adam.mu, adam.nu)


def refresh(state: optax.OptState, exact: jax.Array) -> optax.OptState:
    """Zero every Adam moment and count where ``exact`` (a select, fused into the update)."""
    def reset(s):
        if not isinstance(s, optax.ScaleByAdamState):
            return s
        zero = lambda x: jnp.where(exact, jnp.zeros_like(x), x)  # noqa: E731
        return optax.ScaleByAdamState(zero(s.count), jax.tree.map(zero, s.mu),
                                      jax.tree.map(zero, s.nu))
    return jax.tree.map(reset, state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


def restart_schedule(base: optax.Schedule, exact_every: int) -> optax.Schedule:
    """``base`` times LORO's restart warm-up: after each exact step (updates ``k`` with ``k %
    K < RESTART_WARMUP``, ``k >= K``) the rate ramps ``RESTART_EPS -> 1`` linearly."""
    def schedule(count):
        j = count % exact_every
        ramp = j / RESTART_WARMUP * (1.0 - RESTART_EPS) + RESTART_EPS
        warm = (count >= exact_every) & (j < RESTART_WARMUP)
        return base(count) * jnp.where(warm, ramp, 1.0)
    return schedule
