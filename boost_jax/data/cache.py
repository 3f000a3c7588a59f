"""The cache that bundled corpora are prepared into on first use (data/prepare.py:
``ensure_bundled``): where it is, and the lock that lets one process of a host prepare a
dataset while the others wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path


def default_cache_dir() -> Path:
    """``$BOOST_JAX_CACHE``, else ``~/.cache/boost_jax``."""
    return Path(os.environ.get("BOOST_JAX_CACHE", Path.home() / ".cache" / "boost_jax"))


@contextlib.contextmanager
def exclusive(lock_path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``lock_path`` (waiting up to ``timeout`` seconds): the
    processes of one host never prepare the same dataset at once. The OS drops the lock
    when its holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been preparing {lock_path.stem} "
                                       f"for over {timeout:.0f} s (lock {lock_path})") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
