"""The decoder against a direct float64 NumPy implementation (dense, SVD, CoLA, LaX)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.models.attention import Segments, causal_attention, reference_attention
from boost_jax.models.decoder import abstract_model, reference_logits
from boost_jax.models.init import init_params
from boost_jax.testing import rel_err, tiny

#: run on CI's newest stack too (.ci/run): what a second JAX can change -- every test here but
#: the variants of one arch (SLOW_ON_NEWEST: the floor stack runs them)
JAX_SENSITIVE = pytest.mark.jax_sensitive


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def _silu(x):
    return x / (1 + np.exp(-x))


def _attention(q, k, v, theta):
    b, s, h, dh = q.shape
    inv = theta ** (-np.arange(0, dh, 2) / dh)
    ang = np.arange(s)[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):
        rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
        return x * cos[None, :, None] + rot * sin[None, :, None]

    q, k = rope(q), rope(k)
    k, v = (np.repeat(t, h // t.shape[2], axis=2) for t in (k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, h * dh)


def _lowrank(cfg, x, a, b, cross, prev):
    """One low-rank projection, LaX crossing included; returns (y, latent)."""
    z = x @ a
    if cfg.arch == "lax" and prev is not None:
        if cfg.lax_gate == "identity":
            g = prev
        elif cfg.lax_gate == "dense":
            g = prev @ cross["gate_w"] + cross["gate_b"]
        else:
            dec, enc = cross["gate_dec"], cross["gate_enc"]
            grid = prev.reshape(*prev.shape[:-1], dec.shape[0], enc.shape[0])
            g = np.einsum("bscd,cf,de->bsfe", grid, dec, enc).reshape(prev.shape)
        z = z + g
        if cfg.lax_latent_norm:
            mu = z.mean(-1, keepdims=True)
            var = ((z - mu) ** 2).mean(-1, keepdims=True)
            z = (z - mu) / np.sqrt(var + 1e-6) * cross["norm_scale"] + cross["norm_bias"]
    z = z if cfg.arch == "svd" else _silu(z)
    return z @ b, z


def numpy_logits(cfg, params, tokens):
    P = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    eps, dh = cfg.norm_eps, cfg.head_dim
    h = P["embed"][tokens]
    prev = {}
    for layer in range(cfg.n_layers):
        B = jax.tree.map(lambda x, layer=layer: x[layer], P["blocks"])

        def proj(name, x, a, b, member=None, B=B):
            cross = B[name].get("crossing", {})
            if member is not None:
                cross = {k: v[member] for k, v in cross.items()}
            y, z = _lowrank(cfg, x, a, b, cross, prev.get((name, member)))
            prev[(name, member)] = z
            return y

        x = _rms(h, B["attn_norm"], eps)
        if cfg.arch == "dense":
            wq, wkv = B["qkv"]["w_q"], B["qkv"]["w_kv"]
            q, k, v = x @ wq[:, 0], x @ wkv[:, 0], x @ wkv[:, 1]
        else:
            a, bq, bkv = B["qkv"]["a"], B["qkv"]["b_q"], B["qkv"]["b_kv"]
            q, k, v = (proj("qkv", x, a[:, i], bb, i)
                       for i, bb in enumerate([bq[0], bkv[0], bkv[1]]))
        split = lambda t: t.reshape(*t.shape[:2], -1, dh)  # noqa: E731
        att = _attention(split(q), split(k), split(v), cfg.rope_theta)
        h = h + (att @ B["o"]["w"] if cfg.arch == "dense"
                 else proj("o", att, B["o"]["a"], B["o"]["b"]))
        x = _rms(h, B["mlp_norm"], eps)
        if cfg.arch == "dense":
            g, u = x @ B["gate_up"]["w_gu"][:, 0], x @ B["gate_up"]["w_gu"][:, 1]
        else:
            a, bgu = B["gate_up"]["a"], B["gate_up"]["b_gu"]
            g, u = (proj("gate_up", x, a[:, i], bgu[i], i) for i in range(2))
        silu_gate = not (cfg.arch in ("cola", "lax") and cfg.only_lr_act)  # svd: SwiGLU
        m = (_silu(g) if silu_gate else g) * u
        h = h + (m @ B["down"]["w"] if cfg.arch == "dense"
                 else proj("down", m, B["down"]["a"], B["down"]["b"]))
    x = _rms(h, P["final_norm"], eps)
    return x @ (P["embed"].T if cfg.tie_embeddings else P["head"])


#: every arch at its defaults (CI's newest stack too), then variants of an arch (the floor only:
#: the same JAX operations, combined otherwise)
CASES = [
    pytest.param("dense", {}, marks=JAX_SENSITIVE),
    pytest.param("svd", {}, marks=JAX_SENSITIVE),
    pytest.param("cola", dict(only_lr_act=True), marks=JAX_SENSITIVE),
    ("cola", dict(only_lr_act=False, tie_embeddings=True)),
    pytest.param("lax", {}, marks=JAX_SENSITIVE),  # the authors' LaX-CoLA: Kronecker gate +
    ("lax", dict(lax_gate="identity", lax_latent_norm=False)),  # latent norm
    ("lax", dict(lax_gate="dense", lax_latent_norm=True)),
    ("lax", dict(lax_gate="kronecker", lax_latent_norm=False, n_layers=3)),
]


@pytest.mark.parametrize("arch, extra", CASES)
def test_decoder_matches_numpy(arch, extra):
    cfg = tiny(arch, **extra)
    params = init_params(abstract_model(cfg)[1], seed=1)
    # make gains and LaX norms non-trivial so every parameter matters
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (1 + 0.1 * jax.random.normal(jax.random.key(len(str(path))), x.shape))
        if "norm" in str(path[-1]) else x, params)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
    ours = reference_logits(cfg, params, tokens)
    assert rel_err(ours, numpy_logits(cfg, params, np.asarray(tokens))) < 1e-5


@JAX_SENSITIVE
def test_grouping_off_is_the_same_function():
    from boost_jax.models.boundaries import Plan
    from boost_jax.models.decoder import bind

    cfg = tiny("lax", lax_gate="dense")
    params = init_params(abstract_model(cfg)[1], seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    logits = jax.jit(lambda p, t, g: bind(cfg, p).logits(t, Plan(grouped=g)),
                     static_argnums=2)
    assert rel_err(logits(params, tokens, False), logits(params, tokens, True)) < 1e-6


@JAX_SENSITIVE
def test_attention_gqa_matches_einsum():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 16, 8, 16))
    k, v = (jax.random.normal(kk, (2, 16, 2, 16)) for kk in keys[1:])
    assert rel_err(causal_attention(q, k, v, 10000.0), reference_attention(q, k, v, 10000.0)) < 1e-5
    # causality: changing a later token does not change earlier outputs
    k2 = k.at[:, 10:].set(0.0)
    np.testing.assert_allclose(causal_attention(q, k2, v, 1e4)[:, :10],
                               causal_attention(q, k, v, 1e4)[:, :10], rtol=1e-6, atol=1e-6)
    assert jnp.isfinite(causal_attention(q, k, v, 1e4)).all()


@JAX_SENSITIVE
def test_attention_within_segments_matches_einsum():
    """Packed rows: masked to each segment, RoPE by position in the segment; a segment's
    output equals the attention of that segment alone."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 12, 4, 8))
    k, v = (jax.random.normal(kk, (1, 12, 2, 8)) for kk in keys[1:])
    ids = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0]])
    positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0]])
    seg = Segments(ids, positions)
    packed = causal_attention(q, k, v, 1e4, seg)
    assert rel_err(packed, reference_attention(q, k, v, 1e4, seg)) < 1e-5
    alone = causal_attention(q[:, 5:11], k[:, 5:11], v[:, 5:11], 1e4)
    assert rel_err(packed[:, 5:11], alone) < 1e-5
