"""Metrics: ``metrics.jsonl`` (full precision, one line per step, per eval and per set of
logged samples), TensorBoard event files, the W&B run (``Train.wandb``;
train/wandb_logger.py), and the progress line. Only process 0 writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from absl import logging

from boost_jax.operations.disk_errors import writing
from boost_jax.train.tensorboard import EventFile

if TYPE_CHECKING:
    from boost_jax.train.wandb_logger import WandbRun


class MetricsWriter:
    """Appends to ``<workdir>/metrics.jsonl`` and ``<workdir>/tensorboard``.

    The history is append-only. On resume from ``start_step``, the entries after it (the lost
    tail of an interrupted run, which the resumed run logs again) and any unparsable line (a
    write cut off by a kill) are first moved to ``metrics.rewound-<start_step>.jsonl``; the
    live file is then replaced atomically by the entries it keeps, so it holds each step once
    and nothing is deleted. TensorBoard is told to purge the events after ``start_step``.

    ``wandb``: a W&B run that gets every record and text too, finished by :meth:`close`.

    Both files are written in the caller's thread and flushed per record (TensorBoard's too:
    train/tensorboard.py), so a full disk raises at the write that meets it, as one line
    (operations/disk_errors.py ``WriteError``), and never blocks the loop.
    """

    def __init__(self, workdir: str | Path, start_step: int, enabled: bool = True,
                 wandb: WandbRun | None = None):
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self.tb = None
        self.wandb = wandb if enabled else None
        if not enabled:
            return
        if self.path.exists():
            with writing(self.path):
                self._rewind(start_step)
        self.tb_dir = Path(workdir) / "tensorboard"
        with writing(self.path):
            self.file = self.path.open("a")
        with writing(self.tb_dir):
            self.tb = EventFile(self.tb_dir, purge_step=start_step + 1 if start_step else None)

    def _rewind(self, start_step: int) -> None:
        kept, moved, torn = [], [], 0
        text = self.path.read_text(errors="replace")
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                torn += 1
                moved.append(line)
                continue
            (kept if step <= start_step else moved).append(line)
        if torn:
            logging.warning("%s: %d unreadable line(s) (a write cut off by a kill) skipped",
                            self.path, torn)
        if not moved and text.endswith("\n") or not text:
            return
        side = self.path.with_name(f"metrics.rewound-{start_step}.jsonl")
        if moved:
            _append(side, moved)
        tmp = self.path.with_name(self.path.name + ".tmp")
        _append(tmp, kept, mode="w")
        tmp.replace(self.path)
        if moved:
            logging.info("resuming at step %d: %d later metrics line(s) of the interrupted "
                         "run moved to %s", start_step, len(moved), side.name)

    def write(self, step: int, values: dict, prefix: str = "train") -> None:
        """A line ``{"step": step, **values}``, and each finite number as the TensorBoard
        scalar ``<prefix>/<key>`` (``<key>`` for ``prefix=""``: keys that carry their own
        group, like ``goodput/step``)."""
        if not self.enabled:
            return
        with writing(self.path):
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()  # a whole line per write: a kill leaves at most one torn line
        with writing(self.tb_dir):
            self.tb.scalars(step, {f"{prefix}/{k}" if prefix else k: v for k, v in values.items()
                                   if isinstance(v, (int, float)) and math.isfinite(v)})
        if self.wandb is not None:
            self.wandb.log(step, values, prefix)

    def write_text(self, step: int, key: str, texts: list[str], prefix: str = "train") -> None:
        """A line ``{"step": step, key: texts}`` (e.g. ``samples``) and TensorBoard text
        ``<prefix>/<key>/<i>`` per text."""
        if not self.enabled:
            return
        with writing(self.path):
            self.file.write(json.dumps({"step": step, key: list(texts)}) + "\n")
            self.file.flush()
        with writing(self.tb_dir):
            for i, text in enumerate(texts):
                self.tb.text(step, f"{prefix}/{key}/{i}", text)
        if self.wandb is not None:
            self.wandb.log_texts(step, key, texts, prefix)

    def close(self) -> None:
        if self.enabled:
            with writing(self.path):
                self.file.close()
            with writing(self.tb_dir):
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def _append(path: Path, lines: list[str], mode: str = "a") -> None:
    """Write ``lines`` and flush them to the disk."""
    with path.open(mode) as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
