"""A profiled window of train steps: a ``jax.profiler`` trace of ``Train.profile_steps`` steps
from ``Train.profile_start_step``, on the processes ``Train.profile_processes``.

Each profiled process writes its trace under ``<workdir>/profile/process-<i>/`` in
``jax.profiler``'s layout (``plugins/profile/<time>/<host>.xplane.pb`` for TensorBoard's
profile plugin, ``<host>.trace.json.gz`` for Perfetto or ``chrome://tracing``). Every step of
the window -- fetching its batch and dispatching it -- is a ``train`` step annotation with
its step number (``jax.profiler.StepTraceAnnotation``), which the trace viewer groups steps
by. The trace stops once the window's last step has finished on the device (one wait for it,
so the trace holds its device work), or at the end of the run if that comes first: a window
reaching past ``Train.steps``, or a run stopped by a signal, keeps the steps it traced. A run
resumed after the window's first step traces the rest of the window; one resumed after its
end traces nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import jax
from absl import logging

from boost_jax.config import Train
from boost_jax.errors import ConfigError
from boost_jax.operations.progress import say

#: the directory of the traces, under the workdir
PROFILE_DIR = "profile"


def trace_dir(workdir: Path, process: int) -> Path:
    """Where process ``process`` writes its trace."""
    return workdir / PROFILE_DIR / f"process-{process}"


class StepProfiler:
    """Starts and stops the trace around the train steps (:meth:`step`); a context manager
    that stops a trace still running when the training loop ends."""

    def __init__(self, train: Train, workdir: Path, process: int, process_count: int):
        late = [p for p in train.profile_processes if p >= process_count]
        if train.profile_steps and late:
            raise ConfigError(f"Train.profile_processes={train.profile_processes!r} names "
                              f"process {late[0]}, but the run has {process_count} "
                              f"process(es) (indices 0..{process_count - 1})")
        self.first = train.profile_start_step
        self.end = self.first + train.profile_steps  # the first step after the window
        self.enabled = bool(train.profile_steps) and process in train.profile_processes
        self.dir = trace_dir(workdir, process)
        self.active, self.traced = False, []

    @contextlib.contextmanager
    def step(self, step: int, pending: tuple | None,
             pause: Callable[[], AbstractContextManager]) -> Iterator[None]:
        """Around fetching step ``step``'s batch and dispatching it: starts the trace at the
        window's first step, stops it before the step after the window (once the last one,
        ``pending``'s ``(step, outputs)``, has finished), and annotates the steps between.
        Starting and stopping happen in a ``pause()`` block (not step time)."""
        if not self.enabled or not (self.active or self.first <= step < self.end):
            yield
            return
        if step >= self.end:
            with pause():
                self._stop(pending)
            yield
            return
        if not self.active:
            with pause():
                self._start(step)
            if not self.active:
                yield
                return
        self.traced.append(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield

    def _start(self, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            jax.profiler.start_trace(str(self.dir))
        except RuntimeError as err:  # a trace of the caller's is running
            logging.warning("no profile of steps %d..%d: %s", step, self.end - 1, err)
            self.enabled = False
            return
        self.active = True
        logging.info("profiling steps %d..%d into %s", step, self.end - 1, self.dir)

    def _stop(self, pending: tuple | None) -> None:
        if not self.active:
            return
        if pending is not None:
            jax.block_until_ready(pending[1])
        jax.profiler.stop_trace()
        self.active = False
        say(f"wrote the trace of steps {self.traced[0]}..{self.traced[-1]} to {self.dir} "
            f"(TensorBoard: tensorboard --logdir {self.dir.parent}; Perfetto: its "
            "*.trace.json.gz)")

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        """The loop is over, its last step read back (or it raised): stop a running trace."""
        self._stop(None)
