"""The workdir's record of the newest checkpoint its run committed, so that a restart which
finds none where one was committed stops instead of training again from step 0.

Process 0 writes ``<workdir>/last_checkpoint.json`` (``{"step": S, "directory": D}``) after
each save, naming the newest step that the checkpoint directory then lists as committed (an
asynchronous save is listed once it is finished: the record lags by at most one save). A run
killed before its first checkpoint leaves no record, and its restart trains from step 0 as
before. A restart that finds no checkpoint while the record names one (``--checkpoint_dir``
forgotten or changed, the bucket or directory emptied) is a one-line error that says where the
run's checkpoints were; ``--fresh_start`` trains from step 0 anyway, and removes the record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from boost_jax.config import ConfigError
from boost_jax.operations.disk_errors import writing

RECORD = "last_checkpoint.json"


def write(workdir: Path, committed: list[int], directory: str | os.PathLike) -> None:
    """Record the newest of the ``committed`` steps of ``directory`` (nothing when none is);
    replaced atomically, so a kill leaves the old record or the new one."""
    if not committed:
        return
    tmp = workdir / f".{RECORD}.tmp"
    with writing(workdir / RECORD):
        tmp.write_text(json.dumps({"step": max(committed), "directory": str(directory)}))
        tmp.replace(workdir / RECORD)


def refuse_a_silent_restart(workdir: Path, directory: str | os.PathLike,
                            fresh_start: bool) -> None:
    """Called when ``directory`` holds no checkpoint to resume: a :class:`ConfigError` when the
    workdir's record says the run committed one, unless ``fresh_start`` (which removes the
    record). An unreadable record (a torn write) counts as none."""
    path = workdir / RECORD
    try:
        saved = json.loads(path.read_text())
        step, where = int(saved["step"]), str(saved["directory"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if fresh_start:
        path.unlink(missing_ok=True)
        return
    raise ConfigError(f"no checkpoint in {directory}, but this workdir's run committed one at "
                      f"step {step} in {where} ({path}): resume with --checkpoint_dir={where}, "
                      "or rerun with --fresh_start to train from step 0 in this workdir")
