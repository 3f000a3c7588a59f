"""Orbax checkpoints: the sharded train state (Zarr v3, every chunk checksummed) and JSON
metadata (config, data position).

Layout: ``<workdir>/checkpoints/<step>/{state, meta}``; the directory may also be an object
store's (``s3://bucket/run``, ``gs://bucket/run``: :mod:`boost_jax.checkpointing.storage`, through
which every file operation here goes, as orbax's own go through epath). Orbax writes each step
under a temporary name and renames it when complete (on an object store: in place, committed
by orbax's marker file), so an interrupted save never looks like a checkpoint; saves left
unfinished by a killed run are removed at start. The data position of every process is saved
in ``meta`` (train/data_state.py). Restoring onto a target with other shardings (another mesh)
reshards on load. Whether a step is already saved is decided once for all processes (process
0's listing).

Restore tries the newest step first, in order: its metadata parses; its config fits this run
(``check_meta``, train/resume.py); its state's tree (names, shapes, dtypes, read from orbax's
tree metadata without reading an array) is this run's; the arrays read with every chunk's
checksum intact; every value is finite and the state is of that step
(:mod:`boost_jax.checkpointing.integrity`). What goes wrong is one of three kinds:

- **damage, proven** -- a checksum or decode failure, a file still missing after the retries,
  a non-finite value, another step's state: the checkpoint is reported in one line, moved aside
  to ``corrupt-<step>-<time>`` (nothing is deleted; on an object store each object is moved,
  the commit marker last: :func:`~boost_jax.checkpointing.storage.move_aside`) and the next older
  step is tried;
- **a mismatch** -- a config field that must match, or a state tree that is not this run's (an
  optimizer switched, an optax upgrade): :class:`ResumeMismatch` (train/resume.py's checks), one
  line naming what differs; nothing is read further, moved or written;
- **anything else** (an I/O error, an error of unknown kind): retried ``READ_ATTEMPTS`` times
  with a growing pause, logged; still failing, the step's files are compared with the sizes
  recorded when it was saved (:data:`SIZES`): another size is damage (above), the same sizes a
  :class:`CheckpointReadError`, one line; the checkpoint is left where it is.

Every process takes each decision together (an all-gather of the worst outcome), so damage
that one host sees is damage everywhere and a retry is a retry everywhere. A save that fails (a
full disk, any ``OSError``) raises :class:`CheckpointWriteError` with one line; older
checkpoints stay as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from boost_jax.checkpointing import read_failures, storage
from boost_jax.checkpointing.integrity import STATE_FORMAT, ChunkChecksums, verify
from boost_jax.checkpointing.read_failures import Failure, ResumeMismatch
from boost_jax.parallel import distributed

ITEMS = ("state", "meta")
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a step still being written
READ_ATTEMPTS = 4  # reads of a checkpoint item before an error that is not damage is reported
#: in a committed step's directory: the size of each of its files when it was saved, the record
#: a read that keeps failing is checked against (a file of another size is damage)
SIZES = "file_sizes.json"
RETRY_DELAY_S = 1.0  # the pause before the first retry; doubled before each next one


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the message is one line)."""


class CheckpointReadError(RuntimeError):
    """A checkpoint could not be read for a reason that is not proven damage (an I/O error
    that outlasted the retries): it is left in place (the message is one line)."""


