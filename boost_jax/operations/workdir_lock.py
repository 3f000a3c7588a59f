"""One run per workdir: an exclusive lock on ``<workdir>/run.lock``, held for the run's life.

A second run started on the same workdir (a job submitted twice) is refused before it writes
anything, in one line naming the holder (host, pid, start time): exit code 2. The lock is the
kernel's (``flock``): it ends with the process that holds it, however it ends (``kill -9``, a
crashed host's NFS lease), so a stale lock never blocks a restart. The holder's name is written
into the file while the lock is held and cleared at a clean end; a lock taken over a name left
behind (the holder was killed) says so in a warning. ``fcntl`` rather than the ``filelock``
package: filelock truncates the file when it opens it, before it locks, which would erase the
holder's name that a refused run prints.

In a multi-process run, process 0 takes the lock and all processes agree on the outcome (one
all-gather), so a refusal stops every process. On a file system without ``flock`` (ENOLCK,
ENOTSUP: a Lustre mount without ``-o flock``) the run goes on unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from absl import logging

from boost_jax.config import ConfigError

LOCK = "run.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)  # no flock there


class WorkdirBusy(ConfigError):
    """Another live run holds the workdir's lock (exit code 2)."""


def _holder_text(fd: int) -> str:
    """``pid P on host H since T`` from the lock file's record; ``""`` when it holds none."""
    raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if not raw:
        return ""
    try:
        h = json.loads(raw)
        return f"pid {h['pid']} on host {h['host']} since {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "an unreadable record"


def holder() -> dict:
    """This process as a lock or lease names its holder: host, pid, start time (UTC)."""
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started}


def _record(fd: int) -> None:
    text = json.dumps(holder())
    os.ftruncate(fd, 0)
    os.pwrite(fd, (text + "\n").encode(), 0)
    os.fsync(fd)


@contextlib.contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    path = workdir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd) or "a run that is starting"
            raise WorkdirBusy(f"--workdir={workdir} is in use by another run: {holder} "
                              f"({path}); one run per workdir: wait for it to end or stop it, "
                              "or choose another --workdir") from None
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                raise
            logging.warning("%s: this file system does not lock files (%s); the run goes on "
                            "without the one-run-per-workdir lock", path, err.strerror)
            yield
            return
        if previous := _holder_text(fd):
            logging.warning("%s: took over the lock of a run that ended without releasing it "
                            "(%s: killed, or its host went down)", path, previous)
        _record(fd)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a clean end leaves no name behind; the file stays
    finally:
        os.close(fd)  # releases the lock


def held(workdir: Path) -> contextlib.AbstractContextManager:
    """Hold ``workdir``'s lock for the ``with`` block: taken by process 0, the outcome agreed by
    every process. Raises :class:`WorkdirBusy` (every process) when another run holds it."""
    return lead_holds(lambda: _locked(workdir), f"--workdir={workdir}: process 0 could not "
                      "take the workdir's lock (its log says why)")


@contextlib.contextmanager
def lead_holds(make: Callable[[], contextlib.AbstractContextManager],
               refusal: str) -> Iterator[None]:
    """Enter ``make()`` on process 0 for the ``with`` block; every process agrees on whether
    that worked (one all-gather): process 0 raises its error, the others a
    :class:`WorkdirBusy` of ``refusal``."""
    import jax

    from boost_jax.parallel.distributed import max_value

    if jax.process_count() == 1:
        with make():
            yield
        return
    with contextlib.ExitStack() as stack:
        error = None
        if jax.process_index() == 0:
            try:
                stack.enter_context(make())
            except Exception as err:  # noqa: BLE001 -- told to the others, then raised here
                error = err
        if max_value(int(error is not None)):
            raise error or WorkdirBusy(refusal)
        yield
