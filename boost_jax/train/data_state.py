"""Where every process's training stream stands, saved in a checkpoint and handed back on resume.

A process reads only its rows ``[start, stop)`` of each global batch (data/pipeline.py), so
its grain iterator's state is its own: with ``Data.packing='document'`` each process packs
the groups that hold its rows, and two processes' states differ. A checkpoint therefore holds
every process's state, keyed by process index and rows (``meta["data_state"]``)::

    {"processes": [{"process": 0, "rows": [0, 4], "state": {...}},
                   {"process": 1, "rows": [4, 8], "state": {...}}]}

On resume a process takes the entry with its own index and rows. When the process layout
changed (another process count, or rows), the position is re-derived where it is the same for
every process -- ``concat``, whose state counts global batches -- and otherwise refused with
one line (:class:`~boost_jax.train.resume.ResumeMismatch`), never guessed. Checkpoints of
older versions hold process 0's state alone: they resume under ``concat``, or with one process.
"""

from __future__ import annotations

import json

import jax

from boost_jax.parallel import distributed
from boost_jax.train.resume import ResumeMismatch


def gather(state: dict, rows: tuple[int, int]) -> dict:
    """Every process's iterator ``state`` with its index and ``rows`` (one all-gather; every
    process calls it at the same point and gets the same dict)."""
    mine = json.dumps({"process": jax.process_index(), "rows": list(rows), "state": state})
    return {"processes": [json.loads(b) for b in distributed.gather_bytes(mine.encode())]}


def position(meta: dict, rows: tuple[int, int], packing: str, where: str) -> dict:
    """This process's iterator state from a checkpoint's metadata; raises
    :class:`ResumeMismatch` when it cannot be known exactly. ``where``: the checkpoint's
    directory, for the message."""
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
    if packing == "concat":  # the same on every process: the global batches read so far
        return entries[0]["state"]
    raise ResumeMismatch(
        f"the checkpoint in {where} was written by {layout}, and this run reads rows "
        f"{rows[0]}-{rows[1]} in process {here[0]} of {here[2]}: with "
        "Data.packing='document' each process's stream position is its own and cannot be "
        "carried over exactly; resume with the process count and mesh that wrote it, or use "
        "a new --workdir")
