"""The hang watchdog: a process where no train step finishes for too long dumps every
thread's stack and exits with :data:`EXIT_HANG`, so that a scheduler restarts it (the restart
resumes from the last checkpoint).

A hung collective (a peer that died or stalled), a wedged device or a data loader that never
returns leave the process alive and silent, holding its allocation; no Python code of the
main thread runs again. A daemon thread (:class:`Watchdog`) therefore watches the time since
the last step finished (the trainer read its metrics back). The limit is
``Train.hang_timeout_s`` seconds, or with ``0`` (the default) ``max(HANG_FLOOR_S,
HANG_FACTOR x the median of the last MEDIAN_STEPS step times)`` (:func:`hang_limit`);
``None`` turns the watchdog off. It runs from the first step's dispatch (after the train
step is compiled) to the end of the training loop, and not during checkpoint saves, evals and
samples (:meth:`Watchdog.paused`: the count starts again after them) -- nor during the
restore, the compilation, the final checkpoint and eval. It counts the time the process could
run: a process stopped and continued (SIGSTOP / SIGCONT, a suspended job) is not taken for a
hung one (:data:`SUSPENDED_S`).

When it fires: one line on stderr, every thread's Python stack to
``<workdir>/hang-step<N>-process<i>.txt`` (``faulthandler.dump_traceback``, appended; ``N``
is the last finished step) and to the log (``sys._current_frames``), then the ``exit`` it was
given: ``os._exit`` from the command (the main thread is stuck where no exception can reach
it); a run called from Python without one leaves the process to its caller.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from absl import logging

#: the exit code of a process the watchdog ended: BSD sysexits.h's EX_TEMPFAIL ("a temporary
#: failure ... the user is invited to retry"); no other exit of the trainer uses it
EXIT_HANG = 75
#: the least automatic limit, in seconds: PyTorch's default timeout of an NCCL collective
#: (10 minutes, pytorch/pytorch#110947) -- a step stuck longer is not a slow step
HANG_FLOOR_S = 600.0
#: the automatic limit in median step times (our choice: far above the jitter of steps, and
#: of an occasional slow one, like a LORO exact step of a small model; a longer expected step
#: needs an explicit Train.hang_timeout_s)
HANG_FACTOR = 20.0
#: the recent step times whose median sets the automatic limit
MEDIAN_STEPS = 100
#: the longest wait between two looks at the clock, in seconds
POLL_S = 1.0
#: a look at the clock that comes this many seconds later than asked means the process did not
#: run in between (stopped: SIGSTOP, ``scontrol suspend``, a laptop's sleep): that time is not
#: counted -- a hung process still runs its watchdog thread every POLL_S
SUSPENDED_S = 5.0
PROG = "boost_jax.train"


def hang_limit(setting: float | None, step_times: Sequence[float]) -> float | None:
    """The limit in seconds (``None``: no watchdog) for ``Train.hang_timeout_s=setting``
    after the given recent step times: ``setting`` when positive, else ``max(HANG_FLOOR_S,
    HANG_FACTOR x median)`` (the floor before any step finished)."""
    if setting is None:
        return None
    if setting > 0:
        return float(setting)
    if not step_times:
        return HANG_FLOOR_S
    return max(HANG_FLOOR_S, HANG_FACTOR * statistics.median(step_times))


def thread_stacks() -> str:
    """Every thread's Python stack, most recent call last, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """The watchdog of one training loop: a context manager that starts the daemon thread and
    stops it; :meth:`beat` at each finished step, :meth:`paused` around checkpoint saves and
    evals. ``exit(code)``: what ends the process when it fires (the entry point's; None: it
    dumps the stacks and ends nothing); ``clock`` is for tests."""

    def __init__(self, setting: float | None, workdir: Path, process: int,
                 exit: Callable[[int], object] | None = None,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S):
        self.setting, self.workdir, self.process = setting, workdir, process
        self._exit, self._clock, self._poll_s = exit, clock, poll_s
        # looks at the clock; seconds the process was stopped since the last step or pause
        self.polls, self.stopped = 0, 0.0
        self._lock = threading.Lock()
        self._times: collections.deque[float] = collections.deque(maxlen=MEDIAN_STEPS)
        self._last, self._paused, self.step = clock(), 0, 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: Path | None = None  # the stack file, once it fired

    def __enter__(self) -> Watchdog:
        if self.setting is None:
            return self
        self._last = self._clock()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, step: int, step_time: float) -> None:
        """Step ``step`` finished after ``step_time`` seconds."""
        with self._lock:
            self._times.append(step_time)
            self._last, self.step, self.stopped = self._clock(), step, 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not watched: the block (a checkpoint save, an eval) may take any time."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last, self.stopped = self._clock(), 0.0

    def limit(self) -> float | None:
        """The limit now, in seconds (:func:`hang_limit`)."""
        with self._lock:
            times = list(self._times)
        return hang_limit(self.setting, times)

    def _watch(self) -> None:
        polled = self._clock()
        while True:
            limit = self.limit()
            timeout = min(self._poll_s, limit / 5)
            if self._done.wait(timeout):
                return
            with self._lock:
                now = self._clock()
                if (late := now - polled - timeout) > SUSPENDED_S:  # the process was stopped
                    self._last, self.stopped = self._last + late, self.stopped + late
                polled, self.polls = now, self.polls + 1
                waited = now - self._last
                if self._paused or waited <= limit:
                    continue
            self._fire(waited, limit)
            return

    def _fire(self, waited: float, limit: float) -> None:
        how = (f"Train.hang_timeout_s={self.setting:g}" if self.setting else
               f"Train.hang_timeout_s=0: max({HANG_FLOOR_S:g} s, {HANG_FACTOR:g} x the median "
               "step time)")
        stopped = (f", not counting {self.stopped:.0f} s the process was stopped"
                   if self.stopped else "")
        what = (f"no train step finished in the {limit:.4g} s after step {self.step} ({how}; "
                f"waited {waited:.1f} s{stopped})")
        path = self.workdir / f"hang-step{self.step}-process{self.process}.txt"
        try:
            with path.open("a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} process {self.process}: "
                        f"{what}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"the stacks of all threads are in {path}"
        except OSError as err:
            where = f"{path} could not be written ({err}); the stacks of all threads are"
            path = None
        then = (f"exiting with code {EXIT_HANG} so that the scheduler restarts it"
                if self._exit is not None else "the process is left running (no exit given)")
        os.write(sys.stderr.fileno(), (
            f"{PROG}: error: {what}: the run looks hung; {where} and in the log; "
            f"{then}\n").encode())
        logging.error("hang watchdog, process %d: the stacks of all threads:\n%s", self.process,
                      thread_stacks())
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.fired = path
        if self._exit is not None:
            self._exit(EXIT_HANG)
