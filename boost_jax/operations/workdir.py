"""The run's workdir, checked before anything is written: a local directory (a URL is
refused: buckets take the checkpoints, ``--checkpoint_dir``), created if needed, writable; and
removed again when the run that created it fails before it recorded anything there
(:func:`prepared`)."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from boost_jax.config import ConfigError

#: a URL's scheme (RFC 3986): ``s3://``, ``gs://``, ``file://``, ...
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def workdir_checked(workdir: str | Path) -> Path:
    """Create ``workdir`` if needed and write a file there, before any work is done: its
    absolute path. A URL is refused (the workdir is local; a bucket takes the checkpoints):
    ``Path`` would make ``s3://b/run`` a directory ``s3:`` beside the current one."""
    if _URL.match(str(workdir)):
        raise ConfigError(f"--workdir={workdir}: the workdir is a local directory (metrics, "
                          "logs, the run's files); checkpoints can go to a bucket: "
                          f"--checkpoint_dir={str(workdir).rstrip('/')}/checkpoints with a local "
                          "--workdir")
    workdir = Path(workdir).absolute()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(f"--workdir={workdir} is not writable ({err.strerror or err}); "
                          "choose another --workdir") from None
    return workdir


@contextlib.contextmanager
def prepared(workdir: str | Path, recorded: Callable[[Path], bool]) -> Iterator[Path]:
    """:func:`workdir_checked` for the ``with`` block. When the block raises, the workdir did
    not exist before and ``recorded(workdir)`` is false -- the run recorded nothing worth
    keeping there (its caller's test: a metrics line, a checkpoint) -- the directories made for
    it are removed again, with the by-products of its start (its config files, lock, empty
    logs): a command that fails before its first step leaves no trace. Nothing else is ever
    removed: a parent made for it must hold nothing but the way to the workdir."""
    path = Path(workdir).absolute()
    made = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
    checked = workdir_checked(workdir)
    try:
        yield checked
    except BaseException:
        if made is not None and not recorded(checked) and _only(made, checked):
            shutil.rmtree(made, ignore_errors=True)
        raise


def _only(top: Path, workdir: Path) -> bool:
    """Does ``top`` hold nothing but ``workdir`` and the directories on the way to it?"""
    return all(p == workdir or workdir in p.parents or (p in workdir.parents and p.is_dir())
               for p in top.rglob("*"))


#: what a training run writes in its workdir before its first step: the lock, its config, an
#: empty metrics file, the TensorBoard event file's header, the checkpoint directory
START_FILES = frozenset({"run.lock", "config.gin", "config.json", "metrics.jsonl"})
START_DIRS = frozenset({"checkpoints", "tensorboard"})


def run_recorded(workdir: Path) -> bool:
    """Does ``workdir`` hold anything but what a training run writes before its first step
    (:data:`START_FILES`, :data:`START_DIRS`, an empty ``metrics.jsonl``, TensorBoard's event
    files)? Anything else -- a metrics line, a checkpoint, a file of a custom checkpoint
    directory or of a logger -- is worth keeping."""
    for path in workdir.rglob("*"):
        rel = path.relative_to(workdir)
        if path.is_symlink():
            return True
        if path.is_dir():
            if rel.as_posix() not in START_DIRS or (rel.name == "checkpoints"
                                                    and any(path.iterdir())):
                return True
        elif rel.parts[0] == "tensorboard":
            if len(rel.parts) != 2 or not rel.name.startswith("events.out.tfevents"):
                return True
        elif rel.as_posix() not in START_FILES or (
                rel.name == "metrics.jsonl" and path.stat().st_size > 0):
            return True
    return False
