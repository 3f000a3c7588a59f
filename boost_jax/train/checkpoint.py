"""Orbax checkpoints: the sharded train state and JSON metadata (config and data position).

Layout: ``<workdir>/checkpoints/<step>/{state, meta}``. Orbax writes each step under a
temporary name and renames it when complete, so an interrupted save never looks like a
checkpoint. The data iterator's state (how far the stream has been read) is saved in ``meta``:
it is the same on every process, so a checkpoint resumes with any process count. On restore
the newest step is tried first; a checkpoint that fails to restore is reported, moved aside to
``corrupt-<step>-<time>`` (nothing is deleted) and the next older one is used. Restoring onto a
target with other shardings (another mesh) reshards on load. Every process takes part in saving
and restoring.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging

ITEMS = ("state", "meta")


class Checkpointer:
    """Save / restore ``(state, meta)``; keeps the newest ``keep`` steps."""

    def __init__(self, directory: str | Path, keep: int, asynchronous: bool = True):
        self.directory = Path(directory).absolute()
        self.keep, self.asynchronous = keep, asynchronous
        self._open()

    def _open(self) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                               enable_async_checkpointing=self.asynchronous)
        self.mngr = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    def steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state: dict, meta: dict, wait: bool = False) -> None:
        """Save at ``step``; ``wait`` blocks until the checkpoint is on disk."""
        if step in self.mngr.all_steps():
            return
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta))
        self.mngr.save(step, args=args, force=True)
        if wait:
            self.mngr.wait_until_finished()

    def restore_latest(self, target: dict,
                       check_meta: Callable[[dict], None] = lambda meta: None
                       ) -> tuple[dict, dict] | None:
        """Restore the newest intact checkpoint into ``target`` (shapes and shardings).

        ``check_meta`` sees each candidate's metadata before any array is read and raises to
        refuse it (e.g. a checkpoint of another model): that error propagates, it does not
        mark the checkpoint as damaged. Returns ``(state, meta)``, or None when there is no
        usable checkpoint.
        """
        for step in reversed(self.steps()):
            try:
                meta = self.mngr.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore())).meta
            except Exception as err:  # orbax raises many types on damaged files
                self._quarantine(step, err)
                continue
            check_meta(meta)
            args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
            try:
                restored = self.mngr.restore(step, args=args)
            except Exception as err:  # tensorstore/orbax errors of a damaged checkpoint
                self._quarantine(step, err)
                continue
            return restored.state, meta
        return None

    def _quarantine(self, step: int, err: Exception) -> None:
        msg = " ".join(str(err).split())[:300]
        logging.warning("checkpoint %d in %s is unusable (%s: %s); moving it aside and trying "
                        "an older one", step, self.directory, type(err).__name__, msg)
        if jax.process_index() == 0:
            src = self.directory / str(step)
            if src.exists():
                src.rename(self.directory / f"corrupt-{step}-{int(time.time())}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
        self.mngr.close()
        self._open()

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()
