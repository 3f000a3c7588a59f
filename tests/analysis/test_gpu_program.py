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


def _c_escape(data: bytes) -> str:
    """``data`` as an HLO string attribute writes it (printable ASCII as is, octal else)."""
    out = []
    for b in data:
        ch = chr(b)
        out.append("\\" + ch if ch in '"\\' else ch if 32 <= b < 127 else f"\\{b:03o}")
    return "".join(out)


def test_triton_kernels_read_the_ptx_target_from_the_compressed_backend_config():
    """jax-triton's call carries its kernel zlib-compressed in the backend config (bytes as
    C escapes, some of them quotes and backslashes): the kernel's name and PTX target come out
    of it, one entry per (kernel, target) with its call count."""
    import zlib

    ptx = (b'\n\x15my_kernel\x10\x04"\\//\n.version 8.7\n.target sm_90a\n.address_size 64\n'
           b".visible .entry my_kernel(\n)")
    config = _c_escape(zlib.compress(ptx))
    call = (f'  %triton_kernel_call.{{}} = f32[8]{{{{0}}}} custom-call(%p), '
            f'custom_call_target="triton_kernel_call", api_version=API_VERSION_STATUS_RETURNING, '
            f'backend_config="{config}"')
    text = ("HloModule m, is_scheduled=true\n\nENTRY %main (p: f32[8]) -> f32[8] {\n"
            "  %p = f32[8]{0} parameter(0)\n" + call.format(1) + "\n"
            + call.format(2).replace("%p)", "%triton_kernel_call.1)") + "\n"
            "  ROOT %c = f32[8]{0} copy(%triton_kernel_call.2)\n}\n")
    assert gpu_program.triton_kernels(text) == {("my_kernel", "sm_90a"): 2}
    assert gpu_program.triton_kernels(_HLO) == {}


_SCHEDULE = """\
hlo_module {
  name: "jit_step"
  entry_computation_name: "main"
  computations {
    name: "body"
    instructions {
      name: "all-reduce-start"
      opcode: "all-reduce-start"
      id: 11
    }
    id: 1
  }
  computations {
    name: "main"
    instructions {
      name: "while.1"
      opcode: "while"
      shape {
      }
      id: 31
      operand_ids: 30
      called_computation_ids: 1
      called_computation_ids: 2
      backend_config: "{\\"known_trip_count\\":{\\"n\\":\\"4\\"},\\"known_init_step\\":{}}"
    }
    id: 3
  }
  entry_computation_id: 3
}
computation_schedules {
  computation_id: 1
  instructions {
    id: 11
    start_timestamp_cycles: 1
    end_timestamp_cycles: 2
  }
  scheduler_statistics {
    all_reduce_wasted_cycles: 5
    total_wasted_cycles: 5
    total_cycles: 40
    memory_pressure_peak: 10
  }
  cycles_per_microsecond: 2
}
computation_schedules {
  computation_id: 3
  scheduler_statistics {
    all_gather_wasted_cycles: 1.5
    total_wasted_cycles: 1.5
    total_cycles: 9
  }
  cycles_per_microsecond: 1
}
"""


def test_latency_hiding_estimate_weighs_each_loop_by_its_trip_count():
    """The exposed time per step: each scheduled computation's wasted cycles, in
    microseconds (its ``cycles_per_microsecond``), times its runs per step (a loop body: the
    while's known trip count times its caller's runs)."""
    est = gpu_program.latency_hiding_estimate(_SCHEDULE)
    assert est["complete"]
    rows = {r["computation"]: r for r in est["computations"]}
    assert rows["body"]["runs"] == 4 and rows["body"]["by_kind"] == {"all_reduce": 2.5}
    assert rows["main"]["runs"] == 1 and rows["main"]["exposed_us"] == 1.5
    assert est["exposed_us"] == 4 * 2.5 + 1.5
    unknown = gpu_program.latency_hiding_estimate(_SCHEDULE.replace("known_trip_count", "x"))
    assert not unknown["complete"] and unknown["exposed_us"] == 1.5


_LOOP_HLO = """\
HloModule jit_step, is_scheduled=true

%body (p: (s32[], bf16[4,2,96,64], f32[4,2,96,64], bf16[4,96,64])) -> (s32[], bf16[4,2,96,64], f32[4,2,96,64], bf16[4,96,64]) {
  ROOT %p = (s32[], bf16[4,2,96,64]{3,2,1,0}, f32[4,2,96,64]{3,2,1,0}, bf16[4,96,64]{2,1,0}) parameter(0)
}

%cond (c: (s32[], bf16[4,2,96,64], f32[4,2,96,64], bf16[4,96,64])) -> pred[] {
  %c = (s32[], bf16[4,2,96,64]{3,2,1,0}, f32[4,2,96,64]{3,2,1,0}, bf16[4,96,64]{2,1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: (s32[], bf16[4,2,96,64], f32[4,2,96,64], bf16[4,96,64])) -> (s32[], bf16[4,2,96,64], f32[4,2,96,64], bf16[4,96,64]) {
  %a = (s32[], bf16[4,2,96,64]{3,2,1,0}, f32[4,2,96,64]{3,2,1,0}, bf16[4,96,64]{2,1,0}) parameter(0)
  ROOT %while.7 = (s32[], bf16[4,2,96,64]{3,2,1,0}, f32[4,2,96,64]{3,2,1,0}, bf16[4,96,64]{2,1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_layer_loop_residuals_count_the_stacked_activations_per_token():
    """A loop of 4 iterations stacking a bf16 and an fp32 activation of width 64 per token
    (batch 2 x seq 96) beside a stacked weight ``[4, 96, 64]`` (its 96 is no sequence: no batch
    dimension before it; not counted): one of each, 2 x 64 + 4 x 64 bytes per token."""
    got = gpu_program.layer_loop_residuals(_LOOP_HLO, seq_len=96)
    assert got == [{"loop": "while.7", "trips": 4, "kept": {"bf16[64]": 1, "f32[64]": 1},
                    "bytes_per_token": 64 * 2 + 64 * 4}]
    assert gpu_program.layer_loop_residuals(_LOOP_HLO, seq_len=97) == []
