"""cuDNN's packed layout of packed rows (models/attention.py) and the choice of attention core,
on CPU: the layout computed from segment ids describes exactly the segment mask; the packed
branch of ``causal_attention``, with cuDNN replaced by an emulation of its packed layout,
equals the reference; ``auto`` takes cuDNN's packed path only once it is recorded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging

from boost_jax import compat, gpu_verified
from boost_jax.config import Config, ConfigError, Data, Model, Parallel, Train
from boost_jax.models import attention
from boost_jax.models.attention import Segments, packed_layout, reference_attention
from boost_jax.testing import packed_segments

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

#: documents per row (lengths); the rest of the row (length SEQ) is padding
ROWS = [(5, 7, 3), (9, 6), (24,), (1, 1, 2, 4, 1, 3)]
SEQ = 24


def _segments(rows=ROWS, seq=SEQ) -> Segments:
    return packed_segments(rows, seq)


def _layout_mask(seqlens, offsets, seq: int) -> np.ndarray:
    """``[batch, seq, seq]``: query ``t`` sees key ``u`` as cuDNN's packed causal layout
    reads ``(seqlens, offsets)`` -- both in one listed segment, ``u <= t``."""
    seqlens, offsets = np.asarray(seqlens), np.asarray(offsets)
    t = np.arange(seq)
    mask = np.zeros((len(seqlens), seq, seq), bool)
    for b in range(len(seqlens)):
        for j in range(seqlens.shape[1]):
            if seqlens[b, j] < 0:
                assert (seqlens[b, j:] < 0).all() and (offsets[b, j:] < 0).all()
                break
            inside = (t >= offsets[b, j]) & (t < offsets[b, j] + seqlens[b, j])
            mask[b] |= inside[:, None] & inside[None, :] & (t[None, :] <= t[:, None])
    assert (offsets[:, -1] == -1).all()
    return mask


def test_packed_layout_is_the_segment_mask():
    """Every token, padding included, is in exactly one listed segment, and the segments
    give the causal segment mask of the XLA path."""
    seg = _segments()
    seqlens, offsets, overflow = jax.jit(packed_layout, static_argnums=1)(seg.ids, 8)
    assert seqlens.shape == (4, 8) and offsets.shape == (4, 9) and not overflow.any()
    ids = np.asarray(seg.ids)
    want = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((SEQ, SEQ), bool))
    np.testing.assert_array_equal(_layout_mask(seqlens, offsets, SEQ), want)
    np.testing.assert_array_equal(np.asarray(seqlens)[0, :4], [5, 7, 3, 9])  # padding: a run


def test_packed_layout_overflow_keeps_other_rows():
    """A row with more runs than the bound is flagged; its first ``M`` runs are listed, so the
    flattened lengths and offsets of the other rows stay aligned."""
    seg = _segments()
    seqlens, offsets, overflow = packed_layout(seg.ids, 4)  # row 3 has 7 runs
    np.testing.assert_array_equal(overflow, [False, False, False, True])
    np.testing.assert_array_equal(seqlens[3], [1, 1, 2, 4])
    np.testing.assert_array_equal(offsets[3], [0, 1, 2, 4, -1])
    ids = np.asarray(seg.ids)
    want = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((SEQ, SEQ), bool))
    np.testing.assert_array_equal(_layout_mask(seqlens, offsets, SEQ)[:3], want[:3])
    np.testing.assert_array_equal(packed_layout(seg.ids, 6)[2], [False, False, False, True])
    assert not packed_layout(seg.ids, 7)[2].any()  # exactly at the bound: listed whole


def _emulated_cudnn(q, k, v, seqlens, offsets, scale):
    """cuDNN's packed causal attention read from its inputs (float32, on CPU, jittable)."""
    t = jnp.arange(q.shape[1])
    starts, lens = offsets[:, :-1, None], seqlens[:, :, None]  # [b, M, 1]
    inside = (t >= starts) & (t < starts + lens) & (lens >= 0)  # [b, M, seq]
    same = jnp.any(inside[:, :, :, None] & inside[:, :, None, :], axis=1)  # [b, seq, seq]
    mask = same & (t[None, :] <= t[:, None])
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32)).astype(q.dtype)


