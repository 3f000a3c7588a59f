"""Orbax checkpoints: the sharded train state (Zarr v3, every chunk checksummed) and JSON
metadata (config, data position).

Layout: ``<workdir>/checkpoints/<step>/{state, meta}``. Orbax writes each step under a
temporary name and renames it when complete, so an interrupted save never looks like a
checkpoint; temporaries left by a killed run are removed at start. The data iterator's state
(how far the stream has been read) is saved in ``meta``: it is the same on every process, so a
checkpoint resumes with any process count. Restoring onto a target with other shardings
(another mesh) reshards on load.

Restore tries the newest step first and verifies it: the metadata parses, the arrays read with
every chunk's checksum intact, every value is finite and the state is of that step
(:mod:`boost_jax.train.integrity`). Every process takes each of these decisions together (an
all-gather of "did it work here"), so damage that one host sees is damage everywhere: the
checkpoint is reported in one line, moved aside to ``corrupt-<step>-<time>`` (nothing is
deleted) and the same older step is tried on every process. A save that fails (a full disk,
any ``OSError``) raises :class:`CheckpointWriteError` with one line; older checkpoints stay as
they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging

from boost_jax.parallel import distributed
from boost_jax.train.integrity import STATE_FORMAT, install_chunk_checksums, verify

ITEMS = ("state", "meta")
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a step still being written


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the message is one line)."""


