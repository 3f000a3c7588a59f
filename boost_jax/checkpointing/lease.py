"""One run per checkpoint bucket: a lease object, ``<checkpoint_dir>/run/lease.json``, for
checkpoints on an object store (``s3://``, ``gs://``), where no file lock reaches.

The lock of operations/workdir_lock.py covers a workdir; two jobs on different machines, each with
its own local workdir, given the same ``--checkpoint_dir=s3://...`` (a job resubmitted on other
nodes while the first still runs) would both write its steps. The lease names its holder (host,
pid, start time, a random token) and the time it was last renewed; process 0 renews it every
:data:`RENEW_S` seconds from a daemon thread and deletes it at the end of the run.

Taking it: no lease, or one not renewed for :data:`TTL_S` seconds (its holder was killed, or its
host went down), is taken (the latter with a warning naming it); one whose holder is this host's
process that no longer exists is taken at once; otherwise the starting run watches it until it
would lapse -- a live holder renews it within :data:`RENEW_S`, and the start is refused in one
line naming the holder (exit code 2); a holder that is gone lets it lapse, and it is taken over.
A run restarted after a clean stop (SIGTERM: the lease is deleted) starts at once; after a kill,
within :data:`TTL_S`. After writing its lease a run reads it back :data:`SETTLE_S` seconds later,
so that of two runs started together the one whose write came last goes on (object stores read
their own writes: S3 and GCS are strongly consistent); this is a lease, not a lock: a holder
whose renewals fail for :data:`TTL_S` (the store unreachable) can lose it, and says so in an
error line when it next reaches the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from absl import logging
from etils import epath

from boost_jax.checkpointing import storage
from boost_jax.checkpointing.run_files import RUN_DIR
from boost_jax.operations.workdir_lock import WorkdirBusy, holder, lead_holds

LEASE = "lease.json"
TTL_S = 120.0  #: a lease not renewed for this long is stale (its holder is gone)
RENEW_S = 30.0  #: how often the holder renews it (a quarter of the TTL: three renewals may fail)
SETTLE_S = 2.0  #: how long a new holder waits before it reads its lease back
#: a read of the lease that meets its holder rewriting it -- S3's ``If-Match`` on the ETag the
#: read started with fails (s3fs ``FileExpired``), the GCS emulator serves a half-written object
#: -- is tried again, this many times, this far apart: the next read shows the renewal
READ_TRIES, READ_RETRY_S = 5, 0.05


class CheckpointDirBusy(WorkdirBusy):
    """Another live run holds the checkpoint directory's lease (exit code 2)."""


def _describe(lease: dict, now: float) -> str:
    return (f"pid {lease.get('pid')} on host {lease.get('host')} since {lease.get('started')}, "
            f"renewed {max(now - float(lease.get('renewed', 0)), 0):.0f} s ago")


def _gone_here(lease: dict) -> bool:
    """Whether the holder is a process of this host that no longer exists."""
    if lease.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, TypeError, ValueError):
        return False
    return False


class Lease:
    """The lease on ``directory`` (an object store's URL, or any epath for tests) for a
    ``with`` block; the timings and clock can be changed for tests."""

    def __init__(self, directory: str | os.PathLike, ttl_s: float = TTL_S,
                 renew_s: float = RENEW_S, settle_s: float = SETTLE_S,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.path = epath.Path(directory) / RUN_DIR / LEASE
        self.ttl_s, self.renew_s, self.settle_s = ttl_s, renew_s, settle_s
        self.clock, self.sleep = clock, sleep
        self.mine = {**holder(), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        """The lease, or None when there is none (or it stays unreadable JSON: taken as none,
        as before). A read that fails while the holder rewrites the object is tried again
        (:data:`READ_TRIES`); a store error that persists is raised."""
        for attempt in range(READ_TRIES):
            last = attempt == READ_TRIES - 1
            try:
                lease = json.loads(self.path.read_text())
            except FileNotFoundError:
                return None
            except ValueError:
                if last:
                    return None
            except OSError:
                if last:
                    raise
            else:
                return lease if isinstance(lease, dict) else None
            self.sleep(READ_RETRY_S)
        return None

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({**self.mine, "renewed": self.clock()}))

    def _busy(self, lease: dict) -> CheckpointDirBusy:
        return CheckpointDirBusy(
            f"--checkpoint_dir={self.path.parent.parent} is in use by another run: "
            f"{_describe(lease, self.clock())} ({self.path}); one run per checkpoint directory: "
            "wait for it to end or stop it, or choose another --checkpoint_dir")

    def _wait_for(self, lease: dict) -> None:
        """Watch another holder's lease until it lapses (returns) or is renewed (raises)."""
        if _gone_here(lease):
            return
        lapses = float(lease.get("renewed", 0)) + self.ttl_s
        if self.clock() < lapses:
            logging.warning("%s is held by %s; waiting up to %.0f s for it to lapse (its holder "
                            "renews it every %.0f s while it runs)", self.path,
                            _describe(lease, self.clock()), lapses - self.clock(), self.renew_s)
        while self.clock() < lapses:
            self.sleep(min(self.renew_s / 3, max(lapses - self.clock(), 0.01)))
            now = self._read()
            if now is None:
                return
            if (now.get("token"), now.get("renewed")) != (lease.get("token"),
                                                          lease.get("renewed")):
                raise self._busy(now)

    def __enter__(self) -> Lease:
        other = self._read()
        if other is not None:
            self._wait_for(other)
            logging.warning("%s: took over the lease of a run that ended without releasing it "
                            "(%s)", self.path, _describe(other, self.clock()))
        self._write()
        self.sleep(self.settle_s)
        now = self._read()
        if now is None or now.get("token") != self.mine["token"]:
            raise self._busy(now or {})
        self._thread = threading.Thread(target=self._renew, name="checkpoint-lease",
                                        daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                now = self._read()
                if now is not None and now.get("token") != self.mine["token"]:
                    logging.error("%s was taken over by %s (this run could not renew it for "
                                  "%.0f s): two runs may now write these checkpoints", self.path,
                                  _describe(now, self.clock()), self.ttl_s)
                    return
                self._write()
            except Exception as err:  # noqa: BLE001 -- the store's clients raise many types
                logging.warning("could not renew %s (%s); trying again in %.0f s", self.path,
                                " ".join(str(err).split())[:200], self.renew_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(Exception):  # a lease left behind lapses in TTL_S
            if (self._read() or {}).get("token") == self.mine["token"]:
                self.path.unlink()


def held(directory: str | os.PathLike) -> contextlib.AbstractContextManager:
    """The lease of ``directory`` for a ``with`` block when it is on an object store (taken by
    process 0, the outcome agreed by every process: operations/workdir_lock.py ``lead_holds``);
    nothing for a local directory."""
    if not storage.on_object_store(directory):
        return contextlib.nullcontext()
    return lead_holds(lambda: Lease(storage.checkpoint_path(directory)),
                      f"--checkpoint_dir={directory}: process 0 could not take its lease (its "
                      "log says why)")
