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
import re

from boost_jax.analysis.hlo import OPS, computations

#: instructions that compute nothing (layout, tuples, parameters, control): not counted as
#: compute scheduled under a collective
FREE = frozenset({"get-tuple-element", "bitcast", "parameter", "constant", "tuple",
                  "opt-barrier", "copy-start", "copy-done", "partition-id", "replica-id",
                  "after-all", "add-dependency"})
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"([^"]+)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")


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


def fusions(hlo: str) -> int:
    """Fusion instructions of the program (each one GPU kernel or library call)."""
    comps, _ = computations(hlo)
    return sum(ins.op == "fusion" for instrs in comps.values() for ins in instrs)


def memory(compiled, capacity_bytes: int) -> dict:
    """Per-device memory of a compiled program (``memory_analysis()``): arguments (parameters,
    optimizer state, the batch), outputs, what outputs alias of the arguments (donated),
    temporaries, the generated code; ``total`` = arguments + outputs - aliased + temporaries
    + code; against the device's ``capacity_bytes``: ``fits`` and ``headroom_bytes``."""
    mem = compiled.memory_analysis()
    sizes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in
             ("argument", "output", "alias", "temp", "generated_code")}
    total = (sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
             + sizes["generated_code"])
    return {**sizes, "total": total, "capacity": capacity_bytes,
            "fits": total <= capacity_bytes, "headroom": capacity_bytes - total}