@dataclasses.dataclass
class Restored:
    state: dict
    meta: dict
    step: int


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

    def __init__(self, directory: str | os.PathLike, keep: int, asynchronous: bool = True):
        """``directory``: a local path or an ``s3://`` / ``gs://`` URL
        (:func:`~boost_jax.checkpointing.storage.checkpoint_path`; raises ConfigError for another
        scheme or a missing package)."""
        self.directory = storage.checkpoint_path(directory)
        self.keep, self.asynchronous = keep, asynchronous
        self.quarantined: list[epath.Path] = []  # moved aside by this process's restore
        self._saved: list[int] = []  # saved by this checkpointer, their sizes not yet recorded
        self._bytes, self._abandoned = 0, False
        self._checksums = ChunkChecksums(self.directory)  # the arrays written under it
        if jax.process_index() == 0:
            self._remove_temporaries()
        self._open()

    def _open(self) -> None:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, create=True, enable_async_checkpointing=self.asynchronous,
            atomicity_options=storage.atomicity(self.directory))
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_zarr3=True),
                    "meta": ocp.JsonCheckpointHandler()}
        self.mngr = ocp.CheckpointManager(self.directory, item_handlers=handlers,
                                          options=options)

    def _remove_temporaries(self) -> None:
        """Saves that never completed (a run killed while writing) were never checkpoints."""
        stale = storage.unfinished_saves(self.directory, TMP_MARK)
        for path in stale:
            storage.remove(path)
        if stale:
            logging.warning("removed %d unfinished checkpoint save(s) of an earlier run: %s",
                         len(stale), ", ".join(p.name for p in stale))

    def steps(self) -> list[int]:
        """The committed steps, oldest first (process 0's listing, on every process)."""
        return distributed.lead_values(sorted(self.mngr.all_steps()))

    # --- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: dict, meta: dict, wait: bool = False) -> None:
        """Save at ``step``; ``wait`` blocks until the checkpoint is on disk. Raises
        :class:`CheckpointWriteError`."""
        if step in self.steps():  # one decision for every process (listings may lag)
            return
        self._bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                  meta=ocp.args.JsonSave({**meta, "state_format": STATE_FORMAT}))
        self._checksums.arm()  # this save's decision (integrity.chunk_checksums_off)
        try:
            self.mngr.save(step, args=args, force=True)
            self._saved.append(step)
            if wait:
                self.mngr.wait_until_finished()
        except Exception as err:  # a failed background write surfaces here too
            raise self._abandon(err) from err
        self._record_sizes()

    def _record_sizes(self) -> None:
        """Process 0 writes :data:`SIZES` into each step this checkpointer saved once the step
        is committed (an asynchronous save: at a later save or :meth:`wait`)."""
        committed = set(self.mngr.all_steps())
        for step in [s for s in self._saved if s in committed]:
            self._saved.remove(step)
            if jax.process_index() == 0:
                path = self.directory / str(step)
                try:
                    (path / SIZES).write_text(json.dumps(storage.file_sizes(path)))
                except FileNotFoundError:  # already removed (Train.keep_checkpoints)
                    pass

    def _sizes_differ(self, step: int) -> str | None:
        """How step ``step``'s files differ from the sizes recorded when it was saved (None
        when they do not, or nothing was recorded: written by an older version)."""
        path = self.directory / str(step)
        try:
            recorded = json.loads((path / SIZES).read_text())
        except (OSError, ValueError):
            return None
        now = storage.file_sizes(path)
        for name, size in sorted(recorded.items()):
            if now.get(name) != size:
                found = f"{now[name]:,} bytes" if name in now else "missing"
                return f"{name} is {found}, {size:,} bytes when it was saved"
        return None

    def _write_error(self, err: Exception) -> Exception:
        os_err = read_failures.os_error(err)
        if os_err is None:
            return err
        where = os_err.filename or self.directory
        free = storage.free_bytes(self.directory)
        need = f"; a checkpoint takes about {self._bytes / 2**20:,.0f} MiB" if self._bytes else ""
        have = f", {free / 2**20:,.0f} MiB are free there" if free is not None else ""
        return CheckpointWriteError(
            f"could not write a checkpoint to {where}: {os_err.strerror or os_err}{need}{have}; "
            f"the older checkpoints in {self.directory} are intact")

    def _abandon(self, err: Exception) -> Exception:
        """After a failed save: close the manager quietly; the error to raise."""
        self._abandoned = True
        with _pending_reads_dropped():
            try:
                self.mngr.close()
            except Exception:  # the same failure again
                pass
        return self._write_error(err)

    def check(self) -> None:
        """Raise :class:`CheckpointWriteError` when a background save has failed (a look that
        does not wait for one in flight): called after every step, so that a failure (a full
        disk) is reported at the next step, not at the next save or the end."""
        if self.mngr.is_saving_in_progress():
            return
        self.wait()  # nothing in flight: returns at once, or raises the failed save's error

    def wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as err:
            raise self._abandon(err) from err
        self._record_sizes()

    def close(self) -> None:
        """Wait for the saves in flight and close (after a failed save: only release)."""
        try:
            if not self._abandoned:
                self.wait()  # on a failed write, closes the manager and raises
                self.mngr.close()
        finally:
            self._checksums.release()

    # --- restoring ------------------------------------------------------------------------
    def restore_latest(self, target: dict,
                       check_meta: Callable[[dict], None] = lambda meta: None
                       ) -> Restored | None:
        """Restore the newest intact checkpoint into ``target`` (shapes and shardings).

        ``check_meta`` sees each candidate's metadata before anything else is read and raises
        to refuse it (:class:`ResumeMismatch`): that error propagates,
        like a state tree that is not ``target``'s. Raises :class:`CheckpointReadError` for a
        read that keeps failing without proven damage. Returns None when no checkpoint is left;
        the ones moved aside are in :attr:`quarantined`.
        """
        for step in reversed(self.steps()):
            restored, why = self._restore_step(step, target, check_meta)
            if why is None:
                return restored
            self._quarantine(step, why)
        return None

    def _restore_step(self, step: int, target: dict, check_meta: Callable[[dict], None]
                      ) -> tuple[Restored | None, str | None]:
        """Checkpoint ``step`` restored, or ``(None, why it is damaged)``; raises on a
        mismatch or a read that keeps failing (:meth:`restore_latest`)."""
        path = self.directory / str(step)
        meta, why = self._read(step, "metadata", lambda: _restore_item(
            ocp.JsonCheckpointHandler(), path / "meta", ocp.args.JsonRestore()))
        if why is not None:
            return None, why
        check_meta(meta)
        tree, why = self._read(step, "tree metadata", lambda: _tree_metadata(path / "state"))
        if why is not None:
            return None, why
        _check_tree(step, tree, target)
        state, why = self._read(step, "arrays", lambda: _restore_item(
            ocp.StandardCheckpointHandler(), path / "state", ocp.args.StandardRestore(target)))
        why = why or verify(state, step)  # one global reduction
        if why is not None:
            return None, why
        if meta.get("state_format") != STATE_FORMAT:
            logging.warning("checkpoint %d has no chunk checksums (written by an older "
                            "version): its bytes were not verified", step)
        return Restored(state, meta, step), None

    def _read(self, step: int, what: str, read: Callable[[], object]
              ) -> tuple[object, str | None]:
        """``read()`` of one item of checkpoint ``step``, decided together by every process:
        ``(value, None)`` when it worked everywhere, ``(None, why)`` on proven damage; other
        failures are retried (:data:`READ_ATTEMPTS`, pauses from :data:`RETRY_DELAY_S`, a
        warning each), then raise :class:`CheckpointReadError`."""
        for attempt in range(1, READ_ATTEMPTS + 1):
            value, why, kind = None, None, Failure.NONE
            with _pending_reads_dropped():
                try:
                    value = read()
                except Exception as err:  # orbax/tensorstore raise many types
                    why, kind = read_failures.one_line(err), read_failures.classify(err)
            worst = Failure(distributed.max_value(kind))
            why = why or "unreadable on another process"
            if worst == Failure.NONE:
                return value, None
            if worst == Failure.DAMAGED:
                return None, why
            if attempt == READ_ATTEMPTS:
                break
            delay = RETRY_DELAY_S * 2 ** (attempt - 1)
            logging.warning("reading checkpoint %d's %s failed (%s); retrying in %.0f s "
                            "(attempt %d of %d)", step, what, why, delay, attempt, READ_ATTEMPTS)
            time.sleep(delay)
        if worst == Failure.MISSING:  # still missing after every retry: it is not there
            return None, why
        # damage only if proven: a file whose size is not the one recorded at save (process 0's
        # check, one decision for every process)
        differs = self._sizes_differ(step) if jax.process_index() == 0 else None
        if distributed.lead_values([int(differs is not None)])[0]:
            return None, (f"its files are not those saved: {differs}" if differs else
                          "its files are not those saved (process 0's check)")
        raise CheckpointReadError(
            f"could not read checkpoint {step}'s {what} in {self.directory} after "
            f"{READ_ATTEMPTS} attempts ({why}); it is left in place, not moved: rerun when the "
            "storage is back")

    def _quarantine(self, step: int, why: str) -> None:
        """Move ``step`` aside on process 0 once every process has given it up."""
        stamp = distributed.lead_values([int(time.time())])[0]  # one name on every process
        dest = self.directory / f"corrupt-{step}-{stamp}"
        logging.warning("checkpoint %d is damaged (%s): moved aside to %s; trying an older "
                        "one", step, why, dest.name)
        if jax.process_index() == 0:
            src = self.directory / str(step)
            if src.exists():
                storage.move_aside(src, dest)
        distributed.barrier(f"quarantine checkpoint {step}")
        self.quarantined.append(dest)
        self.mngr.reload()


