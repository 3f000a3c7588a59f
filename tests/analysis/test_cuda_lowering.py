"""The program lowered for CUDA on this CPU host (boost_jax/analysis/lowered.py): the parser on
small programs, then cuDNN attention and the bf16 train step of each tensor-parallel plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.analysis import lowered

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
