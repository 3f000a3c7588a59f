"""One run per workdir (operations/workdir_lock.py). The refusal of a second real process is in
tests/train/test_cli.py (test_sigterm_leaves_a_usable_checkpoint, which has a run going)."""

import json
import os
import socket

import pytest

from boost_jax.operations.workdir_lock import LOCK, WorkdirBusy, held


def test_a_held_workdir_refuses_a_second_run_naming_the_holder(tmp_path):
    """Guards the refusal's content: host, pid and start time of the holder, the lock's path;
    and that the lock is released at the end of the first run (a third run takes it)."""
    with held(tmp_path):
        record = json.loads((tmp_path / LOCK).read_text())
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(WorkdirBusy) as err, held(tmp_path):
            pass
    message = str(err.value)
    assert message.startswith(f"--workdir={tmp_path} is in use by another run: pid {os.getpid()} "
                              f"on host {socket.gethostname()} since {record['started']}")
    assert "one run per workdir" in message and "\n" not in message
    assert (tmp_path / LOCK).read_text() == ""  # a clean end leaves no name
    with held(tmp_path):
        pass


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    """Guards the stale case: a record without a live holder (the kernel dropped its lock when
    it was killed) does not block the restart, and the warning names who left it."""
    (tmp_path / LOCK).write_text(json.dumps({"host": "node7", "pid": 4242,
                                             "started": "2026-11-28 01:02:03 UTC"}))
    with held(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    (warning,) = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert "pid 4242 on host node7 since 2026-11-28 01:02:03 UTC" in warning
