"""Resuming a ``prepare`` run (data/prepare.py): what an unfinished run left in its work
directory ``.<output>.partial``.

Its arguments (``args.json``, written first: a rerun with other arguments is refused or, with
``--overwrite``, discards the work directory), its finished shards (those with a record and
files of the recorded sizes, kept) and the half-written files of the shard it was writing
(``*.tmp*``, removed). Its tokenizer is reused too (data/tokenize_chunks.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from boost_jax.data.shards import write_json

#: arguments added to ``args.json`` since format 2, with the value an older run had
ADDED_ARGS = dict(pattern=None, eval_inputs=[], eval_pattern=None)


def previous_args(work: Path) -> dict | None:
    """The arguments of the unfinished run in ``work`` (``{}`` when unreadable), or None.
    Arguments added since (``--pattern``, ``--eval_input``, ...) take their defaults."""
    if not (work / "args.json").is_file():
        return None
    try:
        return {**ADDED_ARGS, **json.loads((work / "args.json").read_text())}
    except (OSError, ValueError):
        return {}


def changed_args(before: dict, args: dict) -> str:
    """``'seed=0 there, 1 now; ...'``: how ``args`` differ from an unfinished run's."""
    changed = [f"{k}={before.get(k)!r} there, {v!r} now" for k, v in args.items()
               if before.get(k) != v]
    return "; ".join(changed) or "args.json"


def open_work_dir(work: Path, args: dict) -> Path:
    """Create (or reopen) the work directory of a run of ``args``; returns its shard
    directory."""
    shard_dir = work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    write_json(work / "args.json", args)
    return shard_dir


def remove_stale(shard_dir: Path) -> None:
    """Remove the half-written files of the shard an interrupted run was writing."""
    for stale in shard_dir.glob("*.tmp*"):
        stale.unlink()


def finished_shards(shard_dir: Path, itemsize: int) -> dict[int, dict]:
    """The shards a previous run completed: record present, files of the recorded sizes."""
    done = {}
    for rec_file in shard_dir.glob("[0-9]*.json"):
        rec = json.loads(rec_file.read_text())
        data, docs = shard_dir / rec["file"], shard_dir / rec["docs"]
        if data.is_file() and docs.is_file() and data.stat().st_size == rec["tokens"] * itemsize:
            done[int(rec_file.stem)] = rec
    return done
