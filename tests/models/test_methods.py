"""Each method as its authors define it: svd is the standard low-rank LLaMA (SwiGLU MLP, as in
LORO's code), LaX defaults to the authors' LaX-CoLA crossing (Kronecker gate + latent
LayerNorm), checked against a NumPy transcription of their ``TensorizedLinear``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.config import ConfigError, Model
from boost_jax.models.boundaries import Plan
from boost_jax.models.decoder import abstract_model, bind
from boost_jax.models.init import flatten, init_params
from boost_jax.models.projections import Crossing, latent_act
from boost_jax.testing import rel_err, tiny

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive


def _silu(x):
    return x / (1 + np.exp(-x))


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def test_svd_mlp_is_swiglu():
    """A default svd block's MLP is ``down(silu(gate) * up)``: the block with its attention
    switched off (o's B factor zero) against a hand computation from its own weights."""
    cfg = tiny("svd")
    assert cfg.only_lr_act is False and not cfg.bilinear_mlp
    params = init_params(abstract_model(cfg)[1], seed=3)
    params["blocks"]["o"]["b"] = jnp.zeros_like(params["blocks"]["o"]["b"])
    graph, stacked = nnx.split(bind(cfg, params).blocks)
    block = nnx.merge(graph, jax.tree.map(lambda x: x[0], stacked))
    h = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
    out, _ = block(h, None, Plan())

    w = jax.tree.map(lambda x: np.asarray(x[0], np.float64), params["blocks"])
    x = _rms(np.asarray(h, np.float64), w["mlp_norm"], cfg.norm_eps)
    a, b = w["gate_up"]["a"], w["gate_up"]["b_gu"]
    gate, up = (x @ a[:, i] @ b[i] for i in range(2))

    def down(m):
        return m @ w["down"]["a"] @ w["down"]["b"]

    got = np.asarray(out, np.float64) - np.asarray(h, np.float64)
    assert rel_err(got, down(_silu(gate) * up)) < 1e-5
    assert rel_err(got, down(gate * up)) > 0.1  # not the bilinear MLP svd once had


def test_only_lr_act_applies_where_a_latent_activation_exists():
    with pytest.raises(ConfigError) as err:
        Model(arch="svd", only_lr_act=True)
    line = str(err.value).splitlines()[0]  # (gin appends the configurable's name below)
    assert "Model.arch='svd' has none" in line and line.startswith("Model.only_lr_act=True")
    assert Model(arch="svd", size="350m").only_lr_act is False  # the preset's True is CoLA's
    assert Model(arch="dense").only_lr_act is False
    assert Model(arch="cola").bilinear_mlp and Model(arch="lax").bilinear_mlp
    assert not Model(arch="cola", size="60m").bilinear_mlp
    assert not Model(arch="dense", only_lr_act=True).bilinear_mlp  # never applied to dense


def test_lax_defaults_are_the_authors_lax_cola():
    """Kronecker gate and latent LayerNorm at every one of the seven projections."""
    cfg = Model(arch="lax", size="tiny")
    assert (cfg.lax_gate, cfg.lax_latent_norm) == ("kronecker", True)
    defs = abstract_model(cfg)[1]
    crossing = {p[:2]: set() for p in defs if "crossing" in p}
    for p in defs:
        if "crossing" in p:
            crossing[p[:2]].add(p[-1])
    assert crossing == {("blocks", m): {"gate_enc", "gate_dec", "norm_scale", "norm_bias"}
                        for m in ("qkv", "o", "gate_up", "down")}
    assert defs[("blocks", "qkv", "crossing", "gate_enc")].shape[:2] == (cfg.n_layers, 3)
    assert defs[("blocks", "gate_up", "crossing", "norm_scale")].shape[:2] == (cfg.n_layers, 2)


# --- a NumPy transcription of the authors' module --------------------------------------------
# K1seki221/Latent_Crossing @ c892d2c, vits_pretraining/timm/models/lax_vit.py, a two-core
# TensorizedLinear with InterRes, InterResGate and TenserizedGate on (their LaX-CoLA config).

def _authors_factor_pair(n):
    """lax_vit.py:65-77: the divisor pair of ``n`` closest together, the smaller first (the
    first divisor reaching the smallest gap wins)."""
    best, gap = (1, n), n - 1
    for d in (k for k in range(1, n + 1) if n % k == 0):
        if abs(d - n // d) < gap:
            best, gap = (d, n // d), abs(d - n // d)
    return best


def _authors_latent(h, res_former, encoder, decoder, ln_weight, ln_bias, act):
    """lax_vit.py:303-318 with the gate of 269-274: ``h`` is ``x @ cores[0]`` (289-290),
    ``res_former`` the previous block's ``inter_res``; ``encoder`` is ``Inter_resgate[0]``
    (``[max, max]`` of the pair) and ``decoder`` ``Inter_resgate[1]`` (``[min, min]``), as
    TensorizeGate (200-205) appends them; the LayerNorm is ``nn.LayerNorm(r, eps=1e-6)``
    (187: affine, biased variance over the last dim). Returns ``inter_res`` (the
    post-activation latent, which cores[1] then multiplies)."""
    if res_former is not None:
        a, b = _authors_factor_pair(h.shape[-1])
        grid = res_former.reshape(-1, 1, a, b)
        h = h + np.einsum("abcd,de,cf->abfe", grid, encoder, decoder).reshape(h.shape)
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        h = (h - mean) / np.sqrt(var + 1e-6) * ln_weight + ln_bias
    return act(h)


@pytest.mark.parametrize("rank, members", [(24, None), (16, 3)], ids=["r24", "r16_grouped"])
def test_crossing_matches_the_authors_module(rank, members):
    """Our crossing + SiLU, with the same weights, equals the transcription to fp32 rounding
    (an a != b pair for r=24: 4 x 6); block 0 (nothing to cross) is the plain activation."""
    a, b = _authors_factor_pair(rank)
    crossing = Crossing(rank, members, "kronecker", True)
    rng = np.random.default_rng(0)
    lead = () if members is None else (members,)
    weights = dict(gate_enc=rng.normal(0, 0.5, (*lead, b, b)),
                   gate_dec=rng.normal(0, 0.5, (*lead, a, a)),
                   norm_scale=1 + 0.1 * rng.normal(size=(*lead, rank)),
                   norm_bias=0.1 * rng.normal(size=(*lead, rank)))
    for name, value in weights.items():
        getattr(crossing, name).value = jnp.asarray(value, jnp.float32)
    shape = (2, 5, *lead, rank)
    z, prev = rng.normal(size=shape), _silu(rng.normal(size=shape))
    ours = latent_act("lax", crossing(jnp.asarray(z, jnp.float32), jnp.asarray(prev, jnp.float32)))
    first = latent_act("lax", crossing(jnp.asarray(z, jnp.float32), None))
    for m in range(members or 1):
        sl = (slice(None), slice(None)) + (() if members is None else (m,))
        w = {k: v[m] if members else v for k, v in weights.items()}
        want = _authors_latent(z[sl], prev[sl], w["gate_enc"], w["gate_dec"], w["norm_scale"],
                               w["norm_bias"], _silu)
        assert rel_err(np.asarray(ours)[sl], want) < 1e-5
        assert rel_err(np.asarray(first)[sl], _authors_latent(z[sl], None, *w.values(),
                                                              _silu)) < 1e-6


def test_factor_pair_agrees_with_the_authors():
    from boost_jax.models.projections import balanced_factors

    for n in (1, 7, 12, 16, 24, 64, 96, 128, 256, 320, 512, 1280):
        assert balanced_factors(n) == _authors_factor_pair(n), n


def test_lowrank_init_keeps_the_tree():
    """``lowrank_init`` only rescales the factors (resume may change it: FREE)."""
    cola, loro = (abstract_model(tiny("svd", lowrank_init=k))[1] for k in ("cola", "loro"))
    assert {p: d.shape for p, d in cola.items()} == {p: d.shape for p, d in loro.items()}
    p = flatten(jax.device_get(init_params(loro, seed=0)))
    assert p[("embed",)].std() == pytest.approx(0.02, rel=0.05)  # N(0, 0.02), as LORO's
