"""TensorBoard's event file, written in the caller's thread: a write that fails (a full disk)
raises there, at once, instead of killing a background writer that the next write waits on.

tensorboardX's ``SummaryWriter`` hands events to a worker thread through a queue of ten: when
the worker dies on ENOSPC, the queue fills and every later write blocks the training loop
for good, as does its ``atexit`` flush at the end (issue 46, case 3). This writer builds the
same events with tensorboardX's summary functions and appends them with its synchronous
``EventsWriter`` (the class its worker uses; both public names of tensorboardX, pinned in
pyproject.toml and read back in tests/train/test_metrics.py), flushing after each record.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    """Imports inside see no PyTorch, unless it is already imported.

    ``tensorboardX/__init__.py`` imports its ``SummaryWriter`` module, which imports torch when
    it is installed (for ``torch.Tensor`` values; ``except ImportError`` otherwise): 3 s of
    every trainer's start on a host with torch, for a writer that needs none of it. A ``None``
    entry in ``sys.modules`` makes ``import torch`` raise ImportError (Python's documented
    import protocol); the entry is removed afterwards, so a later ``import torch`` works
    (tests/train/test_metrics.py checks both)."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


with _without_torch():
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.summary import scalar, text


class EventFile:
    """``<logdir>/events.out.tfevents.<time>.<host>``: scalars and texts by step.

    ``purge_step``: on resume, TensorBoard drops the events of later steps of the earlier
    files (the lost tail of an interrupted run, which this run logs again)."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(Path(logdir) / "events"))
        if purge_step is not None:  # as SummaryWriter(purge_step=...) writes it
            self._write(Event(step=purge_step, file_version="brain.Event:2"))
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event: Event) -> None:
        event.wall_time = time.time()
        self._writer.write_event(event)
        self._writer.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding every ``tag: value`` of ``values``."""
        if values:
            summaries = [scalar(tag, value).value[0] for tag, value in values.items()]
            event = Event(step=step)
            event.summary.value.extend(summaries)
            self._write(event)

    def text(self, step: int, tag: str, value: str) -> None:
        self._write(Event(step=step, summary=text(tag, value)))

    def close(self) -> None:
        self._writer.close()
