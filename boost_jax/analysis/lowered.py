"""The program lowered for CUDA, read on a host without a GPU: its collectives and custom calls.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` (the public
``jax.stages.Traced.lower`` parameter) lowers for CUDA on a CPU-only host, ``jax.shard_map``
regions over a mesh of CPU devices included (pass the arguments as ``jax.ShapeDtypeStruct``
with a ``NamedSharding``). Nothing is compiled: the result is StableHLO text, before XLA's
partitioner and optimisation passes. So what this module reads is the program JAX hands to a
GPU's XLA:

* the collectives written inside ``shard_map`` regions (the project's whole train step runs in
  one), per device, with the dtype they are sent in -- but not the collectives XLA's
  partitioner would add outside ``shard_map`` (GSPMD), nor XLA's later combining or promotion;
* the custom calls (cuDNN attention ``__cudnn$fmha*``, Triton kernels) with their operand and
  result shapes.

Each op is listed once as written: an op inside a loop body (``scan`` over layers) appears once
however many times it runs.

``jax.export.export(..., platforms=['cuda'])`` lowers too but refuses cuDNN's custom calls (they
carry no compatibility guarantee), hence ``lower(lowering_platforms=...)``. cuDNN attention's
trace-time checks need cuDNN and a GPU: lower it under :func:`boost_jax.compat.cudnn_trace_standin`.

The parser reads MLIR's generic and pretty forms: ``"stablehlo.all_reduce"(%x) <{...}> ({ region
}) : (tensor<4x8xbf16>) -> tensor<4x8xbf16>`` (the region spans lines) and
``stablehlo.custom_call @target(%a, %b) {...} : (types) -> (types)``; ``loc(...)`` is stripped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute",
               "collective_broadcast")

_OP = re.compile(r'^[ \t]*(?:%[\w.$-]+(?::\d+)?(?:[ \t]*,[ \t]*%[\w.$-]+(?::\d+)?)*[ \t]*=[ \t]*)?'
                 r'(?P<q>"?)(?P<op>[a-z_][\w]*\.[\w.$]+)(?P=q)', re.MULTILINE)
_TENSOR = re.compile(r"tensor<([^<>]*)>")
_DIMS = re.compile(r"((?:(?:\d+|\?)x)*)(.*)")
_TARGET = re.compile(r'^\s*@"?([^\s("]+)"?|call_target_name\s*=\s*"([^"]+)"')
_MESH = re.compile(r"sdy\.mesh\s+@([\w.$-]+)\s*=\s*<\[([^\]]*)\](?:,\s*device_ids=\[([\d,\s]*)\])?")
_DENSE_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)\s*=\s*dense<(.*?)>\s*:"
                           r"\s*tensor<(\d+)x(\d+)xi64>")
_MESH_AXES = re.compile(r"replica_group_mesh_axes<mesh\s*=\s*@([\w.$-]+),\s*axes\s*=\s*\[(.*?)\]>")
_SKIPPED = ("builtin.module", "func.func")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One ``tensor<...>`` type: ``shape`` (``-1`` for a dynamic dim) and MLIR ``dtype``
    (``bf16``, ``f32``, ``i32``, ``ui8``, ...)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        """Bytes per element (``i1``: 1; ``index``: 8)."""
        bits = re.search(r"(\d+)", self.dtype)
        return 8 if bits is None else max(1, int(bits.group(1)) // 8)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.elements * self.itemsize


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a lowered program.

    ``kind``: the collective (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``collective_permute``, ``collective_broadcast``), ``custom_call``, or the op
    name as written (``stablehlo.dot_general``). ``target``: a custom call's target.
    ``operands`` / ``results``: their types (per device inside ``shard_map``). ``axes``: the mesh
    axes a collective's groups span, in mesh order (``None`` where the text names no mesh);
    ``group_size``: devices per group. ``line``: 1-based line of the op in the text.
    """

    kind: str
    target: str | None
    operands: tuple[Tensor, ...]
    results: tuple[Tensor, ...]
    axes: tuple[str, ...] | None = None
    group_size: int | None = None
    line: int = 0

    @property
    def dtypes(self) -> set[str]:
        return {t.dtype for t in self.operands + self.results}

    @property
    def bytes(self) -> int:
        """Bytes of the larger side (operands or results): an all-gather's gathered result, a
        reduce-scatter's full input, an all-reduce's array."""
        return max(sum(t.bytes for t in self.operands), sum(t.bytes for t in self.results))


def strip_locations(text: str) -> str:
    """``text`` without ``loc(...)`` annotations and ``#loc`` alias lines."""
    text = re.sub(r"^#loc[\w]*\s*=.*$\n?", "", text, flags=re.MULTILINE)
    out, i = [], 0
    while (j := text.find("loc(", i)) >= 0:
        if j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_.#"):
            out.append(text[i:j + 4])
            i = j + 4
            continue
        out.append(text[i:j].rstrip(" "))
        depth, k = 0, j + 3
        while k < len(text):
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
            if depth == 0:
                break
        i = k
    out.append(text[i:])
    return "".join(out)


def _statement(text: str, start: int) -> tuple[str, str | None]:
    """From an op name at ``start``: (its header up to the type signature, the signature or
    ``None``). Tracks ``()[]{}`` and strings; the statement ends at a newline at depth 0."""
    depth, k, n = 0, start, len(text)
    while k < n:
        c = text[k]
        if c == '"':
            k += 1
            while k < n and text[k] != '"':
                k += 2 if text[k] == "\\" else 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == "\n":
            return text[start:k], None
        elif depth == 0 and c == ":" and k + 1 < n and text[k + 1] in " \t":
            end = text.find("\n", k)
            end = n if end < 0 else end
            return text[start:k], text[k + 1:end].strip()
        k += 1
    return text[start:], None


