"""What a run tells its user on stdout: status lines and one progress line per log window.

Plain lines without logger prefixes, from process 0 only (absl logging keeps the warnings and
errors). A progress line::

    step   40/300  13% | loss 5.1234 | 12,345 tok/s | 0.412 s/step | MFU 3.1% | ETA 1m47s

averages over the steps since the previous line (the log window), so one slow step does not
make the throughput jump; the ETA is the remaining steps at the window's pace.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TextIO

import jax

from boost_jax.compat import COMPILATION_CACHE_EVENTS as CACHE_EVENTS


def say(message: str, file: TextIO | None = None) -> None:
    """Print ``message`` as one plain line on process 0 (to ``file``, default stdout)."""
    if jax.process_index() == 0:
        print(message, file=file or sys.stdout, flush=True)


def duration(seconds: float) -> str:
    """``'45s'``, ``'3m07s'``, ``'2h05m'``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Window:
    """The steps and seconds since the last progress line."""

    def __init__(self, total: int, tokens_per_step: int, flops_per_step: float,
                 peak: float | None):
        self.total, self.tokens, self.peak = total, tokens_per_step, peak
        self.flops = flops_per_step
        self.steps, self.seconds = 0, 0.0

    def add(self, step_time: float) -> None:
        self.steps += 1
        self.seconds += step_time

    def line(self, step: int, loss: float) -> str:
        """The progress line at ``step``; starts the next window."""
        per_step = self.seconds / max(self.steps, 1)
        width = len(str(self.total))
        parts = [f"step {step:>{width}}/{self.total} {100 * step // self.total:>3}%",
                 f"loss {loss:.4f}", f"{self.tokens / per_step:,.0f} tok/s",
                 f"{per_step:.3f} s/step"]
        if self.peak is not None:
            parts.append(f"MFU {100 * self.flops / per_step / self.peak:.1f}%")
        parts.append(f"ETA {duration(per_step * (self.total - step))}")
        self.steps, self.seconds = 0, 0.0
        return " | ".join(parts)


@contextlib.contextmanager
def compiling(what: str):
    """``compiling <what>...`` before, ``compiled <what> in N s ...`` after, saying whether
    JAX's persistent compilation cache served it."""
    say(f"compiling {what}...")
    counts = {"hits": 0, "misses": 0}

    def listen(event: str, **kwargs) -> None:
        if event in CACHE_EVENTS:
            counts[CACHE_EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    start = time.perf_counter()
    try:
        yield
    finally:
        jax.monitoring.unregister_event_listener(listen)
    seconds = time.perf_counter() - start
    if counts["hits"] and not counts["misses"]:
        say(f"loaded {what} from the compilation cache in {seconds:.1f} s")
    elif counts["misses"]:
        say(f"compiled {what} in {seconds:.1f} s (cached for the next run)")
    else:
        say(f"compiled {what} in {seconds:.1f} s")
