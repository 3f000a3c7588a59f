"""Metrics: ``metrics.jsonl`` (full precision, one line per step and per eval), TensorBoard
event files, and the progress line. Only process 0 writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from absl import logging


class MetricsWriter:
    """Appends to ``<workdir>/metrics.jsonl`` and ``<workdir>/tensorboard``.

    On resume from ``start_step`` the file is first cut back to the entries with
    ``step <= start_step``, so steps replayed after an interruption are not logged twice.
    """

    def __init__(self, workdir: str | Path, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(Path(workdir) / "tensorboard"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            logging.warning("tensorboardX is not installed: no TensorBoard event files")

    def write(self, step: int, values: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def progress_line(step: int, total: int, m: dict) -> str:
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "n/a"
    return (f"step {step:>6}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
            f"gnorm {m['grad_norm']:.3f} | {m['tokens_per_sec']:,.0f} tok/s | "
            f"{m['tflops_per_device']:.3f} TFLOP/s/dev | mfu {mfu} | {m['step_time']:.3f} s/step")
