"""Goodput: where a run's wall time went, over every process that trained it.

Seven buckets of seconds, which together are the wall time:

- ``step``: productive step time -- the steps' time (``step_time`` in ``metrics.jsonl``: the
  gap between two steps' completions, less the pauses) less their data wait;
- ``compile``: compiling the train step (or loading it from JAX's compilation cache);
- ``data``: the host fetching a batch while no step was running on the device (``data_time``
  of each step: a fetch counts when the step before it had finished by the fetch's end, the
  whole fetch, so an upper bound of the input stall; a fetch that overlapped a running step
  is the step's);
- ``checkpoint``: reading the checkpoint a run resumes from, and saving checkpoints;
- ``eval``: held-out evaluations and logged samples (their first compilation included);
- ``lost``: time lost to restarts -- the recorded ``step_time`` of the steps an earlier
  process trained after the checkpoint this one resumed from, which this one trains again;
- ``other``: the rest (building the mesh, model and data pipeline, initialising, logging,
  starting and stopping a profile).

A goodput record in ``metrics.jsonl`` (and TensorBoard) holds each bucket's seconds and share
of the wall time; one is written every ``Train.log_every`` steps, at the end of a run, and when
a resumed process starts training (so that what it inherited outlives it).

The count is cumulative over the run's history: a resumed process starts from the last
goodput record of ``metrics.jsonl`` (written by the process before it) and moves the time of
the steps it recomputes from ``step`` and ``data`` to ``lost`` (:func:`carried`). The time a
killed process spent after its last record is unknown except its steps' recorded times (they
count as ``lost``). The pure core is :func:`fractions` and :func:`carried`; :class:`Goodput`
measures this process.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from boost_jax.operations.progress import duration

#: the buckets, in the order the summary line shows them; ``step`` is the productive one
BUCKETS = ("step", "compile", "data", "checkpoint", "eval", "lost", "other")
#: the buckets :class:`Goodput` measures; ``other`` is the wall time less them
MEASURED = tuple(b for b in BUCKETS if b not in ("lost", "other"))
#: the prefix of the goodput fields in ``metrics.jsonl`` and TensorBoard
PREFIX = "goodput/"


def zeros() -> dict[str, float]:
    """Every bucket at 0 s."""
    return dict.fromkeys(BUCKETS, 0.0)


def fractions(seconds: Mapping[str, float]) -> dict[str, float]:
    """Each bucket's share of the wall time, the sum of the buckets (``{bucket: 0 <= x <= 1}``,
    the shares summing to 1; every share 0 when no time was counted)."""
    wall = sum(seconds[b] for b in BUCKETS)
    return {b: seconds[b] / wall if wall > 0 else 0.0 for b in BUCKETS}


def is_record(row: Mapping) -> bool:
    """Whether a ``metrics.jsonl`` entry is a goodput record (not a step, eval or samples)."""
    return f"{PREFIX}wall_s" in row


def carried(history: Iterable[Mapping], start: int) -> dict[str, float]:
    """The seconds by bucket that a process resuming at step ``start`` inherits from the
    run's history (``metrics.jsonl``'s entries in file order, before the resume moves the
    later ones aside): the buckets of the last goodput record, with the recorded time of every
    step after ``start`` (which this process trains again) moved to ``lost`` -- out of ``step``
    and ``data`` for the steps that record counted, added for those after it."""
    last, steps = None, {}
    for row in history:
        if is_record(row):
            last = row
        elif isinstance(row.get("step_time"), int | float):
            steps[row["step"]] = row
    out = zeros()
    counted_to = -1  # the steps up to here are in the last record's buckets
    if last is not None:
        out.update({b: float(last.get(f"{PREFIX}{b}_s", 0.0)) for b in BUCKETS})
        counted_to = last["step"]
    for step, row in steps.items():
        if step <= start:
            continue
        total, data = float(row["step_time"]), float(row.get("data_time", 0.0))
        out["lost"] += total
        if step <= counted_to:
            out["step"] -= total - data
            out["data"] -= data
    return out


def read_history(path: Path) -> list[dict]:
    """The entries of a ``metrics.jsonl`` (none if it does not exist; unreadable lines, a
    write cut off by a kill, are skipped -- the metrics writer reports them)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


class Goodput:
    """This process's time by bucket since ``start`` (a :func:`time.perf_counter` reading:
    the trainer's start), plus what it inherits from the run's history (:meth:`resume`)."""

    def __init__(self, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.own = dict.fromkeys(MEASURED, 0.0)  # measured seconds of this process
        self.inherited = zeros()  # the seconds of the processes before it (carried)

    def add(self, bucket: str, seconds: float) -> None:
        """Count ``seconds`` in ``bucket`` (one of :data:`MEASURED`)."""
        self.own[bucket] += seconds

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[None]:
        """Count the time the block takes in ``bucket``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(bucket, time.perf_counter() - start)

    def resume(self, history: Iterable[Mapping], start_step: int) -> None:
        """Inherit the buckets of the run's history, resuming at ``start_step``
        (:func:`carried`)."""
        self.inherited = carried(history, start_step)

    def seconds(self) -> dict[str, float]:
        """The run's seconds by bucket up to now, this process's and its predecessors'."""
        own = {**zeros(), **self.own}
        own["other"] = time.perf_counter() - self.start - sum(self.own.values())
        return {b: self.inherited[b] + own[b] for b in BUCKETS}

    def record(self) -> dict[str, float]:
        """The goodput fields of ``metrics.jsonl``: ``goodput/wall_s``, each bucket's seconds
        (``goodput/<bucket>_s``) and share of the wall time (``goodput/<bucket>``;
        ``goodput/step`` is the goodput)."""
        seconds = self.seconds()
        out = {f"{PREFIX}wall_s": sum(seconds.values())}
        out.update({f"{PREFIX}{b}_s": s for b, s in seconds.items()})
        out.update({f"{PREFIX}{b}": f for b, f in fractions(seconds).items()})
        return out


#: each bucket but ``step`` as the end-of-run line names it: what it is, without a look-up
SHOWN = {"compile": "compiling", "data": "waiting for data", "checkpoint": "checkpoints",
         "eval": "evals and samples", "lost": "lost to restarts",
         "other": "start-up and the rest"}


def summary(record: Mapping[str, float]) -> str:
    """The end-of-run line: ``goodput 71.2% of 1h05m in train steps; compiling 3.1% | waiting
    for data 0.4% | ...`` (:data:`SHOWN`)."""
    shares = " | ".join(f"{SHOWN[b]} {100 * record[PREFIX + b]:.1f}%" for b in BUCKETS[1:])
    return (f"goodput {100 * record[PREFIX + 'step']:.1f}% of "
            f"{duration(record[PREFIX + 'wall_s'])} in train steps; {shares}")
