"""Where every process's training stream stands, saved in a checkpoint and handed back on resume.

A process reads only its rows ``[start, stop)`` of each global batch (data/loader.py), so
its grain iterator's state is its own: with ``Data.packing='document'`` each process packs
the groups that hold its rows, and two processes' states differ. A checkpoint therefore holds
every process's state, keyed by process index and rows (``meta["data_state"]``)::

    {"processes": [{"process": 0, "rows": [0, 4], "state": {...}},
                   {"process": 1, "rows": [4, 8], "state": {...}}]}

On resume a process takes the entry with its own index and rows. When the process layout
changed (another process count, or rows), the position is re-derived: under ``concat`` and
``pad`` it is the same for every process (the state counts global batches); under ``document``
each packing group's state is taken from the entry that held the group (group ``g`` packs
rows ``[g * per, (g + 1) * per)`` of every global batch, and a process's state is its groups'
states, side by side), when the global batch and ``Data.packing_bins`` -- so the groups -- are
the checkpoint's. Anything else is refused with one line
(:class:`~boost_jax.train.resume.ResumeMismatch`), never guessed. Checkpoints of older
versions hold process 0's state alone: they resume under ``concat``, or with one process.
"""

from __future__ import annotations

import json

import jax

from boost_jax.data.packing import packing_groups
from boost_jax.parallel import distributed
from boost_jax.train.resume import ResumeMismatch


def gather(state: dict, rows: tuple[int, int]) -> dict:
    """Every process's iterator ``state`` with its index and ``rows`` (one all-gather; every
    process calls it at the same point and gets the same dict)."""
    mine = json.dumps({"process": jax.process_index(), "rows": list(rows), "state": state})
    return {"processes": [json.loads(b) for b in distributed.gather_bytes(mine.encode())]}


def position(meta: dict, rows: tuple[int, int], packing: str, where: str,
             group_rows: int | None = None) -> dict:
    """This process's iterator state from a checkpoint's metadata; raises
    :class:`ResumeMismatch` when it cannot be known exactly. ``where``: the checkpoint's
    directory, for the message. ``group_rows``: rows per packing group when the checkpoint
    packed the same groups (:func:`same_groups`), else None."""
    saved = meta["data_state"]
    if "processes" in saved:
        entries = saved["processes"]
        layout = f"{len(entries)} process(es) reading rows " + ", ".join(
            f"{e['rows'][0]}-{e['rows'][1]}" for e in entries)
    else:  # an older checkpoint: process 0's state only
        written_by = meta.get("process_count", 1)
        entries = [{"process": 0, "rows": None, "state": saved, "alone": written_by == 1}]
        layout = f"an older version in {written_by} process(es)"
    here = jax.process_index(), list(rows), jax.process_count()
    for e in entries:
        if (e["process"], e["rows"], len(entries)) == here or (e.get("alone") and here[2] == 1):
            return e["state"]
    if packing in ("concat", "pad"):  # the same on every process: the global batches read
        return entries[0]["state"]
    regrouped = _regrouped(entries, rows, group_rows) if group_rows else None
    if regrouped is not None:
        return regrouped
    raise ResumeMismatch(
        f"the checkpoint in {where} was written by {layout}, and this run reads rows "
        f"{rows[0]}-{rows[1]} in process {here[0]} of {here[2]}: with "
        "Data.packing='document' each process's stream position is its own and can be "
        "carried over only with the checkpoint's Train.batch_size and Data.packing_bins; "
        "resume with those (or the process count and mesh that wrote it), or use a new "
        "--workdir")


def same_groups(meta: dict, batch_size: int, bins: int) -> int | None:
    """Rows per packing group (data/packing.py ``packing_groups``) when the checkpoint's global
    batch and ``Data.packing_bins`` are ``batch_size`` and ``bins`` and it was read without
    grain workers (whose state is theirs), else None."""
    saved = meta.get("config", {})
    if (saved.get("Train", {}).get("batch_size"), saved.get("Data", {}).get("packing_bins"),
            meta.get("worker_count", 0)) != (batch_size, bins, 0):  # (workers: another state)
        return None
    return packing_groups(batch_size, bins)[1]


def _groups(rows: tuple[int, int] | list[int], per: int) -> range:
    """The packing groups that hold ``rows``."""
    return range(rows[0] // per, -(-rows[1] // per))


def _regrouped(entries: list[dict], rows: tuple[int, int], per: int) -> dict | None:
    """The state of an iterator over ``rows`` built from the groups' states in ``entries``
    (one group: its state; several: grain's zip of them, ``{"parents": [...]}``); None when an
    entry's state is not of that form or a group is missing."""
    states = {}
    for e in entries:
        if e.get("rows") is None:
            return None
        held = _groups(e["rows"], per)
        parts = e["state"].get("parents") if len(held) > 1 else [e["state"]]
        if not isinstance(parts, list) or len(parts) != len(held):
            return None
        states.update(zip(held, parts))
    mine = _groups(rows, per)
    if any(g not in states for g in mine):
        return None
    return states[mine[0]] if len(mine) == 1 else {"parents": [states[g] for g in mine]}
