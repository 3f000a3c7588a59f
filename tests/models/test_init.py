"""Initialisation: derived from (seed, path), identical on any mesh, CoLA's and LORO's std."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.config import Model
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import flatten, init_params
from boost_jax.models.projections import cola_std
from boost_jax.testing import tiny

#: run on CI's newest stack too (.ci/run): what a second JAX can change (mesh-independent
#: initialisation on the dense model; LaX's many more parameters: the floor stack only)
JAX_SENSITIVE = pytest.mark.jax_sensitive


def _shard_everything(mesh):
    """A sharding that splits every dim it can over some mesh axis (an adversarial layout)."""
    def fn(d):
        spec, used = [], set()
        for n in d.shape:
            axis = next((a for a in ("tensor", "data") if a not in used
                         and n % mesh.shape[a] == 0), None)
            spec.append(axis)
            used.add(axis)
        return NamedSharding(mesh, P(*spec))
    return fn


@pytest.mark.parametrize("arch", [pytest.param("dense", marks=JAX_SENSITIVE), "lax"])
def test_same_weights_on_any_mesh(arch):
    cfg = tiny(arch, lax_gate="kronecker", lax_latent_norm=True)
    defs = abstract_model(cfg)[1]
    one = flatten(jax.device_get(init_params(defs, seed=3)))
    for shape in [(2, 1, 4), (8, 1, 1)]:
        mesh = jax.make_mesh(shape, ("data", "pipe", "tensor"), axis_types=(AxisType.Auto,) * 3)
        sharded = init_params(defs, seed=3, shardings=_shard_everything(mesh))
        assert any(len(a.sharding.device_set) > 1 for a in jax.tree.leaves(sharded))
        for path, value in flatten(jax.device_get(sharded)).items():
            np.testing.assert_array_equal(value, one[path], err_msg=str(path))


@JAX_SENSITIVE
def test_keys_depend_on_seed_path_and_layer():
    cfg = tiny("cola")
    defs = abstract_model(cfg)[1]
    p0, p1 = (flatten(jax.device_get(init_params(defs, seed=s))) for s in (0, 1))
    a = p0[("blocks", "o", "a")]
    assert not np.allclose(a[0], a[1])  # each layer has its own key
    assert not np.allclose(a, p1[("blocks", "o", "a")])  # the seed matters
    # same shape, different path -> different values
    assert not np.allclose(p0[("blocks", "o", "b")], p0[("blocks", "down", "b")])


@JAX_SENSITIVE
def test_cola_init_statistics():
    cfg = tiny("cola", d_model=256, n_heads=4, d_ff=512, n_layers=4)
    p = flatten(jax.device_get(init_params(abstract_model(cfg)[1], seed=0)))
    d, dkv, r = cfg.d_model, cfg.d_kv, cfg.attn_rank
    a = p[("blocks", "qkv", "a")]  # members q, k, v have different fan-out
    assert a[:, :, 0].std() == pytest.approx(cola_std(d, d, r), rel=0.02)
    assert a[:, :, 1].std() == pytest.approx(cola_std(d, dkv, r), rel=0.02)
    assert p[("blocks", "down", "a")].std() == pytest.approx(cola_std(512, d, cfg.mlp_rank),
                                                             rel=0.02)
    assert p[("embed",)].std() == pytest.approx(0.02, rel=0.02)
    np.testing.assert_array_equal(p[("blocks", "attn_norm")], 1.0)


@JAX_SENSITIVE
def test_loro_init_statistics():
    """``lowrank_init='loro'``: LORO's default ``xavier`` init (mzf666/LORO-main
    ``loro_torch/lowrank_module.py:16-23, 40-42``): every factor normal with std
    ``sqrt(2 / (n_in + n_out))`` of its own shape, ``weight_in [in, r]`` (our A) and
    ``weight_out [out, r]`` (our B transposed); GQA makes k/v's B differ from q's."""
    cfg = Model(arch="svd", size="small", n_kv_heads=2, lowrank_init="loro")
    p = flatten(jax.device_get(init_params(abstract_model(cfg)[1], seed=0)))
    d, dkv, dff, r = cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.attn_rank

    def xavier(n_in, n_out):
        return np.sqrt(2 / (n_in + n_out))

    want = {("qkv", "a"): xavier(d, r), ("qkv", "b_q"): xavier(r, d),
            ("qkv", "b_kv"): xavier(r, dkv), ("o", "a"): xavier(d, r), ("o", "b"): xavier(r, d),
            ("gate_up", "a"): xavier(d, r), ("gate_up", "b_gu"): xavier(r, dff),
            ("down", "a"): xavier(dff, r), ("down", "b"): xavier(r, d)}
    for (module, name), std in want.items():
        x = p[("blocks", module, name)]
        assert abs(x.mean()) < 0.02 * std, (module, name)
        assert x.std() == pytest.approx(std, rel=0.015), (module, name)
        # normal, not uniform: 68.3 % within one std (a uniform of this std has 57.7 %)
        assert np.mean(np.abs(x) < std) == pytest.approx(0.6827, abs=0.01), (module, name)
    assert Model(arch="svd").lowrank_init == "cola"
