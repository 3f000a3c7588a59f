"""What a program compiled for a GPU target holds beyond its collectives (analysis/hlo.py):
which collectives run asynchronously and what compute XLA scheduled under them, the custom
calls (cuDNN attention, cuBLAS, Triton kernels), the fusions, and per-device memory.

A GPU program is scheduled: its HLO text lists each computation's instructions in execution
order. An asynchronous collective is a ``*-start`` / ``*-done`` pair (or ``async-start`` /
``async-done`` around a called computation holding it); the instructions between the two are
what the GPU computes while the collective is in flight. A collective XLA made synchronous is
a plain instruction (``all-reduce``) or a pair whose backend config says ``"is_sync":true``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import zlib

from boost_jax.analysis.hlo import _TRIP, ITEMSIZE, OPS, _arrays, _tuple_elements, computations

#: instructions that compute nothing (layout, tuples, parameters, control): not counted as
#: compute scheduled under a collective
FREE = frozenset({"get-tuple-element", "bitcast", "parameter", "constant", "tuple",
                  "opt-barrier", "copy-start", "copy-done", "partition-id", "replica-id",
                  "after-all", "add-dependency"})
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"([^"]+)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
#: jax-triton's custom call: its backend config is the zlib-compressed kernel proto, holding
#: the kernel's PTX (jax_triton/triton_lib.py, ``triton_kernel_call_lowering``)
TRITON_CALL = "triton_kernel_call"
_BACKEND_CONFIG = re.compile(r'backend_config="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(rb"\\([0-7]{1,3}|x[0-9a-fA-F]{2}|.)", re.S)
_SIMPLE = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b'"': b'"', b"'": b"'", b"\\": b"\\"}
_PTX_ENTRY = re.compile(rb"\.entry\s+(\w+)")
_PTX_TARGET = re.compile(rb"\.target\s+(sm_\w+)")


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """How one collective instruction runs: ``asynchronous`` (a start/done pair XLA did not
    make synchronous) and the compute instructions scheduled between its start and done
    (``overlapped``; their opcodes in ``under``)."""

    name: str  # the collective's instruction (the start's, or the one inside async-start)
    op: str
    asynchronous: bool
    overlapped: int
    under: tuple[str, ...]


def _is_compute(ins) -> bool:
    op = ins.op.removesuffix("-start").removesuffix("-done")
    return ins.op not in FREE and op not in OPS and ins.op not in ("async-start", "async-done")


def schedule(hlo: str) -> dict[str, Scheduled]:
    """Collective instruction name -> :class:`Scheduled`, for every collective of a compiled
    (scheduled) program."""
    comps, _ = computations(hlo)
    out: dict[str, Scheduled] = {}
    for instrs in comps.values():
        for i, ins in enumerate(instrs):
            inner = None
            if ins.op == "async-start" and (c := _CALLS.search(ins.attrs)) is not None:
                inner = next((x for x in comps.get(c.group(1), ())
                              if x.op in OPS), None)
                if inner is None:
                    continue
            elif not (ins.op.endswith("-start") and ins.op.removesuffix("-start") in OPS):
                if ins.op in OPS:
                    out[ins.name] = Scheduled(ins.name, ins.op, False, 0, ())
                continue
            done = next((j for j in range(i + 1, len(instrs))
                         if ins.name in instrs[j].operands and instrs[j].op.endswith("done")),
                        None)
            between = [x for x in instrs[i + 1:done] if _is_compute(x)] if done else []
            sync = '"is_sync":true' in ins.attrs
            name, op = (inner.name, inner.op) if inner is not None else (
                ins.name, ins.op.removesuffix("-start"))
            out[name] = Scheduled(name, op, not sync and done is not None, len(between),
                                  tuple(x.op for x in between))
    return out


def custom_calls(hlo: str) -> dict[str, int]:
    """Custom-call target -> instructions (cuDNN attention ``__cudnn$fmha*``, cuBLAS
    ``__cublas$*``, Triton kernels ``__gpu$xla.gpu.triton``, ...), and each fusion kind
    (``fusion:<kind>``, e.g. ``fusion:__triton_nested_gemm_fusion``) with its count."""
    comps, _ = computations(hlo)
    out: collections.Counter = collections.Counter()
    for instrs in comps.values():
        for ins in instrs:
            if ins.op == "custom-call" and (m := _TARGET.search(ins.attrs)) is not None:
                out[m.group(1)] += 1
            elif ins.op == "fusion" and (m := _KIND.search(ins.attrs)) is not None:
                out[f"fusion:{m.group(1)}"] += 1
    return dict(out)


def _unescape(text: str) -> bytes:
    """The bytes of an HLO string attribute (C escapes: ``\\n``, ``\\"``, octal ``\\234``)."""
    def one(m: re.Match) -> bytes:
        e = m.group(1)
        if e[:1] in b"01234567":
            return bytes([int(e, 8)])
        if e[:1] == b"x":
            return bytes([int(e[1:], 16)])
        return _SIMPLE.get(e, e)
    return _ESCAPE.sub(one, text.encode("latin-1"))


def triton_kernels(hlo: str) -> dict[tuple[str, str], int]:
    """``(kernel, GPU architecture)`` -> calls, for every jax-triton kernel call of a compiled
    GPU program: the kernel's name and the ``.target`` (e.g. ``sm_90a``) of the PTX Triton
    compiled it to, read from the call's backend config."""
    comps, _ = computations(hlo)
    out: collections.Counter = collections.Counter()
    for instrs in comps.values():
        for ins in instrs:
            if ins.op != "custom-call" or f'custom_call_target="{TRITON_CALL}"' not in ins.attrs:
                continue
            m = _BACKEND_CONFIG.search(ins.attrs)
            ptx = zlib.decompress(_unescape(m.group(1))) if m else b""
            entry, target = _PTX_ENTRY.search(ptx), _PTX_TARGET.search(ptx)
            out[(entry.group(1).decode() if entry else "?",
                 target.group(1).decode() if target else "?")] += 1
    return dict(out)


def fusions(hlo: str) -> int:
    """Fusion instructions of the program (each one GPU kernel or library call)."""
    comps, _ = computations(hlo)
    return sum(ins.op == "fusion" for instrs in comps.values() for ins in instrs)


def layer_loop_residuals(hlo: str, seq_len: int) -> list[dict]:
    """What each loop of a compiled program stacks per iteration for the backward pass: for
    every ``while`` with a known trip count ``n``, the elements of its result whose leading
    dimension is ``n`` and which have a ``seq_len`` dimension after a batch dimension (a layer
    loop's stacked activations ``[n, ..., batch, seq, ...]``; a stacked weight ``[n, d, k]``
    whose ``d`` equals ``seq_len`` is not one), counted by dtype and per-token width (the
    product of the dimensions after the sequence's: a head-major ``[n, b, h, s, d]`` counts
    ``d``, not ``h d``): ``{"loop", "trips", "kept": {"bf16[5120]":
    3, ...}, "bytes_per_token": ...}`` (the kept tensors' bytes per token: a layer's, in a
    layer loop). How the performance model's per-layer counts were read
    (analysis/perf_model.py ``KEPT``)."""
    comps, _ = computations(hlo)
    out = []
    for instrs in comps.values():
        for ins in instrs:
            if ins.op != "while" or (trips := _TRIP.search(ins.attrs)) is None:
                continue
            n, kept, size = int(trips.group(1)), collections.Counter(), 0
            for element in _tuple_elements(ins.type):
                for dtype, dims in _arrays(element):
                    if not dims or dims[0] != n or seq_len not in dims[2:]:
                        continue  # an activation: a batch dimension before its sequence's
                    width = math.prod(dims[dims.index(seq_len, 2) + 1:])
                    kept[f"{dtype}[{width}]"] += 1
                    size += width * ITEMSIZE.get(dtype, 4)
            if kept:
                out.append({"loop": ins.name, "trips": n, "kept": dict(sorted(kept.items())),
                            "bytes_per_token": size})
    return out


def memory(compiled, capacity_bytes: int, unsized: int = 0) -> dict:
    """Per-device memory of a compiled program (``memory_analysis()``): arguments (parameters,
    optimizer state, the batch), outputs, what outputs alias of the arguments (donated),
    temporaries, the generated code; ``total`` = arguments + outputs - aliased + temporaries
    + code; against the device's ``capacity_bytes``: ``fits`` and ``headroom_bytes``, which
    also count ``unsized``: what the program holds on a GPU but a compile without one sizes 0
    (cuDNN attention's workspace: the performance model's ``cudnn_workspace``, which equalled
    the device program's buffer to 256 B on an H200, 2026-11-28)."""
    mem = compiled.memory_analysis()
    sizes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in
             ("argument", "output", "alias", "temp", "generated_code")}
    total = (sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
             + sizes["generated_code"])
    return {**sizes, "total": total, "unsized": unsized, "capacity": capacity_bytes,
            "fits": total + unsized <= capacity_bytes,
            "headroom": capacity_bytes - total - unsized}


