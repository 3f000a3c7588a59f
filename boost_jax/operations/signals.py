"""SIGTERM / SIGINT during a run: the first asks for an agreed stop, a second ends the process.

The first signal only records its number (:attr:`StopRequest.signum`); the train loop carries
it in the next step's all-reduce, so every process stops after the same step and saves it
(train/loop.py). While that stop is under way the process may be stuck -- a collective waiting
for a process that died, a hung device -- where no Python code runs. A second SIGTERM or
SIGINT therefore does not go through a Python handler: the interpreter's C-level handler
writes each signal's number to a socket (``signal.set_wakeup_fd``), and a daemon thread that
waits on it prints one line and ends the process with exit code ``128 + N`` at the second,
without a checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the signals that stop a run, by precedence
PROG = "boost_jax.train"


class StopRequest:
    """A context manager that records SIGTERM/SIGINT (:attr:`signum`, the first one) and ends
    the process at the second (the module docstring). Outside the main thread it leaves
    signals alone."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, object] = {}
        self._old_fd: int | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in STOP_SIGNALS:
            self._old[s] = signal.signal(s, self._record)
        reader, writer = self._pair = socket.socketpair()
        writer.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader,), name="second-signal",
                         daemon=True).start()
        return self

    def _record(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            os.write(sys.stderr.fileno(), (
                f"{PROG}: {signal.Signals(signum).name}: stopping after the next step, with a "
                "checkpoint; a second one ends the process at once\n").encode())

    def _watch(self, reader: socket.socket) -> None:
        """Count stop signals as the C handler reports them; end the process at the second."""
        seen = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:  # closed by __exit__
                return
            if not data:
                return
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                seen += 1
                if seen >= 2:
                    name = signal.Signals(signum).name
                    os.write(sys.stderr.fileno(), (
                        f"{PROG}: error: second {name} while stopping: ending now, without a "
                        "checkpoint (the last one saved stays)\n").encode())
                    os._exit(128 + signum)

    def __exit__(self, *exc) -> None:
        if self._pair is None:
            return
        signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._pair[0].shutdown(socket.SHUT_RDWR)  # the watcher's recv returns
        for sock in self._pair:
            sock.close()
        self._pair = None