def _types(text: str) -> tuple[Tensor, ...]:
    out = []
    for body in _TENSOR.findall(text):
        m = _DIMS.match(body.split(",")[0].strip())  # `4x8xbf16`, `bf16`, `4xindex`
        dims = tuple(-1 if d == "?" else int(d) for d in m.group(1).split("x")[:-1])
        out.append(Tensor(dims, m.group(2)))
    return tuple(out)


def _signature(sig: str) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    depth = 0
    for k, c in enumerate(sig):
        depth += {"(": 1, ")": -1, "<": 1, ">": -1}.get(c, 0) if sig[k - 1:k + 1] != "->" else 0
        if depth == 0 and sig.startswith("->", k):
            return _types(sig[:k]), _types(sig[k + 2:])
    same = _types(sig)  # `op %a, %b : type`: operands and results share the type
    return same, same


def _meshes(text: str) -> dict[str, tuple[list[tuple[str, int]], list[int] | None]]:
    meshes = {}
    for name, axes, ids in _MESH.findall(text):
        pairs = [(a, int(s)) for a, s in re.findall(r'"([^"]+)"\s*=\s*(\d+)', axes)]
        meshes[name] = (pairs, [int(i) for i in ids.split(",")] if ids.strip() else None)
    return meshes


def _spanned(groups: Sequence[Sequence[int]], mesh) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of each group differ."""
    if mesh is None:
        return None
    axes, ids = mesh
    sizes = [s for _, s in axes]
    spanned = set()
    for group in groups:
        coords = []
        for d in group:
            pos = ids.index(d) if ids else d
            coords.append([(pos // math.prod(sizes[i + 1:])) % sizes[i] for i in range(len(sizes))])
        spanned |= {i for i in range(len(sizes)) if len({c[i] for c in coords}) > 1}
    return tuple(axes[i][0] for i in sorted(spanned))


def _groups(header: str, kind: str, meshes) -> tuple[tuple[str, ...] | None, int | None]:
    if kind not in COLLECTIVES:
        return None, None
    if m := _MESH_AXES.search(header):
        mesh = meshes.get(m.group(1))
        names = tuple(re.findall(r'name\s*=\s*"([^"]+)"', m.group(2)))
        sizes = dict(mesh[0]) if mesh else {}
        size = math.prod(sizes[a] for a in names) if all(a in sizes for a in names) else None
        return names, size
    if m := _DENSE_GROUPS.search(header):
        body, rows, cols = m.group(1), int(m.group(2)), int(m.group(3))
        values = json.loads(body) if body.lstrip().startswith("[") else [[int(body)] * cols] * rows
        distinct = {tuple(ms[0]) for ms in meshes.values()}
        mesh = next(iter(meshes.values())) if len(distinct) == 1 else None
        return _spanned(values, mesh), None if kind == "collective_permute" else cols
    return None, None


def parse_ops(text: str) -> list[Op]:
    """Every op of a lowered StableHLO program (``Lowered.as_text()``) that has a type
    signature, in text order (see :class:`Op`)."""
    text = strip_locations(text)
    meshes = _meshes(text)
    ops = []
    for m in _OP.finditer(text):
        name = m.group("op")
        if name in _SKIPPED:
            continue
        header, sig = _statement(text, m.end())
        if sig is None:
            continue
        short = name.split(".", 1)[1]
        kind = short if name.startswith("stablehlo.") and (
            short in COLLECTIVES or short == "custom_call") else name
        target = None
        if kind == "custom_call" and (t := _TARGET.search(header)):
            target = t.group(1) or t.group(2)
        operands, results = _signature(sig)
        axes, size = _groups(header, kind, meshes)
        ops.append(Op(kind, target, operands, results, axes, size,
                      text.count("\n", 0, m.start("op")) + 1))
    return ops


def collectives(ops: Iterable[Op]) -> list[Op]:
    """The collectives among ``ops``."""
    return [op for op in ops if op.kind in COLLECTIVES]


def custom_calls(ops: Iterable[Op], prefix: str = "") -> list[Op]:
    """The custom calls among ``ops`` whose target starts with ``prefix``."""
    return [op for op in ops if op.kind == "custom_call" and (op.target or "").startswith(prefix)]


def tensors(text: str) -> list[Tensor]:
    """Every tensor type written anywhere in the program (arguments, op types, loop carries)."""
    return list(_types(strip_locations(text)))


def cuda_lowered(jitted, *args, **kwargs):
    """``jitted`` (a ``jax.jit`` function) traced with ``args`` (arrays or
    ``jax.ShapeDtypeStruct``, with shardings for a mesh) and lowered for CUDA: a
    ``jax.stages.Lowered``. Nothing is compiled; no GPU is needed (cuDNN attention needs
    :func:`boost_jax.compat.cudnn_trace_standin` around this call)."""
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def cuda_lowered_text(jitted, *args, **kwargs) -> str:
    """The StableHLO text of :func:`cuda_lowered`."""
    return cuda_lowered(jitted, *args, **kwargs).as_text()


def cuda_ops(jitted, *args, **kwargs) -> list[Op]:
    """:func:`parse_ops` of :func:`cuda_lowered_text`."""
    return parse_ops(cuda_lowered_text(jitted, *args, **kwargs))
