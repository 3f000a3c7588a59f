"""The hang watchdog: its limit, the watching (on a test clock), and a run whose step hangs
(injected, tests/faults/): every thread's stack, then exit code 75 -- but not for a slow
compilation or checkpoint save."""

import subprocess
import threading
import time

import pytest

from boost_jax.operations.watchdog import (
    EXIT_HANG,
    HANG_FACTOR,
    HANG_FLOOR_S,
    Watchdog,
    hang_limit,
)
from tests.train.test_cli import FAULTS, _cmd, _env, _tiny_gin


def test_the_limit():
    assert hang_limit(None, [1.0]) is None  # off
    assert hang_limit(7.5, [100.0]) == 7.5  # as set
    assert hang_limit(0.0, []) == HANG_FLOOR_S  # before the first step
    assert hang_limit(0.0, [0.1, 0.2, 50.0]) == HANG_FLOOR_S
    slow = 2 * HANG_FLOOR_S / HANG_FACTOR
    assert hang_limit(0.0, [slow, slow, 1e6]) == 2 * HANG_FLOOR_S  # the median, not the max
    assert EXIT_HANG not in (0, 1, 2) and not 128 < EXIT_HANG < 160  # the trainer's other codes


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stuck_in_this_frame(fired: list, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(fired)


def _runs(dog: Watchdog, clock: _Clock, seconds: float, tick: float = 1.0) -> None:
    """``seconds`` of the test clock pass while the process runs: ``tick`` at a time, each
    seen by the watchdog (a look at the clock, :attr:`Watchdog.polls`); one tick of many
    seconds is a process stopped between two looks."""
    while seconds > 0:
        clock.now += min(tick, seconds)
        seconds -= tick
        seen = dog.polls
        deadline = time.monotonic() + 10
        while dog.polls == seen and time.monotonic() < deadline:
            time.sleep(0.002)


def test_it_fires_after_the_limit_only_outside_pauses(tmp_path):
    """On a test clock: beats keep it quiet, a pause of any length does not count, and
    ``limit`` seconds without a step write every thread's stack and exit with EXIT_HANG."""
    clock, fired = _Clock(), []
    dog = Watchdog(10.0, tmp_path, 3, exit=fired.append, clock=clock, poll_s=0.01)
    with dog:
        for step in range(1, 4):
            _runs(dog, clock, 9.0)
            dog.beat(step, 9.0)
        with dog.paused():  # a checkpoint save
            _runs(dog, clock, 1000.0, tick=100.0)
            assert not fired
        _runs(dog, clock, 9.5)  # counted from the pause's end
        assert not _stuck_in_this_frame(fired, 0.2)
        _runs(dog, clock, 1.0)
        assert _stuck_in_this_frame(fired, 30)
    assert fired == [EXIT_HANG]
    assert dog.fired == tmp_path / "hang-step3-process3.txt"
    text = dog.fired.read_text()
    assert ("process 3: no train step finished in the 10 s after step 3 "
            "(Train.hang_timeout_s=10; waited 10.5 s)") in text
    # every thread: the main one (in this test) and the watchdog's
    assert "in test_it_fires_after_the_limit_only_outside_pauses" in text and "_watch" in text


def test_a_stopped_process_is_not_taken_for_a_hung_one(tmp_path):
    """A process stopped and continued (SIGSTOP / SIGCONT, ``scontrol suspend``): its watchdog
    thread did not run either, so it sees the clock come back far later than it asked; that
    time is not counted (SUSPENDED_S), the time it ran before and after is."""
    clock, fired = _Clock(), []
    dog = Watchdog(10.0, tmp_path, 0, exit=fired.append, clock=clock, poll_s=0.01)
    with dog:
        _runs(dog, clock, 6.0)
        _runs(dog, clock, 3600.0, tick=3600.0)  # stopped between two looks: an hour
        _runs(dog, clock, 3.0)
        assert not _stuck_in_this_frame(fired, 0.2) and dog.stopped > 3590, dog.stopped
        _runs(dog, clock, 1.0)  # 10.01 s counted (each look waits poll_s: 0.01)
        assert _stuck_in_this_frame(fired, 30)
    text = dog.fired.read_text()
    assert "(Train.hang_timeout_s=10; waited 10.0 s, not counting 3600 s the process was " \
           "stopped)" in text


def test_without_an_exit_it_dumps_the_stacks_and_ends_nothing(tmp_path, capfd):
    """A run called from Python (``run(on_hang=None)``) leaves its caller's process alone: the
    watchdog writes the stacks and says the process is left running; only the command passes
    ``os._exit``. Seen failing with ``os._exit`` as the watchdog's default (the test process
    ended with code 75)."""
    clock = _Clock()
    dog = Watchdog(10.0, tmp_path, 0, clock=clock, poll_s=0.01)
    with dog:
        _runs(dog, clock, 11.0)
        deadline = time.monotonic() + 30
        while dog.fired is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert dog.fired == tmp_path / "hang-step0-process0.txt"
    assert "the process is left running (no exit given)" in capfd.readouterr().err


def test_off_it_starts_no_thread(tmp_path):
    before = threading.active_count()
    with Watchdog(None, tmp_path, 0, exit=pytest.fail) as dog:
        dog.beat(1, 1.0)
        assert threading.active_count() == before
    assert not list(tmp_path.iterdir())


def test_a_hung_step_dumps_the_stacks_and_exits_75(tiny_data, tmp_path):
    """Compilation and the first checkpoint save each take longer than the limit (not
    watched), then step 7 hangs: the stacks name the hung frame, in the workdir and on stderr,
    and the exit code is 75; the checkpoints before the hang are there to resume from."""
    limit, slow = 4, 6
    env = dict(_env(), PYTHONPATH=FAULTS, BOOST_JAX_FAULT_STEP_HANG="7",
               BOOST_JAX_FAULT_SLOW=str(slow))
    gin = [*_tiny_gin(tiny_data), "Train.steps=100", "Train.checkpoint_every=2",
           "Train.eval_every=3", f"Train.hang_timeout_s={limit}", "Parallel.data=1",
           "Parallel.tensor=1", "Parallel.tp_plan='none'"]
    work = tmp_path / "run"
    start = time.monotonic()
    out = subprocess.run(_cmd(work, *gin), capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == EXIT_HANG, out.stderr[-3000:]
    assert time.monotonic() - start > 2 * slow + limit
    (stacks,) = work.glob("hang-step*-process0.txt")
    assert stacks.name == "hang-step6-process0.txt"  # the last step read back
    text = stacks.read_text()
    assert "no train step finished in" in text and "_hung_step" in text and " train\n" in text
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    assert line.startswith(f"boost_jax.train: error: no train step finished in the {limit} s "
                           f"after step 6 (Train.hang_timeout_s={limit}; waited ")
    assert line.endswith(f"exiting with code {EXIT_HANG} so that the scheduler restarts it")
    assert "the stacks of all threads:" in out.stderr and "_hung_step" in out.stderr
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == [
        "2", "4", "6"]
