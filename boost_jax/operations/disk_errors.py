"""A run file that cannot be written -- a full disk, a quota, a lost mount -- as one line.

The checkpoints have their own (checkpointing/checkpointer.py ``CheckpointWriteError``, which also
reads
TensorStore's errors); this covers the workdir's files: ``metrics.jsonl``, TensorBoard's
events, ``config.gin`` / ``config.json`` and ``last_checkpoint.json``. Both end the run with
exit code 1 (commands/train.py): not 75, which tells a scheduler to retry into the same full disk.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path


class WriteError(RuntimeError):
    """A run file could not be written (the message is one line)."""


def free_space(path: Path) -> str:
    """``" (12.3 MiB free there)"`` for the file system that holds ``path`` (or its nearest
    existing parent); ``""`` when none can be asked."""
    for p in (path, *path.parents):
        try:
            return f" ({shutil.disk_usage(p).free / 2**20:,.1f} MiB free there)"
        except OSError:
            continue
    return ""


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an ``OSError`` raised in the block into a :class:`WriteError` naming ``path``, the
    error and the free space there."""
    try:
        yield
    except OSError as err:
        raise WriteError(f"could not write {path}: {err.strerror or err}{free_space(path)}; "
                         "free space (or choose another --workdir) and rerun: the run resumes "
                         "from its last checkpoint") from None
