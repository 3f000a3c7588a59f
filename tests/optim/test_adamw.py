"""The AdamW of optim/__init__.py: the factors' learning-rate scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import ConfigError, Train
from boost_jax.optim import make_optimizer
from boost_jax.parallel.runner import canonical_shapes
from boost_jax.testing import tiny


@pytest.mark.parametrize("scale", [-1.0, 0.5])
def test_the_factors_update_is_scaled(scale):
    """``Train.factor_lr_scale``: every A and B leaf's update times ``rank / d_model``
    (negative) or the factor given; every other parameter's as with one rate."""
    model = tiny("svd", attn_rank=8, mlp_rank=16)
    shapes = canonical_shapes(model)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32), shapes)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)

    def update(**train):
        opt = make_optimizer(Train(weight_decay=0.1, **train), model)
        return opt.tx.update(grads, opt.tx.init(params), params)[0]

    one, scaled = update(), update(factor_lr_scale=scale)
    seen = set()
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(one)[0], jax.tree.leaves(scaled)):
        keys = [k.key for k in path]
        if keys[0] == "blocks" and keys[-1] in ("a", "b", "b_q", "b_kv", "b_gu"):
            rank = 8 if keys[1] in ("qkv", "o") else 16
            want = scale if scale > 0 else rank / model.d_model
            seen.add(keys[1])
        else:
            want = 1.0
        np.testing.assert_allclose(b, want * a, rtol=1e-6)
    assert seen == {"qkv", "o", "gate_up", "down"}
    with pytest.raises(ConfigError, match="factor_lr_scale=0"):
        Train(factor_lr_scale=0)


def test_grad_clip_zero_means_no_clipping():
    """``Train.grad_clip=0`` (the LORO scripts' ``--grad_clipping 0``) leaves the gradients
    as they are; a positive one scales them to it; a negative one is refused."""
    from boost_jax.optim.optimizer import clip_by_norm

    grads = {"w": jnp.full((3,), 4.0)}
    norm = jnp.linalg.norm(grads["w"])
    np.testing.assert_array_equal(clip_by_norm(grads, norm, 0.0)["w"], grads["w"])
    np.testing.assert_allclose(jnp.linalg.norm(clip_by_norm(grads, norm, 0.5)["w"]), 0.5,
                               rtol=1e-6)
    with pytest.raises(ConfigError, match="grad_clip"):
        Train(grad_clip=-1.0)
