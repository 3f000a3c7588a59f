"""The run's workdir, checked before anything is written: a local directory (a URL is
refused: buckets take the checkpoints, ``--checkpoint_dir``), created if needed, writable; and
removed again when the run that created it fails before writing anything in it
(:func:`prepared`)."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Collection, Iterator
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
def prepared(workdir: str | Path, disposable: Collection[str] = ()) -> Iterator[Path]:
    """:func:`workdir_checked` for the ``with`` block. When the block raises and the workdir
    did not exist before, the directories made for it are removed again if they hold nothing
    but empty files named in ``disposable`` (the run's lock) and empty directories: a command
    that fails before it writes leaves no trace (a run that wrote its metrics or a checkpoint
    keeps them)."""
    path = Path(workdir).absolute()
    made = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
    checked = workdir_checked(workdir)
    try:
        yield checked
    except BaseException:
        if made is not None and _untouched(made, disposable):
            shutil.rmtree(made, ignore_errors=True)
        raise


def _untouched(top: Path, disposable: Collection[str]) -> bool:
    """Does ``top`` hold only empty directories and empty files named in ``disposable``?"""
    for path in top.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            continue
        if path.name not in disposable or path.is_symlink() or path.stat().st_size:
            return False
    return True
