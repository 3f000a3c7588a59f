"""One run per checkpoint bucket (checkpointing/lease.py), on a local directory with a test
clock; the same lease on the S3 and GCS emulators is in tests/checkpointing/test_object_store.py."""

import json
import socket

import pytest

from boost_jax.checkpointing.lease import LEASE, CheckpointDirBusy, Lease

TTL, RENEW = 120.0, 30.0


class Clock:
    """A test clock; ``on_sleep`` runs at each sleep (another holder's renewal, a write)."""

    def __init__(self, on_sleep=None):
        self.now, self.on_sleep, self.slept = 1000.0, on_sleep, 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        if self.on_sleep is not None:
            self.on_sleep(self)


def _lease(tmp_path, clock: Clock) -> Lease:
    return Lease(tmp_path, TTL, RENEW, settle_s=2.0, clock=clock, sleep=clock.sleep)


def _holder(tmp_path, renewed: float, host: str = "node7", token: str = "theirs") -> None:
    path = tmp_path / "run" / LEASE
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": 4242, "started": "2026-11-28 01:02:03 UTC",
                                "token": token, "renewed": renewed}))


def _token(tmp_path) -> str:
    return json.loads((tmp_path / "run" / LEASE).read_text())["token"]


def test_a_live_holder_refuses_the_start(tmp_path):
    """Guards the refusal: a lease renewed while the new run watches it is a live run's: one
    line naming it, the lease left as it is."""
    clock = Clock(on_sleep=lambda c: _holder(tmp_path, c.now))  # it renews
    _holder(tmp_path, clock.now - 5)
    with pytest.raises(CheckpointDirBusy) as err, _lease(tmp_path, clock):
        pass
    assert str(err.value).startswith(f"--checkpoint_dir={tmp_path} is in use by another run: pid "
                                     "4242 on host node7 since 2026-11-28 01:02:03 UTC, renewed ")
    assert _token(tmp_path) == "theirs" and clock.slept <= RENEW


def test_a_lapsed_lease_is_taken_over_and_released_at_the_end(tmp_path, caplog):
    """Guards the takeover: a holder that stopped renewing 10 s ago (killed, on another host)
    is waited for until its lease lapses, then taken over with a warning; a clean end deletes
    the lease."""
    clock = Clock()
    _holder(tmp_path, clock.now - 10)
    with _lease(tmp_path, clock) as lease:
        assert _token(tmp_path) == lease.mine["token"]
    assert clock.slept == pytest.approx(TTL - 10 + 2.0)  # (the lapse, then the read-back)
    assert not (tmp_path / "run" / LEASE).exists()
    assert any("took over the lease" in r.getMessage() and "host node7" in r.getMessage()
               for r in caplog.records)


def test_a_dead_holder_of_this_host_is_taken_over_at_once(tmp_path):
    clock = Clock()
    _holder(tmp_path, clock.now - 1, host=socket.gethostname())  # pid 4242: assumed not running
    with _lease(tmp_path, clock):
        pass
    assert clock.slept == 2.0


def test_of_two_runs_started_together_the_last_writer_goes_on(tmp_path):
    """The read-back: another run wrote its lease while this one settled; this one stops."""
    clock = Clock(on_sleep=lambda c: _holder(tmp_path, c.now, token="later"))
    with pytest.raises(CheckpointDirBusy), _lease(tmp_path, clock):
        pass
    assert _token(tmp_path) == "later"


@pytest.mark.parametrize("torn", ["store error", "half-written"])
def test_a_read_that_meets_a_renewal_is_tried_again(tmp_path, monkeypatch, torn):
    """Guards the lease's reads against the holder rewriting it mid-read (S3: s3fs's
    ``FileExpired``, an OSError, when the object's ETag changed between the read's requests;
    the GCS emulator: a half-written object): the read is tried again and sees the renewal, so
    the start is refused. Before, the OSError escaped the start and half-written JSON was taken
    for no lease (the run took over a live holder's: seen on the emulators, 1 run in 3-6)."""
    clock = Clock(on_sleep=lambda c: _holder(tmp_path, c.now))  # it renews
    _holder(tmp_path, clock.now - 5)
    # no read-back delay (as the emulator tests run it), so only the watch can refuse
    lease = Lease(tmp_path, TTL, RENEW, settle_s=0.0, clock=clock,
                  sleep=lambda s: clock.sleep(s) if s else None)
    real, failed = type(lease.path).read_text, []

    def read_text(path, *args, **kwargs):
        if path.name == LEASE and len(failed) < 1 and clock.slept > 0:  # mid-renewal, once
            failed.append(path)
            if torn == "store error":
                raise OSError(16, "The remote file ... no longer exists")
            return '{"host": "node7", "pi'
        return real(path, *args, **kwargs)

    monkeypatch.setattr(type(lease.path), "read_text", read_text)
    with pytest.raises(CheckpointDirBusy), lease:
        pass
    assert failed and _token(tmp_path) == "theirs"
