"""The private JAX names boost_jax/compat.py leans on for cuDNN attention: these fail on a JAX
that moved them (so a newer JAX is caught here, not in a GPU run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fa

from boost_jax import compat
from boost_jax.analysis import lowered


def _attention_grad_text(q, k, v, packed: bool) -> str:
    def loss(q, k, v):
        if packed:
            lens, offs = jnp.array([[3, 5]], jnp.int32), jnp.array([[0, 3, -1]], jnp.int32)
            out = compat.cudnn_packed_attention(q, k, v, lens, offs, scale=0.5)
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    return lowered.cuda_lowered_text(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)


def test_cudnn_trace_standin_lowers_cudnn_attention():
    """The stand-in's private names exist; with it, cuDNN attention (public, and packed) lowers
    for CUDA on this CPU host; without it, it does not; on exit the originals are back."""
    assert all(callable(getattr(fa, name)) for name in compat.CUDNN_TRACE_CHECKS)
    before = [getattr(fa, name) for name in compat.CUDNN_TRACE_CHECKS]
    q = jax.ShapeDtypeStruct((1, 8, 2, 8), jnp.bfloat16)
    with compat.cudnn_trace_standin():
        for packed in (False, True):
            ops = lowered.parse_ops(_attention_grad_text(q, q, q, packed))
            targets = {op.target for op in lowered.custom_calls(ops, "__cudnn$fmha")}
            assert targets == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert [getattr(fa, name) for name in compat.CUDNN_TRACE_CHECKS] == before
    if fa.cuda_versions is None:  # a CPU-only jaxlib: JAX's own check refuses
        with pytest.raises(RuntimeError, match="cuDNN is not detected"):
            _attention_grad_text(q, q, q, False)


def test_cudnn_packed_signature():
    """The private ``dot_product_attention`` takes every parameter the wrapper passes."""
    assert compat.cudnn_packed_signature_problem() is None


def test_cudnn_packed_signature_moved(monkeypatch):
    """A moved signature is a clear error, not a wrong call."""
    monkeypatch.setattr(fa, "dot_product_attention", lambda query, key, value, *, scale: None)
    problem = compat.cudnn_packed_signature_problem()
    assert "no parameter q_seqlen, kv_seqlen, q_offsets, kv_offsets" in problem
    x = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
    lens = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(RuntimeError, match="use Parallel.attention='xla'"):
        compat.cudnn_packed_attention(x, x, x, lens, lens, scale=1.0)


def _fix(n_heads_of_kv: bool):
    """A stand-in ``_fix_seqlen_offsets`` striding kv offsets by the key's or query's heads."""
    def fix(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key):
        heads = key.shape[2] if n_heads_of_kv else query.shape[2]
        return q_seqlen, kv_seqlen, q_offsets, np.asarray(kv_offsets) * heads * key.shape[3]
    return fix


@pytest.mark.parametrize("native", [True, False])
def test_cudnn_packed_gqa_probe(monkeypatch, native):
    """The probe tells JAX's fixed kv stride (key heads) from the old one (query heads), and
    the private function it probes exists."""
    assert callable(fa._fix_seqlen_offsets)
    compat.cudnn_packed_gqa_native.cache_clear()
    monkeypatch.setattr(fa, "_fix_seqlen_offsets", _fix(native))
    try:
        assert compat.cudnn_packed_gqa_native() is native
    finally:
        compat.cudnn_packed_gqa_native.cache_clear()


def test_cudnn_packed_gqa_repeats_kv_only_where_needed():
    """On this JAX the packed call gets the key heads as they are where its stride is right,
    the query's heads (repeated) where it is not."""
    q = jax.ShapeDtypeStruct((1, 8, 4, 8), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 2, 8), jnp.bfloat16)
    with compat.cudnn_trace_standin():
        ops = lowered.parse_ops(_attention_grad_text(q, kv, kv, packed=True))
    (fwd,) = [op for op in ops if op.target == "__cudnn$fmhaSoftmax"]
    heads = 2 if compat.cudnn_packed_gqa_native() else 4
    assert fwd.operands[1].shape == (1, 8, heads, 8)
