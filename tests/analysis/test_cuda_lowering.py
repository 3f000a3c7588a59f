"""The program lowered for CUDA on this CPU host (boost_jax/analysis/lowered.py): the parser on
small programs, then cuDNN attention and the bf16 train step of each tensor-parallel plan."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax import compat, gpu_verified
from boost_jax.analysis import lowered
from boost_jax.config import Parallel, Train
from boost_jax.models.attention import packed_slots, resolve_attention
from boost_jax.operations.signals import STOP_SIGNALS
from boost_jax.optim import make_optimizer
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.testing import tiny
from boost_jax.train.step import (
    STOP_SPEC,
    abstract_batch,
    abstract_state,
    make_grad_fn,
    make_train_step,
)

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

_TEXT = """\
module @jit_f attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["data"=2, "tensor"=4]>
  func.func public @main(%arg0: tensor<8x8xbf16> loc("x")) -> (tensor<8x8xbf16>) {
    %0 = "stablehlo.all_reduce"(%arg0) <{channel_handle = #stablehlo.channel_handle<handle = 1, \
type = 1>, replica_groups = dense<[[0, 1, 2, 3], [4, 5, 6, 7]]> : tensor<2x4xi64>}> ({
    ^bb0(%a: tensor<bf16> loc(unknown), %b: tensor<bf16> loc(unknown)):
      %s = stablehlo.add %a, %b : tensor<bf16> loc(#loc3)
      stablehlo.return %s : tensor<bf16>
    }) : (tensor<8x8xbf16>) -> tensor<8x8xbf16> loc(#loc4)
    %1:2 = stablehlo.custom_call @__cudnn$fmhaSoftmax(%0, %0) {backend_config = "{\\22a\\22: \
{\\22b\\22: 1}} : x", operand_layouts = [dense<[1, 0]> : tensor<2xindex>]} : (tensor<8x8xbf16>, \
tensor<8x8xbf16>) -> (tensor<8x8xbf16>, tensor<0xui8>) loc(callsite(#loc1 at #loc2))
    return %1#0 : tensor<8x8xbf16>
  }
}
#loc3 = loc("add"(#loc1))
"""


def test_parser_hand_written_text():
    """Regions over several lines, ``loc(...)``, dense replica groups read as mesh axes, a
    custom call whose backend config holds braces and colons."""
    ops = lowered.parse_ops(_TEXT)
    (ar,) = lowered.collectives(ops)
    assert (ar.kind, ar.axes, ar.group_size, ar.line) == ("all_reduce", ("tensor",), 4, 4)
    assert ar.operands == ar.results == (lowered.Tensor((8, 8), "bf16"),)
    assert ar.bytes == 128
    (cc,) = lowered.custom_calls(ops, "__cudnn$fmha")
    assert cc.target == "__cudnn$fmhaSoftmax"
    assert len(cc.operands) == 2 and cc.results[1] == lowered.Tensor((0,), "ui8")
    assert [op.kind for op in ops] == ["all_reduce", "stablehlo.add", "stablehlo.return",
                                       "custom_call"]
    assert "loc(" not in lowered.strip_locations(_TEXT)


def test_parser_on_shard_map_collectives():
    """psum (bf16) over ``tensor``, all_gather (f32) over ``data``, psum_scatter (f32) over
    both, lowered for CUDA from a shard_map on the 8 CPU devices."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    spec = P(("data", "tensor"))

    def f(x, y):
        a = jax.lax.psum(x, "tensor")
        b = jax.lax.all_gather(y, "data", axis=0, tiled=True)
        c = jax.lax.psum_scatter(y, ("data", "tensor"), scatter_dimension=0, tiled=True)
        return a, b, c

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec),
                               out_specs=(P("data"), spec, spec)))
    x, y = (jax.ShapeDtypeStruct((64, 8), dt, sharding=NamedSharding(mesh, spec))
            for dt in (jnp.bfloat16, jnp.float32))
    ops = lowered.collectives(lowered.cuda_ops(fn, x, y))
    got = [(o.kind, o.axes, o.group_size, o.operands[0].shape, o.results[0].shape,
            o.results[0].dtype, o.bytes) for o in ops]
    assert got == [("all_reduce", ("tensor",), 4, (8, 8), (8, 8), "bf16", 128),
                   ("all_gather", ("data",), 2, (8, 8), (16, 8), "f32", 512),
                   ("reduce_scatter", ("data", "tensor"), 8, (8, 8), (1, 8), "f32", 256)]


# --- the model lowered for CUDA, cuDNN attention traced under compat.cudnn_trace_standin ---

SEQ = 96  # no other dim of the tiny model: an s x s pair can only be a mask or a bias
MAX_SEGMENTS = 15  # Data.max_segments: M = 16 runs per row
BATCH = 8
FMHA = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}


def _model(parallel: Parallel, arch: str = "cola", attention=("cudnn", "cudnn"),
           gspmd: bool = False) -> ShardedModel:
    """The tiny model in bf16 on the first devices, its attention set as on a GPU."""
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    model = ShardedModel(tiny(arch), parallel, mesh, jnp.bfloat16, max_segments=MAX_SEGMENTS,
                         gspmd=gspmd)
    model.execution = dataclasses.replace(model.execution, attention=attention[0],
                                          packed_attention=attention[1])
    return model


def _grad_ops(model: ShardedModel, packed: bool) -> tuple[list[lowered.Op], str]:
    """The ops of the bf16 loss-and-gradients program lowered for CUDA (and its text)."""
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          model.param_shapes(), model.param_shardings)
    with compat.cudnn_trace_standin():
        text = lowered.cuda_lowered_text(make_grad_fn(model), params,
                                         abstract_batch(model, BATCH, SEQ, packed))
    return lowered.parse_ops(text), text