# --- XLA's latency-hiding schedule (--xla_dump_latency_hiding_schedule) ----------------------
_COMPUTATION = re.compile(r"\n  computations \{\n    name: \"([^\"]+)\"")
_OWN_ID = re.compile(r"\n    id: (\d+)\n")
_WHILE = re.compile(r'opcode: "while"\n.*?\n      called_computation_ids: (\d+)\n'
                    r'      called_computation_ids: \d+\n      backend_config: "([^\n]*)"', re.S)
_TRIPS = re.compile(r'known_trip_count\\":\{\\"n\\":\\"(\d+)')
_STAT = re.compile(r"\n    (\w+_cycles): ([\d.e+-]+)")
_PER_US = re.compile(r"\n  cycles_per_microsecond: ([\d.e+-]+)")


def latency_hiding_estimate(schedule: str) -> dict:
    """XLA's own estimate of the collective time its schedule leaves exposed, from the
    latency-hiding scheduler's dump (``--xla_dump_latency_hiding_schedule``: the scheduled
    module and, per scheduled computation, its ``scheduler_statistics``): per computation its
    name, runs per step (the loops' known trip counts) and wasted ("exposed") cycles per
    collective kind; ``exposed_us``: their sum over a step, in the estimator's units
    (``cycles_per_microsecond`` applied). Not a time: XLA's default GPU estimator is its
    approximate one, which costs an asynchronous collective about 5,000 units whatever its
    size (no GPU measured anything); the analytical one
    (``--xla_gpu_enable_analytical_latency_estimator``) aborts a deviceless compile (jaxlib
    0.12.0.1: a failed check in XLA's shape code)."""
    module, _, scheduled = schedule.partition("\ncomputation_schedules {")
    names, body_of = {}, {}
    blocks = _COMPUTATION.split(module)[1:]
    for name, text in zip(blocks[::2], blocks[1::2]):
        own = _OWN_ID.findall(text)[-1]  # the computation's id follows its instructions
        names[own] = name
        for body, config in _WHILE.findall(text):
            trips = _TRIPS.search(config)
            body_of[body] = (own, int(trips.group(1)) if trips else None)
    entry = re.search(r"\n  entry_computation_id: (\d+)", module)

    def runs(cid: str) -> int | None:
        if entry and cid == entry.group(1):
            return 1
        if cid not in body_of:
            return None
        parent, trips = body_of[cid]
        outer = runs(parent)
        return None if outer is None or trips is None else outer * trips

    rows, total = [], 0.0
    for block in scheduled.split("\ncomputation_schedules {"):
        cid = re.search(r"computation_id: (\d+)", block)
        if cid is None:
            continue
        stats = {k: float(v) for k, v in _STAT.findall(block)}
        per_us = float(m.group(1)) if (m := _PER_US.search(block)) else 1.0
        n = runs(cid.group(1))
        wasted = {k.removesuffix("_wasted_cycles"): v / per_us for k, v in stats.items()
                  if k.endswith("_wasted_cycles") and k != "total_wasted_cycles"}
        exposed = stats.get("total_wasted_cycles", 0.0) / per_us
        rows.append(dict(computation=names.get(cid.group(1), cid.group(1)), runs=n,
                         exposed_us=exposed, by_kind=wasted))
        total += exposed * (n or 0)
    return {"computations": rows, "exposed_us": total,
            "complete": all(r["runs"] is not None for r in rows)}
