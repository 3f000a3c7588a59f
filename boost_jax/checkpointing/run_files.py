"""The run's small files beside its checkpoints on an object store, so that a run restarted on
another machine (an empty local workdir, the same ``--checkpoint_dir``) keeps its history.

The workdir stays local: ``metrics.jsonl`` is appended line by line there, TensorBoard's
events and the logs are written there. When the checkpoints are on an object store
(``s3://``, ``gs://``; checkpointing/storage.py), process 0 also copies the run's small files --
``config.gin``, ``config.json``, ``metrics.jsonl`` and ``wandb_run_id`` when there is one --
to ``<checkpoint_dir>/run/`` (a name that is no step: checkpoint listing, clean-up and
quarantine never take it for one): when training starts, after each checkpoint save (only
the files changed since the last copy) and at the end of the run.

At start, before the metrics are opened, a workdir without ``metrics.jsonl`` gets the
bucket's copy (and ``wandb_run_id``, so the W&B run continues): the goodput account and the
rewind of the metrics to the checkpoint resumed from (operations/goodput.py, train/metrics.py) then
see the run's whole history, and no step is logged twice. A workdir whose ``metrics.jsonl``
ends at an earlier step than the bucket's (a stale workdir of a machine the run left) gets the
bucket's copy too; its own is kept as ``metrics.stale-<step>.jsonl``. A local copy that ends
later (the bucket's lags by at most one checkpoint interval after a kill) is kept.

A copy that fails (the store unreachable) is a warning, never the run's end: the checkpoints
are what a resume needs; the next save tries again. When the bucket's copy cannot be read at
start (after :data:`FETCH_DELAYS_S` retries), nothing is written over it by this process, and
every save says so again, as does the run's last line (:attr:`RunFiles.problem`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from absl import logging
from etils import epath

from boost_jax.checkpointing import storage
from boost_jax.operations.disk_errors import writing
from boost_jax.operations.goodput import read_history

RUN_DIR = "run"  #: the folder, in the checkpoint directory, that holds the copies
METRICS = "metrics.jsonl"
RUN_ID_FILE = "wandb_run_id"  #: the W&B run's id (train/wandb_logger.py)
MIRRORED = ("config.gin", "config.json", METRICS, RUN_ID_FILE)  #: copied to the bucket
#: the waits before reading the bucket's copy again at start (a store's brief outage)
FETCH_DELAYS_S = (0.5, 2.0)


def remote_dir(checkpoint_dir: str | os.PathLike) -> epath.Path | None:
    """``<checkpoint_dir>/run`` when the checkpoints are on an object store, else None."""
    return (epath.Path(checkpoint_dir) / RUN_DIR if storage.on_object_store(checkpoint_dir)
            else None)


def _last_step(path: Path | epath.Path) -> int:
    rows = read_history(path)
    return max((r["step"] for r in rows), default=-1)


class RunFiles:
    """The copies of ``workdir``'s small files under ``<checkpoint_dir>/run/``; a no-op when
    the checkpoints are local or ``enabled`` is false (processes other than 0)."""

    def __init__(self, workdir: Path, checkpoint_dir: str | os.PathLike, enabled: bool = True):
        self.workdir = Path(workdir)
        self.remote = remote_dir(checkpoint_dir) if enabled else None
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime) last copied
        #: why the copies are not (all) on the bucket now, in words; None when they are
        self.problem: str | None = None
        self._unread: epath.Path | None = None  # the bucket's copy, when it could not be read

    def fetch(self) -> list[str]:
        """Copy ``metrics.jsonl`` (and ``wandb_run_id``) down where the workdir lacks them
        or its metrics end earlier than the bucket's; the names copied. A read error is
        retried (:data:`FETCH_DELAYS_S`); if it persists, the copies stop for this process
        (``remote`` None), the bucket's left as they are, and :meth:`upload` says so at every
        save."""
        if self.remote is None:
            return []
        for delay in (*FETCH_DELAYS_S, None):
            try:  # only the bucket's reads are retried: a local error is the run's own
                copies = self._read_remote()
                break
            except Exception as err:  # fsspec and the stores' clients raise many types
                if delay is not None:
                    time.sleep(delay)
                    continue
                self.problem = (f"could not read the run's files in {self.remote} "
                                f"({_one_line(err)}; {len(FETCH_DELAYS_S) + 1} tries): they "
                                "are left as they are and not updated by this run (its "
                                "checkpoints are saved as usual)")
                logging.warning("%s", self.problem)
                self._unread, self.remote = self.remote, None
                return []
        return self._apply(copies)

    def _read_remote(self) -> dict[str, bytes]:
        """The bucket's ``metrics.jsonl``, and its ``wandb_run_id`` when the workdir lacks
        one, as bytes (the names it holds)."""
        copies = {}
        if (self.remote / METRICS).exists():
            copies[METRICS] = (self.remote / METRICS).read_bytes()
        if not (self.workdir / RUN_ID_FILE).exists() and (self.remote / RUN_ID_FILE).exists():
            copies[RUN_ID_FILE] = (self.remote / RUN_ID_FILE).read_bytes()
        return copies

    def _apply(self, copies: dict[str, bytes]) -> list[str]:
        """The bucket's ``copies`` into the workdir where they are newer (a local write that
        fails is a :class:`~boost_jax.operations.disk_errors.WriteError`, one line)."""
        fetched = []
        local = self.workdir / METRICS
        if METRICS in copies:
            theirs = self.workdir / f".{METRICS}.fetched"
            with writing(theirs):
                theirs.write_bytes(copies[METRICS])
                if not local.exists():
                    theirs.replace(local)
                    fetched.append(METRICS)
                elif (step := _last_step(local)) < _last_step(theirs):
                    local.replace(local.with_name(f"metrics.stale-{step}.jsonl"))
                    theirs.replace(local)
                    fetched.append(METRICS)
                else:
                    theirs.unlink()
        if RUN_ID_FILE in copies:
            with writing(self.workdir / RUN_ID_FILE):
                (self.workdir / RUN_ID_FILE).write_bytes(copies[RUN_ID_FILE])
            fetched.append(RUN_ID_FILE)
        if fetched:
            logging.info("the run's %s copied from %s to %s", " and ".join(fetched),
                         self.remote, self.workdir)
        return fetched

    def upload(self) -> list[str]:
        """Copy the files changed since the last copy to the bucket; the names copied. A
        failure is a warning (the next call tries again)."""
        if self._unread is not None:
            logging.warning("%s", self.problem)
        if self.remote is None:
            return []
        sent, failed = [], []
        for name in MIRRORED:
            path = self.workdir / name
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            key = (stat.st_size, stat.st_mtime_ns)
            if self._sent.get(name) == key:
                continue
            try:
                (self.remote / name).write_bytes(path.read_bytes())
            except Exception as err:  # fsspec and the stores' clients raise many types
                logging.warning("could not copy %s to %s (%s); training goes on, the next "
                                "checkpoint tries again", name, self.remote, _one_line(err))
                failed.append(f"{name} ({_one_line(err)})")
                continue
            self._sent[name] = key
            sent.append(name)
        self.problem = (f"could not copy {', '.join(failed)} to {self.remote} at the last "
                        "try" if failed else None)
        return sent


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__
