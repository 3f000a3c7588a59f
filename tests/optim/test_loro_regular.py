"""LORO's regular group and recipe knobs (optim/loro_adam.py): the transformation in fp64 against
a NumPy transcription of the authors' ``LOROAdamW._regular_step`` (github.com/mzf666/LORO-main
at 4da57b6), through exact steps and moment resets, and the config fields."""

import jax
import numpy as np
import pytest

from boost_jax.config import ConfigError, Train
from boost_jax.config_fields import NOTE
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import rel_err, tiny
from tests.optim.test_loro import K, _flat, _reference, _restart_lr, _run_fp64

NORMS = ("attn_norm", "mlp_norm", "final_norm")


def _authors_regular(p, m, v, t, lr, train, decay):
    """``loro_optim.py:218-252``, eps 1e-6 (``:140``), on the moments the reference updated as
    ``:225-226`` (and zeroed as ``:182-195``). Every regular leaf is decayed, norms included
    (the group is every non-factor parameter, ``lowrank_module.py:178-179``): ``decay`` is
    ignored."""
    denom = np.sqrt(v) + 1e-6  # :227, the uncorrected second moment
    step_size = lr * np.sqrt(1 - train.beta2 ** t) / (1 - train.beta1 ** t)  # :229-234
    p = p - step_size * (m / denom)  # :237-238
    return p - lr * train.weight_decay * p  # :248-252: the scheduled lr, after the step


def _grads(params, rng) -> dict:
    """Gradients of ``N(0, 1e-2)`` on the factors; on the regular leaves each entry's scale is
    log-uniform in ``[1e-7, 1e-2]``, so that ``sqrt(v)`` spans the eps of both rules."""
    def one(path, x):
        g = rng.normal(0, 1, x.shape)
        regular = path[0].key != "blocks" or path[-1].key in NORMS
        return g * (10.0 ** rng.uniform(-7, -2, x.shape) if regular else 1e-2)
    return jax.tree_util.tree_map_with_path(one, params)


@pytest.mark.parametrize("knobs", [{}, {"loro_lr_scaler": 0.5, "loro_reset_moments": False}],
                         ids=["authors_defaults", "scaler_no_reset"])
def test_regular_group_matches_loro_adamw(knobs):
    """Seven updates (exact steps at 2 and 5, then a reset of every moment and count unless
    ``loro_reset_moments=False``) in fp64 with weight decay 0.1: the embeddings, norms and
    head equal the transcription of the authors' regular step to 1e-12 (their displacement
    from the init to 1e-9), and the factors the fp64 transcription of the factor updates of
    tests/optim/test_loro.py, with the approximate steps scaled by ``loro_lr_scaler``."""
    train = Train(optimizer="loro", loro_exact_every=K, steps=40, learning_rate=1e-2,
                  weight_decay=0.1, **knobs)
    model = tiny("svd", n_layers=1)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    rng = np.random.default_rng(0)
    grads_seq = [_grads(params, rng) for _ in range(7)]
    got, lrs, count = _run_fp64(train, model, params, grads_seq)
    assert rel_err(lrs, [_restart_lr(train, c) for c in range(len(lrs))]) <= 1e-6
    assert lrs[3] < 1e-8  # the restart warm-up, with or without the reset
    ref = _reference(params, grads_seq, train, model.d_model, lrs, regular=_authors_regular)
    init = {k: np.asarray(x, np.float64) for k, x in _flat(params).items()}
    regular = [k for k in init if k[0] != "blocks" or k[-1] in NORMS]
    assert {k[-1] for k in regular} == {"embed", "head", *NORMS}
    for step, (now, want) in enumerate(zip(got, ref)):
        errs = {k: rel_err(now[k], want[k]) for k in now}
        assert max(errs.values()) <= 1e-12, (step, errs)
        moved = {k: rel_err(now[k] - init[k], want[k] - init[k]) for k in regular}
        assert max(moved.values()) <= 1e-9, (step, moved)
    assert count == 7


def test_recipe_fields():
    """The defaults are the authors' runs; each field declares its resume kind (a trajectory
    change: both regular rules keep the same moments); bad values are one-line errors."""
    train = Train()
    assert (train.loro_regular, train.loro_lr_scaler, train.loro_reset_moments) == (
        "authors", -1.0, True)
    fields = {f.name: f for f in Train.__dataclass_fields__.values()}
    for name in ("loro_regular", "loro_lr_scaler", "loro_reset_moments"):
        assert fields[name].metadata["resume"] == NOTE
    with pytest.raises(ConfigError, match="Train.loro_regular='sgd' must be one of"):
        Train(loro_regular="sgd")
    with pytest.raises(ConfigError, match="Train.loro_lr_scaler=0"):
        Train(loro_lr_scaler=0)
