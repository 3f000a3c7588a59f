"""Collectives read from compiled (optimised, SPMD-partitioned, per-device) HLO text.

:func:`collectives` lists every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute of a compiled program with its per-device shapes, dtype, the mesh axes its
replica groups span, whether it belongs to the backward pass, and how many times it runs per
call (``while`` trip counts multiplied through nested loops).

Conventions:

* ``elements`` is the logical array a collective reduces or moves: an all-reduce's array, an
  all-gather's gathered result, a reduce-scatter's full input (result x group size), a
  permute's or all-to-all's array. Tuple-shaped ops (XLA combines independent collectives)
  count every element of the tuple.
* ``bytes = elements x itemsize``. XLA's CPU backend computes bf16/f16 collectives in f32
  ("promoted": a reduction's computation gets a ``_promoted`` suffix, a gather's operand is a
  convert from a 2-byte float); they are counted at 2 bytes per element, what a GPU run sends.
* Replica groups come in several notations: explicit ``{{0,1},{2,3}}``, iota
  ``[2,4]<=[4,2]T(1,0)``, and XLA's mesh form ``mesh['axis_0'=2,...] {'axis_0'}`` (whose axis
  names are XLA's, not the Mesh's). All are expanded to device positions in the mesh's flat
  device order and read back as mesh coordinates.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
            "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}

_HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s+\((?P<params>.*)\)\s+->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s+=\s+(?P<type>\(.*?\)|\S+)\s+"
                    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([0-9,]*)\]")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One logical collective of a compiled program (see the module docstring).

    XLA combines independent collectives into one tuple-shaped instruction; each element of
    such a tuple is listed as its own Collective (``combined`` > 1 says how many shared it).
    """

    op: str
    name: str  # the HLO instruction
    dtype: str
    shape: tuple[int, ...]  # per-device result
    elements: int
    bytes: int
    axes: tuple[str, ...]
    group_size: int
    count: int  # executions per call of the program
    trips: tuple[int, ...]  # trip counts of the enclosing while loops, outermost first
    backward: bool
    op_name: str
    combined: int = 1

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution on a ring (scaling book): an all-reduce
        ``2 (n-1)/n`` of its array, an all-gather or reduce-scatter ``(n-1)/n`` of the full
        array, an all-to-all ``(n-1)/n``, a permute its array."""
        n = self.group_size
        if self.op == "collective-permute":
            return float(self.bytes)
        return self.bytes * (n - 1) / n * (2 if self.op == "all-reduce" else 1)


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _ARRAY.findall(type_str)]


def _tuple_elements(type_str: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), u32[])``; ``[type_str]`` for an
    array type. Commas inside shapes ``[4,8]`` and layouts ``{1,0}`` are not separators."""
    text = type_str.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:  # the closing parenthesis
                parts.append(text[start:i])
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def _start_results(op: str, type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    """The result arrays of an asynchronous ``<op>-start``. Its type is ``(operands,
    results[, u32[] contexts])`` -- the operands a tuple when several -- except an
    ``all-reduce-start`` whose operands are not listed (its type is its result or a tuple of
    combined results)."""
    elements = _tuple_elements(type_str)
    if op == "all-reduce" and (len(elements) == 1 or not elements[0].startswith("(")):
        return _arrays(type_str)
    return [a for e in elements[1:] for a in _arrays(e) if a[1] != () or op == "all-reduce"]


def _parse(hlo: str) -> tuple[dict[str, list[_Instr]], dict[str, str], str]:
    """Computations -> instructions, computation -> parameter text, and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    params: dict[str, str] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if (m := _HEADER.match(line)) is not None:
            current = m.group("name")
            comps[current], params[current] = [], m.group("params")
            entry = current if m.group(1) else entry
        elif current is not None and (m := _INSTR.match(line)) is not None:
            operands = re.findall(r"%([\w.\-]+)", m.group("operands"))
            comps[current].append(_Instr(m.group("name"), m.group("type"), m.group("op"),
                                         operands, m.group("attrs")))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, params, entry


def _multiplicities(comps, entry) -> dict[str, tuple[int, tuple[int, ...]]]:
    """computation -> (executions per call, enclosing while trip counts)."""
    out: dict[str, tuple[int, tuple[int, ...]]] = {}

    def visit(name: str, count: int, trips: tuple[int, ...]) -> None:
        old = out.get(name)
        out[name] = (count + (old[0] if old else 0), trips if old is None else old[1])
        for ins in comps.get(name, ()):
            called = _CALLED.findall(ins.attrs)
            if (b := _BRANCHES.search(ins.attrs)) is not None:
                called += re.findall(r"%([\w.\-]+)", b.group(1))
            if ins.op == "while":
                t = _TRIP.search(ins.attrs)
                n = int(t.group(1)) if t else 1
                for c in called:
                    visit(c, count * n, (*trips, n))
            else:
                for c in called:
                    if c in comps and c != name:
                        visit(c, count, trips)

    visit(entry, 1, ())
    return out


def _groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Device groups (positions in the mesh's flat order) of a collective's attributes."""
    if (m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)) is not None:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    if (m := re.search(r"replica_groups=\{(\{[0-9,{}\s]*\})?\}", attrs)) is not None:
        if not m.group(1):
            return [list(range(n_devices))]
        return [[int(v) for v in g.split(",") if v.strip()]
                for g in re.findall(r"\{([0-9,\s]+)\}", m.group(1))]
    if (m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?",
                       attrs)) is not None:
        ids = np.arange(n_devices).reshape([int(v) for v in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(v) for v in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if (m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\]"
                       r"(?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}", attrs)) is not None:
        names, sizes = zip(*[(k, int(v)) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))])
        ids = np.arange(n_devices)
        if m.group(2):
            ids = ids.reshape([int(v) for v in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        kept = [i for i in range(len(sizes)) if i not in reduced]
        grouped = ids.reshape(sizes).transpose(kept + reduced)
        return grouped.reshape(-1, math.prod(sizes[i] for i in reduced)).tolist()
    return [list(range(n_devices))]


def _axes(groups: list[list[int]], mesh_shape: tuple[int, ...], names: tuple[str, ...]
          ) -> tuple[str, ...]:
    coords = np.array([np.unravel_index(g, mesh_shape) for g in groups])  # [groups, axes, n]
    varying = (coords != coords[:, :, :1]).any(axis=(0, 2))
    return tuple(n for n, v in zip(names, varying) if v)


def _widened(instrs: list[_Instr]) -> bool:
    """Does a fused computation end (through layout-only ops) in a convert of a 2-byte float
    to f32 -- e.g. a GEMM's f32 output rounded to bf16 and widened back in one fusion?"""
    by_name = {i.name: i for i in instrs}
    node = instrs[-1] if instrs else None  # the ROOT is printed last
    while node is not None and node.op in ("bitcast", "copy", "reshape", "transpose"):
        node = by_name.get(node.operands[0]) if node.operands else None
    if node is None or node.op != "convert" or [t for t, _ in _arrays(node.type)] != ["f32"]:
        return False
    inner = by_name.get(node.operands[0]) if node.operands else None
    return inner is not None and [t for t, _ in _arrays(inner.type)] in (["bf16"], ["f16"])


def _promoted(ins: _Instr, by_name: dict[str, _Instr], params: dict[str, str],
              comps: dict[str, list[_Instr]] | None = None) -> bool:
    """Did XLA's CPU backend widen a 2-byte float collective to f32?

    Exact for reductions (their reduction computation is renamed ``*_promoted``); for gathers,
    permutes and all-to-alls, whose operand the backend converts up from bf16/f16 (alone, or
    fused: a fusion of 2-byte inputs, or one ending in the widening convert), a program that
    itself casts to f32 right before such a collective would be misread as promoted.
    """
    if "to_apply=" in ins.attrs:
        return "_promoted" in ins.attrs
    src = by_name.get(ins.operands[0]) if ins.operands else None
    if src is None:
        return False
    if src.op == "convert":
        inner = by_name.get(src.operands[0]) if src.operands else None
        return inner is not None and any(t in ("bf16", "f16") for t, _ in _arrays(inner.type))
    if src.op == "fusion" and (c := re.search(r"calls=%([\w.\-]+)", src.attrs)) is not None:
        inputs = _arrays(params.get(c.group(1), ""))
        narrow = bool(inputs) and all(t in ("bf16", "f16") for t, _ in inputs) and \
            all(t == "f32" for t, _ in _arrays(src.type))
        return narrow or _widened((comps or {}).get(c.group(1), []))
    return False


def _element_op_names(attrs: str, n: int) -> list[str]:
    """Per-element op names; a combined op's metadata reads ``prefix/(name1:name2:...)``."""
    op_name = m.group(1) if (m := _OP_NAME.search(attrs)) else ""
    if n > 1 and (m := re.fullmatch(r"(.*?)/\((.*)\)", op_name)) is not None:
        parts = m.group(2).split(":")
        if len(parts) == n:
            return [f"{m.group(1)}/{p}" for p in parts]
    return [op_name] * n


def collectives(hlo: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]
                ) -> list[Collective]:
    """Every collective of compiled HLO text for a mesh of ``mesh_shape`` / ``axis_names``."""
    comps, params, entry = _parse(hlo)
    mult = _multiplicities(comps, entry)
    n_devices = math.prod(mesh_shape)
    out = []
    for comp, instrs in comps.items():
        if comp not in mult:
            continue
        count, trips = mult[comp]
        by_name = {i.name: i for i in instrs}
        for ins in instrs:
            op = ins.op.removesuffix("-start")
            if op not in OPS or ins.op.endswith("-done"):
                continue
            arrays = (_start_results(op, ins.type) if ins.op.endswith("-start")
                      else _arrays(ins.type))
            groups = _groups(ins.attrs, n_devices)
            size, axes = len(groups[0]), _axes(groups, mesh_shape, axis_names)
            promoted = _promoted(ins, by_name, params, comps)
            names = _element_op_names(ins.attrs, len(arrays))
            for (dtype, shape), op_name in zip(arrays, names):
                elements = math.prod(shape) * (size if op == "reduce-scatter" else 1)
                if promoted:
                    dtype = "bf16"
                out.append(Collective(op, ins.name, dtype, shape, elements,
                                      elements * ITEMSIZE[dtype], axes, size, count, trips,
                                      "transpose(" in op_name, op_name, len(arrays)))
    return out


def totals(colls: list[Collective]) -> dict[tuple[str, ...], dict[str, float]]:
    """Per mesh-axes group: collectives run, elements and bytes per call, and the bytes each
    device puts on the wire (:attr:`Collective.wire_bytes`)."""
    out: dict[tuple[str, ...], dict[str, float]] = collections.defaultdict(
        lambda: {"count": 0, "elements": 0, "bytes": 0, "wire_bytes": 0.0})
    for c in colls:
        t = out[c.axes]
        t["count"] += c.count
        t["elements"] += c.count * c.elements
        t["bytes"] += c.count * c.bytes
        t["wire_bytes"] += c.count * c.wire_bytes
    return dict(out)


def users(hlo: str, op: str) -> dict[str, list[str]]:
    """Every ``op`` instruction (e.g. ``reduce-scatter``) of compiled HLO text inside a loop
    body, with the instructions of its computation that read its result (``name = opcode``;
    a fusion's name says what it fuses). Shows, e.g., that a layer's gradient reduction
    feeds only the loop's output buffer -- nothing the next iteration computes waits on
    it. The readers of a tuple-shaped (combined) collective are those of its elements."""
    comps, _, entry = _parse(hlo)
    bodies = {c for instrs in comps.values() for i in instrs if i.op == "while"
              for c in re.findall(r"body=%([\w.\-]+)", i.attrs)}
    def readers(instrs: list[_Instr], name: str) -> list[str]:
        found = []
        for u in instrs:
            if name in u.operands:
                found += readers(instrs, u.name) if u.op == "get-tuple-element" else \
                    [f"{u.name} = {u.op}"]
        return found

    out: dict[str, list[str]] = {}
    for comp in bodies:
        instrs = comps.get(comp, [])
        for ins in instrs:
            if ins.op.removesuffix("-start") == op:
                out[ins.name] = readers(instrs, ins.name)
    return out


def entry_instructions(hlo: str) -> list[tuple[str, str, str, list[str]]]:
    """``(name, result type, opcode, operand names)`` of every instruction of the entry
    computation (the step outside any loop)."""
    comps, _, entry = _parse(hlo)
    return [(i.name, i.type, i.op, i.operands) for i in comps[entry]]


@dataclasses.dataclass(frozen=True)
class Dot:
    """One ``dot`` instruction of a compiled program: JAX's ``op_name``, the per-device result
    ``shape``, ``contracted`` (the product of the contracted dimensions) and ``count``
    (executions per call, ``while`` trip counts applied)."""

    op_name: str
    shape: tuple[int, ...]
    contracted: int
    count: int

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 per call."""
        return 2 * math.prod(self.shape) * self.contracted * self.count


def dots(hlo: str) -> list[Dot]:
    """Every ``dot`` of compiled HLO text (fusions' included) that runs."""
    comps, _, entry = _parse(hlo)
    mult = _multiplicities(comps, entry)
    out = []
    for comp, instrs in comps.items():
        types = {i.name: i.type for i in instrs}
        for ins in (i for i in instrs if i.op == "dot" and comp in mult):
            lhs = _arrays(types[ins.operands[0]])[0][1]
            dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs).group(1)
            name = _OP_NAME.search(ins.attrs)
            out.append(Dot(name.group(1) if name else "", _arrays(ins.type)[0][1],
                           math.prod(lhs[int(i)] for i in dims.split(",") if i),
                           mult[comp][0]))
    return out


def computations(hlo: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computation -> its instructions (``name``, ``type``, ``op``, ``operands``, ``attrs``) in
    the order printed -- a scheduled module's (``is_scheduled=true``, a GPU program) execution
    order -- and the entry computation's name."""
    comps, _, entry = _parse(hlo)
    return comps, entry
