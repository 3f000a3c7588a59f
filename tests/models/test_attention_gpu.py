"""cuDNN attention on a GPU (marker `gpu`; skipped with the reason elsewhere):
``causal_attention(..., 'cudnn')`` on unpacked and on packed rows against the fp32 reference,
in bf16, forward and gradients, GQA, one-token documents and padding included; a row over the
segment bound comes out NaN while the others stay right.

Its pass is what boost_jax/gpu_verified.py records as ``cudnn_packed_attention`` (the record
``Parallel.attention='auto'`` reads before it takes this path for packed rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.models.attention import Segments, causal_attention, reference_attention
from boost_jax.testing import norm_rel_err, packed_segments
from tests.gpu import gpu_device

pytestmark = pytest.mark.gpu
SEQ, HEADS, KV_HEADS, HEAD_DIM = 256, 8, 2, 64
#: documents per row (lengths); the rest of each row is padding
ROWS = [(100, 60, 1, 1, 30), (256,), (7, 13, 200), (1,) * 20 + (50,)]
TOL = 2e-2  # bf16 inputs and outputs against the fp32 reference
#: cuDNN's packed path's bound on runs per row: every row's documents and its padding fit
BOUND = max(len(row) for row in ROWS) + 1


@pytest.fixture(scope="module")
def gpu():
    device = gpu_device()
    if tuple(int(x) for x in device.compute_capability.split(".")) < (9, 0):
        pytest.skip(f"cuDNN's packed layout needs Hopper or newer: {device.device_kind}")
    return device


def _segments() -> Segments:
    return packed_segments(ROWS, SEQ)


def _loss_and_grads(attend, q, k, v, weights):
    """Output ``[b, s, h * dh]`` and the gradients of ``sum(out * weights)``."""
    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return out, grads


def _inputs(gpu):
    keys = jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)), 4)
    with jax.default_device(gpu):
        q = jax.random.normal(keys[0], (len(ROWS), SEQ, HEADS, HEAD_DIM), jnp.bfloat16)
        k, v = (jax.random.normal(x, (len(ROWS), SEQ, KV_HEADS, HEAD_DIM), jnp.bfloat16)
                for x in keys[1:3])
        weights = jax.random.normal(keys[3], (len(ROWS), SEQ, HEADS * HEAD_DIM))
    return q, k, v, weights


def test_cudnn_attention_matches_reference(gpu):
    """Unpacked rows (JAX's public cuDNN path): what
    boost_jax/gpu_verified.py records as ``cudnn_attention``."""
    q, k, v, weights = _inputs(gpu)
    out, grads = _loss_and_grads(
        lambda q, k, v: causal_attention(q, k, v, 1e4, None, "cudnn"), q, k, v, weights)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_grads = _loss_and_grads(
        lambda q, k, v: reference_attention(q, k, v, 1e4), *f32, weights)
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out).all())
    assert norm_rel_err(out, want) < TOL
    for got, ref in zip(grads, want_grads):
        assert bool(jnp.isfinite(got).all()) and norm_rel_err(got, ref) < TOL


def test_cudnn_packed_attention_matches_reference(gpu):
    seg = jax.device_put(_segments(), gpu)
    q, k, v, weights = _inputs(gpu)
    out, grads = _loss_and_grads(
        lambda q, k, v: causal_attention(q, k, v, 1e4, seg, "cudnn", bound=BOUND), q, k, v,
        weights)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_grads = _loss_and_grads(
        lambda q, k, v: reference_attention(q, k, v, 1e4, seg), *f32, weights)
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out).all())
    assert norm_rel_err(out, want) < TOL
    for got, ref in zip(grads, want_grads):
        assert bool(jnp.isfinite(got).all()) and norm_rel_err(got, ref) < TOL


def test_cudnn_packed_attention_over_the_bound(gpu):
    """Row 3 has 22 segments: with a bound of 8 it is NaN, the other rows (at most 6) right."""
    seg = jax.device_put(_segments(), gpu)
    q, k, v, _ = _inputs(gpu)
    out = jax.jit(lambda q, k, v: causal_attention(q, k, v, 1e4, seg, "cudnn", bound=8))(
        q, k, v)
    want = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), 1e4, seg)
    assert bool(jnp.isnan(out[3]).all())
    assert norm_rel_err(out[:3], want[:3]) < TOL