def _fmha(ops: list[lowered.Op]) -> dict[str, lowered.Op]:
    return {op.target: op for op in lowered.custom_calls(ops, "__cudnn$fmha")}


def _dense_pairs(text: str) -> list[lowered.Tensor]:
    """Every tensor of the program whose last two dims are ``seq x seq``."""
    return [t for t in lowered.tensors(text) if t.shape[-2:] == (SEQ, SEQ)]


def test_cudnn_unpacked_rows_lower_to_cudnn():
    ops, text = _grad_ops(_model(Parallel()), packed=False)
    assert set(_fmha(ops)) == FMHA
    assert not _dense_pairs(text)


def test_gspmd_baseline_runs_the_plans_attention():
    """``bench``'s GSPMD baseline runs the attention its explicit plan chose (cuDNN here, as
    on a GPU in bf16), not XLA's: the comparison is of the plans, not of the attention."""
    ops, text = _grad_ops(_model(Parallel(), gspmd=True), packed=False)
    # under GSPMD jax's cuDNN attention is custom-partitioned: its calls appear when XLA
    # partitions the program (the GPU-compiled program: tests/compiled/test_gpu_report.py)
    assert {op.target for op in lowered.custom_calls(ops)} == {"CustomSPMDPartitioning"}
    assert not _dense_pairs(text)


@pytest.mark.parametrize("recorded", [False, True])
def test_auto_packed_rows_on_a_gpu(monkeypatch, recorded):
    """``auto`` in bf16 on a GPU: packed rows run XLA's attention (an s x s mask, no cuDNN
    call) until cuDNN's packed path has a GPU parity record; then its packed call."""
    passed = gpu_verified.Verified("2026-12-01", "NVIDIA H200", "0.11.2",
                                   "tests/models/test_attention_gpu.py")
    record = {"cudnn_attention": passed, "cudnn_packed_attention": passed}
    monkeypatch.setattr(gpu_verified, "RECORD", record if recorded else
                        {"cudnn_attention": passed})
    choice = resolve_attention("auto", jnp.bfloat16, "gpu")
    ops, text = _grad_ops(_model(Parallel(), attention=choice), packed=True)
    assert set(_fmha(ops)) == (FMHA if recorded else set())
    assert bool(_dense_pairs(text)) is not recorded


#: (arch, plan, data, tensor): each tensor-parallel plan on the 8 devices
PLANS = [("cola", "none", 8, 1), ("dense", "fullrank", 2, 4), ("cola", "vanilla", 2, 4),
         ("cola", "btp", 2, 4)]


def _param_sized(model: ShardedModel) -> set[tuple[int, ...]]:
    """Each parameter's local shape and its trailing parts (a layer's slice of the stacked
    block parameters, as a scan over the layers moves it)."""
    local = [sh.shard_shape(s.shape) for s, sh in zip(jax.tree.leaves(model.param_shapes()),
                                                      jax.tree.leaves(model.param_shardings))]
    return {shape[i:] for shape in local for i in range(len(shape))}


@pytest.mark.parametrize("arch, plan, data, tensor", PLANS)
def test_bf16_train_step_per_plan(arch, plan, data, tensor):
    """The bf16 train step of each plan on packed rows, ``Parallel.attention='cudnn'``:
    cuDNN's packed attention forward and backward (segment lengths ``[b, M]`` and offsets
    ``[b, M + 1]``), no ``seq x seq`` mask or bias anywhere, and no fp32 collective of a
    parameter's size but the gradients' reduction over ``data``."""
    model = _model(Parallel(data=data, tensor=tensor, tp_plan=plan), arch)
    opt = make_optimizer(Train(dtype="bfloat16"))
    stop = jax.ShapeDtypeStruct((model.mesh.size, len(STOP_SIGNALS)), jnp.float32,
                                sharding=NamedSharding(model.mesh, STOP_SPEC))
    with compat.cudnn_trace_standin():
        text = lowered.cuda_lowered_text(make_train_step(model, opt), abstract_state(model, opt),
                                         abstract_batch(model, BATCH, SEQ, True), stop)
    ops = lowered.parse_ops(text)
    fmha = _fmha(ops)
    assert set(fmha) == FMHA
    b, m = BATCH // data, packed_slots(MAX_SEGMENTS)
    for op in fmha.values():
        assert [t.shape for t in op.operands if t.dtype == "i32"] == [(b, m)] * 2 + [(b, m + 1)] * 2
    assert not _dense_pairs(text)
    params = _param_sized(model)
    fp32 = [(op.kind, op.axes, op.operands[0].shape) for op in lowered.collectives(ops)
            if "f32" in op.dtypes and {op.operands[0].shape, op.results[0].shape} & params]
    assert fp32 and all(kind in ("all_reduce", "reduce_scatter") and axes == ("data",)
                        for kind, axes, _ in fp32), fp32


def test_the_heads_gemms_take_the_compute_dtype():
    """The LM head's three GEMMs in the bf16 step (the logits, and the backward's ``dx`` and
    ``dhead``) multiply bf16 operands (``models/boundaries.py`` ``head_logits``). JAX's own
    transpose of the fp32-output dot multiplies the fp32 cotangent by weights converted to
    fp32: on an H200 (2026-11-28) those were the step's two largest GEMMs, run as TF32."""
    model = _model(Parallel(data=8, tensor=1))
    ops, _ = _grad_ops(model, packed=False)
    vocab = model.cfg.vocab_size
    head = [op for op in ops if op.kind.endswith("dot_general")
            and any(vocab in t.shape for t in op.operands + op.results)]
    assert len(head) == 3
    assert {t.dtype for op in head for t in op.operands} == {"bf16"}
