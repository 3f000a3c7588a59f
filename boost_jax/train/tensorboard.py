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

#: what tensorboardX's package imports when it is installed and this writer never uses:
#: PyTorch (``tensorboardX/writer.py``, for ``torch.Tensor`` values) and the S3 and GCS clients
#: (``tensorboardX/record_writer.py``, for ``s3://`` / ``gs://`` log directories) -- 3 s and
#: 2 s of every trainer's start on a host with them (the ``test`` and ``gcs`` extras bring the
#: clients); each is imported in a ``try ... except ImportError``
UNUSED = ("torch", "boto3", "google.cloud.storage")


@contextlib.contextmanager
def _without(modules: tuple[str, ...]) -> Iterator[None]:
    """Imports inside see none of ``modules`` that is not imported yet: a ``None`` entry in
    ``sys.modules`` makes importing it raise ImportError (Python's documented import
    protocol); the entries are removed afterwards, so later imports of them work
    (tests/train/test_metrics.py checks both)."""
    hidden = [name for name in modules if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


with _without(UNUSED):
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
