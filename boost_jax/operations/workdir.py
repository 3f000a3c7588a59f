"""The run's workdir, checked before anything is written: a local directory (a URL is
refused: buckets take the checkpoints, ``--checkpoint_dir``), created if needed, writable."""

from __future__ import annotations

import re
import tempfile
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
