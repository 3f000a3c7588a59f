"""Reading a program compiled for a GPU (analysis/gpu_program.py, analysis/hlo.py's async
forms) on hand-written HLO in the forms XLA's GPU compiler prints (jax 0.12.0.1): the
``*-start`` tuple types (operands, results, contexts), which collectives are asynchronous and
what is scheduled under them, custom calls and fusion kinds."""

from boost_jax.analysis import gpu_program, hlo

_HLO = """\
HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_body (x: bf16[8,16]) -> bf16[2,16] {
  %x = bf16[8,16]{1,0} parameter(0)
  ROOT %reduce-scatter.3 = bf16[2,16]{1,0} reduce-scatter(%x), channel_id=5, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[22993], p1: bf16[4,128,64], p2: bf16[8,16]) -> f32[22993] {
  %p0 = f32[22993]{0} parameter(0)
  %p1 = bf16[4,128,64]{2,1,0} parameter(1)
  %p2 = bf16[8,16]{1,0} parameter(2)
  %all-reduce-start = ((f32[22993]{0}), f32[22993]{0}) all-reduce-start(%p0), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %fusion.1 = bf16[4,128,64]{2,1,0} fusion(%p1), kind=kLoop, calls=%add, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %custom-call.1 = (bf16[4,128,64]{2,1,0}, u8[0]{0}) custom-call(%fusion.1), custom_call_target="__cudnn$fmhaSoftmax"
  %all-reduce-done = f32[22993]{0} all-reduce-done(%all-reduce-start)
  %all-gather-start = (bf16[4,128,16]{2,1,0}, bf16[4,128,64]{2,1,0}) all-gather-start(%p1), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={2}, backend_config={"collective_backend_config":{"is_sync":true}}
  %all-gather-done = bf16[4,128,64]{2,1,0} all-gather-done(%all-gather-start)
  %all-reduce.2 = bf16[4,128,64]{2,1,0} all-reduce(%all-gather-done), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %reduce-scatter-start = ((bf16[8,16]{1,0}), bf16[2,16]{1,0}) async-start(%p2), calls=%rs_body
  %fusion.2 = bf16[4,128,64]{2,1,0} fusion(%all-reduce.2), kind=kLoop, calls=%add
  %reduce-scatter-done = bf16[2,16]{1,0} async-done(%reduce-scatter-start)
  ROOT %copy = f32[22993]{0} copy(%all-reduce-done)
}
"""
MESH = ((2, 4), ("data", "tensor"))


def test_start_types_give_the_results_only():
    """An all-reduce-start's ``((operands), result)``, an all-gather-start's ``(operand,
    result)``: each collective once, with its result's shape."""
    got = sorted((c.op, c.shape, c.axes, c.bytes) for c in hlo.collectives(_HLO, *MESH))
    assert got == sorted([("all-reduce", (22993,), ("data",), 22993 * 4),
                          ("all-gather", (4, 128, 64), ("tensor",), 4 * 128 * 64 * 2),
                          ("all-reduce", (4, 128, 64), ("tensor",), 4 * 128 * 64 * 2),
                          ("reduce-scatter", (2, 16), ("tensor",), 8 * 16 * 2)])
    assert hlo._tuple_elements("((f32[2,3]{1,0}), f32[2,3]{1,0}, u32[])") == [
        "(f32[2,3]{1,0})", "f32[2,3]{1,0}", "u32[]"]


def test_schedule_says_what_runs_under_each_collective():
    s = gpu_program.schedule(_HLO)
    assert (s["all-reduce-start"].asynchronous, s["all-reduce-start"].under) == (
        True, ("fusion", "custom-call"))
    assert not s["all-gather-start"].asynchronous  # XLA made it synchronous (is_sync)
    assert not s["all-reduce.2"].asynchronous  # a plain instruction
    assert (s["reduce-scatter.3"].asynchronous, s["reduce-scatter.3"].overlapped) == (True, 1)


def test_custom_calls_and_fusions():
    assert gpu_program.custom_calls(_HLO) == {"__cudnn$fmhaSoftmax": 1,
                                              "fusion:__triton_nested_gemm_fusion": 1}
    assert gpu_program.fusions(_HLO) == 2