@dataclasses.dataclass
class Restored:
    state: dict
    meta: dict
    step: int


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes, outermost first."""
    chain = []
    while err is not None and all(err is not e for e in chain):
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _one_line(err: BaseException, limit: int = 300) -> str:
    """The root cause of ``err`` (TensorStore's own message, e.g. "DATA_LOSS: ... Digest
    mismatch", lies under orbax's "Encountered error while reading ...") on one line."""
    root = _chain(err)[-1]
    text = str(root).split("See full TensorStore details")[0]  # then a page of JSON spec
    return f"{type(root).__name__}: {' '.join(text.split())[:limit]}"


def _os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err`` (itself, or along its causes), if any."""
    return next((e for e in _chain(err) if isinstance(e, OSError)), None)


@contextlib.contextmanager
def _pending_reads_dropped():
    """When one read of a damaged checkpoint (or a write) fails, orbax abandons its other
    pending operations; those fail too when they are collected, or call back into an event loop
    already closed, and would each print a traceback ("Exception ignored in: <coroutine ...>",
    "Event loop is closed"). They are collected here and their errors -- the same failure,
    reported once by the caller -- dropped; any other unraisable error is printed as usual."""
    default = getattr(sys.unraisablehook, "default", sys.unraisablehook)

    def hook(unraisable) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        ours = code is not None and any(k in code.co_filename for k in ("orbax", "tensorstore"))
        if not (ours or _late_callback(unraisable)):
            default(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        gc.collect()
        # reads that finish later still call back into orbax's closed event loop
        sys.unraisablehook = _LateCallbacksDropped(default)


def _late_callback(unraisable) -> bool:
    """"Event loop is closed", raised by a late TensorStore callback into orbax's finished
    event loop."""
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None and tb.tb_frame.f_code.co_name == "_check_closed")


class _LateCallbacksDropped:
    """The unraisable hook after an abandoned read: drops only :func:`_late_callback`s."""

    def __init__(self, default):
        self.default = default

    def __call__(self, unraisable) -> None:
        if not _late_callback(unraisable):
            self.default(unraisable)


class Checkpointer:
    """Save / restore ``(state, meta)``; keeps the newest ``keep`` steps."""

    def __init__(self, directory: str | Path, keep: int, asynchronous: bool = True):
        self.directory = Path(directory).absolute()
        self.keep, self.asynchronous = keep, asynchronous
        self.quarantined: list[Path] = []  # moved aside by this process's restore
        self._bytes = 0
        install_chunk_checksums()
        if jax.process_index() == 0:
            self._remove_temporaries()
        self._open()

    def _open(self) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                               enable_async_checkpointing=self.asynchronous)
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_zarr3=True),
                    "meta": ocp.JsonCheckpointHandler()}
        self.mngr = ocp.CheckpointManager(self.directory, item_handlers=handlers,
                                          options=options)

    def _remove_temporaries(self) -> None:
        """Saves that never completed (a run killed while writing) were never checkpoints."""
        stale = sorted(self.directory.glob(f"*{TMP_MARK}*")) if self.directory.exists() else []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            logging.info("removed %d unfinished checkpoint save(s) of an earlier run: %s",
                         len(stale), ", ".join(p.name for p in stale))

    def steps(self) -> list[int]:
        """The committed steps, oldest first (process 0's listing, on every process)."""
        return distributed.lead_values(sorted(self.mngr.all_steps()))

    # --- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: dict, meta: dict, wait: bool = False) -> None:
        """Save at ``step``; ``wait`` blocks until the checkpoint is on disk. Raises
        :class:`CheckpointWriteError`."""
        if step in self.mngr.all_steps():
            return
        self._bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                  meta=ocp.args.JsonSave({**meta, "state_format": STATE_FORMAT}))
        try:
            self.mngr.save(step, args=args, force=True)
            if wait:
                self.mngr.wait_until_finished()
        except Exception as err:  # a failed background write surfaces here too
            raise self._abandon(err) from err

    def _write_error(self, err: Exception) -> Exception:
        os_err = _os_error(err)
        if os_err is None:
            return err
        where = os_err.filename or self.directory
        free = shutil.disk_usage(self.directory).free if self.directory.exists() else None
        need = f"; a checkpoint takes about {self._bytes / 2**20:,.0f} MiB" if self._bytes else ""
        have = f", {free / 2**20:,.0f} MiB are free there" if free is not None else ""
        return CheckpointWriteError(
            f"could not write a checkpoint to {where}: {os_err.strerror or os_err}{need}{have}; "
            f"the older checkpoints in {self.directory} are intact")

    def _abandon(self, err: Exception) -> Exception:
        """After a failed save: close the manager quietly; the error to raise."""
        with _pending_reads_dropped():
            try:
                self.mngr.close()
            except Exception:  # the same failure again
                pass
        return self._write_error(err)

    def wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as err:
            raise self._abandon(err) from err

    def close(self) -> None:
        self.wait()  # on a failed write, closes the manager and raises
        self.mngr.close()

    # --- restoring ------------------------------------------------------------------------
    def restore_latest(self, target: dict,
                       check_meta: Callable[[dict], None] = lambda meta: None
                       ) -> Restored | None:
        """Restore the newest intact checkpoint into ``target`` (shapes and shardings).

        ``check_meta`` sees each candidate's metadata before any array is read and raises to
        refuse it (e.g. a checkpoint of another model): that error propagates, it does not
        mark the checkpoint as damaged. Returns None when no checkpoint is usable; the ones
        moved aside are in :attr:`quarantined`.
        """
        for step in reversed(self.steps()):
            path = self.directory / str(step)
            meta, why = self._read(ocp.JsonCheckpointHandler(), path / "meta",
                                   ocp.args.JsonRestore())
            if why is None:
                check_meta(meta)
                state, why = self._read(ocp.StandardCheckpointHandler(), path / "state",
                                        ocp.args.StandardRestore(target))
            if why is None:
                why = verify(state, step)  # one global reduction
                if why is None and meta.get("state_format") != STATE_FORMAT:
                    logging.warning("checkpoint %d has no chunk checksums (written by an older "
                                    "version): its bytes were not verified", step)
            if why is None:
                return Restored(state, meta, step)
            self._quarantine(step, why)
        return None

    @staticmethod
    def _read(handler, path: Path, args) -> tuple[object, str | None]:
        """One item read with its own handler: ``(value, None)`` when the read worked on every
        process, else ``(None, why)``. The handler has no barrier inside, so a process whose
        read fails reaches the agreement like the others, and it finishes its pending reads
        before it is dropped."""
        value, why = None, None
        with _pending_reads_dropped():
            try:
                value = handler.restore(path, args=args)
            except Exception as err:  # orbax/tensorstore raise many types on damaged files
                why = _one_line(err)
            finally:
                handler.close()
        if not distributed.all_true(why is None):
            return None, why or "unreadable on another process"
        return value, None

    def _quarantine(self, step: int, why: str) -> None:
        """Move ``step`` aside on process 0 once every process has given it up."""
        stamp = distributed.lead_values([int(time.time())])[0]  # one name on every process
        dest = self.directory / f"corrupt-{step}-{stamp}"
        logging.warning("checkpoint %d is damaged (%s): moved aside to %s; trying an older "
                        "one", step, why, dest.name)
        if jax.process_index() == 0:
            src = self.directory / str(step)
            if src.exists():
                src.rename(dest)
        distributed.barrier(f"quarantine checkpoint {step}")
        self.quarantined.append(dest)
        self.mngr.reload()