def test_cudnn_packed_branch_equals_reference(monkeypatch):
    """``causal_attention(..., 'cudnn')`` on packed rows, cuDNN emulated from the lengths and
    offsets it is given: the reference's output (GQA, RoPE at document positions); a row
    over the bound comes out NaN, the others unchanged."""
    monkeypatch.setattr(compat, "cudnn_packed_attention", _emulated_cudnn)
    seg = _segments()
    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (4, SEQ, 4, 8))
    k, v = (jax.random.normal(x, (4, SEQ, 2, 8)) for x in key[1:])
    run = jax.jit(attention.causal_attention, static_argnums=(3, 5, 6))
    want = jax.jit(reference_attention, static_argnums=3)(q, k, v, 1e4, seg)
    np.testing.assert_allclose(run(q, k, v, 1e4, seg, "cudnn", SEQ), want, rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="needs the bound"):
        run(q, k, v, 1e4, seg, "cudnn", None)
    over = run(q, k, v, 1e4, seg, "cudnn", 4)
    assert np.isnan(over[3]).all()
    np.testing.assert_allclose(over[:3], want[:3], rtol=1e-5, atol=1e-5)


def test_packed_slots_count_the_padding_run():
    assert attention.packed_slots(63) == 64


VERIFIED = gpu_verified.Verified("2026-12-01", "NVIDIA H200", "0.11.2",
                                 "tests/models/test_attention_gpu.py")


def test_resolve_attention(monkeypatch):
    """``(unpacked, packed)``: auto on a GPU in bf16 takes cuDNN for unpacked rows with a
    recorded GPU parity result of cuDNN attention, and for packed rows only with that of the
    packed path too; cudnn needs a GPU and 16 bits."""
    bf16 = jnp.bfloat16
    monkeypatch.setattr(gpu_verified, "RECORD", {})
    assert attention.resolve_attention("auto", bf16, "gpu") == ("xla", "xla")
    monkeypatch.setattr(gpu_verified, "RECORD", {"cudnn_packed_attention": VERIFIED})
    assert attention.resolve_attention("auto", bf16, "gpu") == ("xla", "xla")
    monkeypatch.setattr(gpu_verified, "RECORD", {"cudnn_attention": VERIFIED})
    assert attention.resolve_attention("auto", bf16, "gpu") == ("cudnn", "xla")
    assert attention.resolve_attention("auto", jnp.float32, "gpu") == ("xla", "xla")
    assert attention.resolve_attention("auto", bf16, "cpu") == ("xla", "xla")
    assert attention.resolve_attention("xla", bf16, "gpu") == ("xla", "xla")
    assert attention.resolve_attention("cudnn", bf16, "gpu") == ("cudnn", "cudnn")
    with pytest.raises(ConfigError, match="needs a GPU"):
        attention.resolve_attention("cudnn", bf16, "cpu")
    with pytest.raises(ConfigError, match="16-bit"):
        attention.resolve_attention("cudnn", jnp.float32, "gpu")
    monkeypatch.setattr(gpu_verified, "RECORD", {"cudnn_attention": VERIFIED,
                                                 "cudnn_packed_attention": VERIFIED})
    assert attention.resolve_attention("auto", bf16, "gpu") == ("cudnn", "cudnn")
    assert attention.resolve_attention("auto", bf16, "cpu") == ("xla", "xla")
    # packed rows without Data.max_segments: cuDNN's packed layout has no bound to be built for
    assert attention.resolve_attention("auto", bf16, "gpu", bounded=False) == ("cudnn", "xla")


def test_cudnn_on_packed_rows_needs_max_segments():
    """The one-line error before anything is built; with the bound the config is valid."""
    parts = dict(model=Model(), train=Train(), parallel=Parallel(attention="cudnn"))
    with pytest.raises(ConfigError, match="needs Data.max_segments"):
        Config(**parts, data=Data(packing="document"))
    Config(**parts, data=Data(packing="document", max_segments=64))
    Config(**parts, data=Data())  # unpacked rows need no bound


def test_resolve_attention_logs_its_choice(monkeypatch):
    said = []
    monkeypatch.setattr(logging, "log_first_n",
                        lambda level, msg, n, *args: said.append(msg % args))
    monkeypatch.setattr(gpu_verified, "RECORD", {})
    attention.resolve_attention("auto", jnp.bfloat16, "gpu")
    assert len(said) == 1 and "xla attention for unpacked rows, xla for packed" in said[0]
    assert "cuDNN attention has no GPU parity record" in said[0]
    monkeypatch.setattr(gpu_verified, "RECORD", {"cudnn_attention": VERIFIED})
    attention.resolve_attention("auto", jnp.bfloat16, "gpu")
    assert len(said) == 2 and "cudnn attention for unpacked rows, xla for packed" in said[1]
    assert "cuDNN's packed path has no GPU parity record" in said[1]
