"""The Weights & Biases run of a training run (``Train.wandb``), beside ``metrics.jsonl`` and
TensorBoard: the run's config, every record of ``metrics.jsonl`` (steps, evals, goodput) and
the logged samples (a ``wandb.Table``). Only process 0 opens one.

The W&B run lives under the workdir (``<workdir>/wandb/``); its id is kept in
``<workdir>/wandb_run_id``, so a resumed run continues the same W&B run (``resume="allow"``).
Each record is logged with its training step as the field ``step``, the x-axis of every chart
(``define_metric``), and not as W&B's own step, which only grows: a resumed run logs the
steps after its checkpoint again, and W&B would drop them. ``wandb`` is an optional extra
(``pip install 'boost_jax[wandb]'``); ``WANDB_MODE=offline`` keeps the run on disk.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

from boost_jax.checkpointing.run_files import RUN_ID_FILE
from boost_jax.errors import ConfigError
from boost_jax.operations.disk_errors import writing

#: the file, in the workdir, that holds the W&B run's id


def check_available(enabled: bool) -> None:
    """With ``Train.wandb=True``, the ``wandb`` package must be importable; else a one-line
    :class:`ConfigError` naming the extra. Called on every process before anything is built."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("Train.wandb=True needs the wandb package: pip install "
                          "'boost_jax[wandb]' (or set Train.wandb=False)")


class WandbRun:
    """A W&B run under ``workdir``: :meth:`log` a record, :meth:`log_texts` samples,
    :meth:`finish` at the run's end."""

    def __init__(self, workdir: str | Path, config: dict, project: str, name: str | None):
        import wandb

        self.wandb = wandb
        workdir = Path(workdir)
        id_file = workdir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        with writing(id_file):
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name or workdir.name, id=run_id,
                              resume="allow", dir=str(workdir), config=config)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict, prefix: str = "train") -> None:
        """The record ``values`` of ``step``: each number as ``<prefix>/<key>`` (``<key>`` for
        ``prefix=""``), as in TensorBoard (a non-finite one too: W&B keeps NaN and inf)."""
        row: dict[str, Any] = {"step": step}
        for k, v in values.items():
            if isinstance(v, (int, float)):
                row[f"{prefix}/{k}" if prefix else k] = v
        self.run.log(row)

    def log_texts(self, step: int, key: str, texts: list[str], prefix: str = "train") -> None:
        """``texts`` (e.g. the samples) as a table ``<prefix>/<key>`` of (step, index, text)."""
        table = self.wandb.Table(columns=["step", "index", "text"],
                                 data=[[step, i, t] for i, t in enumerate(texts)])
        self.run.log({"step": step, f"{prefix}/{key}": table})

    def finish(self) -> None:
        """Flush and close the run (the offline run's files are complete after this)."""
        self.run.finish()
