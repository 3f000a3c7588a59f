"""Publishing a directory atomically: it is built in ``.<out>.partial`` beside its output, then
renamed into place, so no reader ever finds it half-written.

Shared by ``python -m boost_jax.data.prepare`` (data/prepare.py) and the model export
(interop/formats.py); each names what it owns (a prepared dataset, an exported model) with a
``holds_ours`` predicate and phrases its own errors from a :class:`Refusal`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path

#: :attr:`Refusal.reason` values
FILE, FOREIGN, TAKEN, PARENT_NOT_DIR, PARENT_NOT_WRITABLE = (
    "file", "foreign", "taken", "parent_not_dir", "parent_not_writable")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why an output cannot be published to. ``reason``: :data:`FILE` (it exists and is not a
    directory), :data:`FOREIGN` (a directory holding files that are not ours), :data:`TAKEN`
    (it holds ours and replacing was not asked for), :data:`PARENT_NOT_DIR` or
    :data:`PARENT_NOT_WRITABLE` (``parent``, its nearest existing ancestor, is not a
    directory, or is one that cannot be written)."""

    reason: str
    parent: Path


def work_dir(out: Path) -> Path:
    """Where ``out`` is built until it is complete: ``.<out>.partial`` beside it."""
    return out.parent / f".{out.name}.partial"


def refusal(out: Path, holds_ours: Callable[[Path], bool], overwrite: bool) -> Refusal | None:
    """Why ``out`` cannot be published to (None when it can): an existing output is only
    replaced with ``overwrite`` and only when ``holds_ours(out)``; an empty directory is
    taken."""
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if out.exists() and not out.is_dir():
        return Refusal(FILE, ancestor)
    if out.is_dir() and any(out.iterdir()):
        if not holds_ours(out):
            return Refusal(FOREIGN, ancestor)
        if not overwrite:
            return Refusal(TAKEN, ancestor)
    if not ancestor.is_dir():
        return Refusal(PARENT_NOT_DIR, ancestor)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return Refusal(PARENT_NOT_WRITABLE, ancestor)
    return None


def publish(work: Path, out: Path, holds_ours: Callable[[Path], bool]) -> None:
    """Rename the finished ``work`` directory to ``out``. Renames only, so a reader finds the
    old output, then (after an instant without one) the new one, never a part of either. An
    output being replaced (``holds_ours``) goes to ``.<out>.old`` first and is deleted last;
    any other existing ``out`` must be an empty directory (:func:`refusal` refused the
    rest)."""
    if out.is_dir() and holds_ours(out):
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)  # left by a run killed right here
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old)
    else:
        if out.exists():
            out.rmdir()  # an empty directory only: others were refused
        os.replace(work, out)
