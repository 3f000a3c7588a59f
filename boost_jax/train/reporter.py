"""Each train step's report: its metrics read back from the device, its time, throughput and
MFU, the progress line, the non-finite policy, and the clocks that follow the steps (goodput,
operations/goodput.py; the hang watchdog, operations/watchdog.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import jax
from absl import logging

from boost_jax.config import Train
from boost_jax.operations.goodput import Goodput
from boost_jax.operations.progress import Window, say
from boost_jax.operations.watchdog import Watchdog
from boost_jax.train.metrics import MetricsWriter


class Diverged(RuntimeError):
    """The loss or gradient norm stopped being finite (``Train.nonfinite``)."""


def _finished(outputs) -> bool:
    """Whether a dispatched step's outputs are computed (without waiting for them)."""
    return all(leaf.is_ready() for leaf in jax.tree.leaves(outputs))


class Reporter:
    """Reads a step's metrics back from the device, records them with step time, throughput
    and MFU, prints a progress line every ``Train.log_every`` steps (and writes a goodput
    record), and applies the non-finite policy.

    One clock: the time of step ``n`` is the gap between the completions of steps ``n-1`` and
    ``n``, less the time spent in :meth:`paused` blocks (eval, checkpoint saves) in between;
    its ``data_time`` is the part of it :meth:`fetching` counted as waiting for data.
    """

    def __init__(self, writer: MetricsWriter, train: Train, tokens: int,
                 flops_per_device: float, peak: float | None, goodput: Goodput,
                 watchdog: Watchdog):
        self.writer, self.train = writer, train
        self.tokens, self.flops, self.peak = tokens, flops_per_device, peak
        self.goodput, self.watchdog = goodput, watchdog
        self.window = Window(train.steps, tokens, flops_per_device, peak)
        self.last_done, self.excluded, self.last_loss = time.perf_counter(), 0.0, None
        self.fetched = 0.0  # data wait since the last step's report
        self.skipped_in_a_row, self.skipped = 0, 0

    @contextlib.contextmanager
    def paused(self, bucket: str | None = None) -> Iterator[None]:
        """A pause of the steps (a checkpoint save, an eval, starting a profile): its time is
        left out of the step time, counted in the goodput ``bucket`` (``None``: ``other``)
        and not watched for hangs."""
        start = time.perf_counter()
        try:
            with self.watchdog.paused():
                yield
        finally:
            seconds = time.perf_counter() - start
            self.excluded += seconds
            if bucket is not None:
                self.goodput.add(bucket, seconds)

    @contextlib.contextmanager
    def fetching(self, pending: tuple | None) -> Iterator[None]:
        """Around fetching a batch while ``pending`` (``(step, outputs)``, or ``None``) is the
        step dispatched last: the fetch is data wait when that step had finished by its end
        (the device waited), else it overlapped the step."""
        start = time.perf_counter()
        yield
        if pending is None or _finished(pending[1]):
            self.fetched += time.perf_counter() - start

    def __call__(self, step: int, metrics: dict) -> int:
        """Log step ``step``'s metrics; returns the agreed stop signal (0: go on)."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        signum = int(values.pop("stop_signal"))
        now = time.perf_counter()
        dt = now - self.last_done - self.excluded
        data = min(self.fetched, dt)
        self.last_done, self.excluded, self.fetched = now, 0.0, 0.0
        values.update(step_time=dt, data_time=data, tokens_per_sec=self.tokens / dt,
                      tflops_per_device=self.flops / dt / 1e12,
                      mfu=None if self.peak is None else self.flops / dt / self.peak)
        self.watchdog.beat(step, dt)
        self._check_finite(step, values)
        self.goodput.add("step", dt - data)
        self.goodput.add("data", data)
        self.last_loss = values["loss"]
        self.writer.write(step, values)
        self.window.add(dt)
        if step % self.train.log_every == 0 or step == self.train.steps:
            say(self.window.line(step, values["loss"]))
        if step % self.train.log_every == 0:
            self.writer.write(step, self.goodput.record(), prefix="")
        return signum

    def _check_finite(self, step: int, values: dict) -> None:
        """Count a skipped step; raise :class:`Diverged` when the policy says stop."""
        if not values["nonfinite"]:
            self.skipped_in_a_row = 0
            return
        self.skipped += 1
        self.skipped_in_a_row += 1
        values["skipped_total"] = self.skipped
        what = f"step {step}: loss {values['loss']}, gradient norm {values['grad_norm']}"
        if self.train.nonfinite == "stop":
            raise Diverged(f"{what} (Train.nonfinite='stop'); the step was not applied and "
                           "no checkpoint was written after it")
        if self.skipped_in_a_row > self.train.max_skips:
            raise Diverged(f"{what}: {self.skipped_in_a_row} steps in a row skipped, more "
                           f"than Train.max_skips={self.train.max_skips}")
        logging.warning("%s: not finite, step skipped (parameters and optimizer state "
                        "unchanged; %d in a row)", what, self.skipped_in_a_row)