def _restore_item(handler, path: epath.Path, args) -> object:
    """One item read with its own handler (no barrier inside, so a process whose read fails
    reaches the agreement like the others); its pending reads finish before it is dropped."""
    try:
        return handler.restore(path, args=args)
    finally:
        handler.close()


def _tree_metadata(path: epath.Path) -> dict:
    """``{array name: (shape, dtype)}`` of a saved state, from orbax's tree metadata (no
    array is read)."""
    tree = ocp.StandardCheckpointHandler().metadata(path).tree
    return {_name(p): (tuple(m.shape), np.dtype(m.dtype))
            for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _name(path) -> str:
    """A tree path as orbax names a saved array (``opt_state.0.mu.embed``)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _check_tree(step: int, saved: dict, target: dict) -> None:
    """Raise :class:`ResumeMismatch` when checkpoint ``step``'s arrays (``saved``, from
    :func:`_tree_metadata`) are not ``target``'s: names, shapes and dtypes."""
    wanted = {_name(p): (tuple(x.shape), np.dtype(x.dtype))
              for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    diffs = [f"{k} is in the checkpoint, not in this run's state" for k in saved
             if k not in wanted]
    diffs += [f"{k} is in this run's state, not in the checkpoint" for k in wanted
              if k not in saved]
    diffs += [f"{k} is {saved[k][1]}{list(saved[k][0])} there, {wanted[k][1]}"
              f"{list(wanted[k][0])} here" for k in wanted if k in saved and saved[k] != wanted[k]]
    if diffs:
        more = f" ({len(diffs)} differences in all)" if len(diffs) > 1 else ""
        raise ResumeMismatch(
            f"checkpoint {step}'s state does not fit this run's: {sorted(diffs)[0]}{more}; it "
            "was written by another configuration or another version of the libraries (e.g. "
            "an optax upgrade that changed the optimizer state); nothing was moved: resume it "
            "with what wrote it, or use a new --workdir")
