"""The HLO collective reader on hand-written HLO: every replica-group notation, tuples, loop
trip counts, CPU bf16 promotion."""

import pytest

from boost_jax.analysis.hlo import _groups, collectives, totals

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

MESH, NAMES = (2, 1, 4), ("data", "pipe", "tensor")

HLO = """HloModule test

%add_promoted (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] add(%x, %y)
}

%add (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %r.1 = f32[] add(%x.1, %y.1)
}

%fused_convert (param_0: bf16[4,16]) -> f32[4,16] {
  %param_0 = bf16[4,16]{1,0} parameter(0)
  ROOT %c = f32[4,16]{1,0} convert(%param_0)
}

%fused_round (param_1: f32[4,12]) -> f32[4,3,4] {
  %param_1 = f32[4,12]{1,0} parameter(0)
  %narrow = bf16[4,12]{1,0} convert(%param_1)
  %wide = f32[4,12]{1,0} convert(%narrow)
  %bc = f32[4,3,4]{2,1,0} bitcast(%wide)
  ROOT %cpy = f32[4,3,4]{1,0,2} copy(%bc)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %v = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ar = f32[4,8]{1,0} all-reduce(%v), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add_promoted, metadata={op_name="jit(step)/jvp()/shard_map/while/body/psum"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ar)
}

%cond (p.1: (s32[], f32[4,8])) -> pred[] {
  %p.1 = (s32[], f32[4,8]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], b: bf16[4,16], c: f32[8], d: f32[4,12]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[4,16]{1,0} parameter(1)
  %c = f32[8]{0} parameter(2)
  %d = f32[4,12]{1,0} parameter(3)
  %fr = f32[4,3,4]{1,0,2} fusion(%d), kind=kLoop, calls=%fused_round
  %ag2 = f32[4,3,8]{1,0,2} all-gather(%fr), channel_id=6, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={2}, use_global_device_ids=true
  %ag3 = f32[4,24]{1,0} all-gather(%d), channel_id=7, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}, use_global_device_ids=true
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8]) tuple(%z, %a)
  %w = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %fb = f32[4,16]{1,0} fusion(%b), kind=kLoop, calls=%fused_convert
  %ag = f32[4,64]{1,0} all-gather(%fb), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true, metadata={op_name="jit(step)/transpose(jvp())/shard_map/all_gather"}
  %rs = f32[2]{0} reduce-scatter(%c), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add, metadata={op_name="jit(step)/jvp()/shard_map/reduce_scatter"}
  %tup = (f32[8]{0}, f32[]) all-reduce(%c, %z), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, to_apply=%add, metadata={op_name="jit(step)/(transpose(jvp())/shard_map/psum:reduce_sum)"}
  %cp = f32[8]{0} collective-permute(%c), channel_id=5, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  ROOT %o = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"""


@pytest.fixture(scope="module")
def colls():
    return {c.name + (f"/{i}" if c.combined > 1 else ""): c
            for i, c in enumerate(collectives(HLO, MESH, NAMES))}


def test_loop_trip_counts_and_promotion(colls):
    ar = colls["ar"]
    assert (ar.op, ar.count, ar.trips, ar.axes, ar.backward) == ("all-reduce", 6, (6,),
                                                                   ("tensor",), False)
    assert (ar.dtype, ar.elements, ar.bytes) == ("bf16", 32, 64)  # promoted: 2 bytes each


def test_iota_groups_gather_and_scatter(colls):
    ag = colls["ag"]  # [2,4]<=[8]: groups {0..3}, {4..7} -> the tensor axis
    assert (ag.axes, ag.group_size, ag.elements, ag.dtype, ag.backward) == \
        (("tensor",), 4, 256, "bf16", True)
    rs = colls["rs"]  # [4,2]<=[2,4]T(1,0): groups {0,4}, {1,5}, ... -> the data axis
    assert (rs.axes, rs.group_size, rs.elements, rs.dtype) == (("data",), 2, 4, "f32")


def test_promotion_fused_into_the_gathers_operand(colls):
    """The CPU backend rounds a GEMM's f32 output to bf16 and widens it back in the fusion
    that feeds the gather: 2 bytes each. An f32 operand gathered as it is stays f32."""
    assert (colls["ag2"].dtype, colls["ag2"].bytes) == ("bf16", 2 * 4 * 3 * 8)
    assert (colls["ag3"].dtype, colls["ag3"].bytes) == ("f32", 4 * 4 * 24)


def test_mesh_form_and_combined_tuples(colls):
    parts = [c for c in colls.values() if c.name == "tup"]
    assert [(c.shape, c.elements, c.combined, c.axes) for c in parts] == \
        [((8,), 8, 2, ("data",)), ((), 1, 2, ("data",))]
    assert [c.op_name.rsplit("/", 1)[-1] for c in parts] == ["psum", "reduce_sum"]
    assert parts[0].backward and not parts[1].backward


def test_permute_pairs(colls):
    cp = colls["cp"]
    assert (cp.op, cp.axes, cp.elements, cp.count) == ("collective-permute", ("data",), 8, 1)


def test_totals(colls):
    t = totals(list(colls.values()))
    # ring wire bytes: an all-reduce 2 (n-1)/n of its array, an all-gather (n-1)/n
    assert t[("tensor",)] == {"count": 7, "elements": 6 * 32 + 256, "bytes": 6 * 64 + 512,
                              "wire_bytes": 6 * 64 * 2 * 3 / 4 + 512 * 3 / 4}
    assert colls["rs"].wire_bytes == 4 * 4 / 2  # a reduce-scatter's full input, (n-1)/n


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,2},{1,3}}", [[0, 2], [1, 3]]),
    ("replica_groups={}", [[0, 1, 2, 3]]),
    ("replica_groups=[2,2]<=[4]", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}", [[0, 2], [1, 3]]),
])
def test_group_notations(attrs, groups):
    assert _groups(attrs, 4) == groups
