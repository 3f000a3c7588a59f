"""The run's metrics files (train/metrics.py, train/tensorboard.py, operations/disk_errors.py):
TensorBoard's events as TensorBoard reads them, and a full disk under them as one line that
never blocks the loop (issue 46, case 3)."""

import errno
import struct
import threading

from tensorboardX.proto.event_pb2 import Event

from boost_jax.operations.disk_errors import WriteError
from boost_jax.train.metrics import MetricsWriter


def _events(path) -> list[Event]:
    """The records of a TFRecord file (length, its CRC, data, its CRC), parsed as events."""
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        out.append(Event.FromString(data[at + 12:at + 12 + n]))
        at += 12 + n + 4
    return out


def _values(events: list[Event]) -> list[tuple]:
    """Every summary value as ``(step, tag, what it holds)``, wall times aside."""
    return [(e.step, v.tag, v.SerializeToString()) for e in events for v in e.summary.value]


def test_the_event_file_holds_what_summary_writer_writes(tmp_path):
    """Guards train/tensorboard.py against tensorboardX moving: the file is TensorBoard's record
    format and holds what tensorboardX's own SummaryWriter writes for the same calls -- the
    file version, the purge step of a resume (SessionLog START at ``start + 1``), every finite
    scalar under its tag, texts -- one event per step instead of one per scalar."""
    from tensorboardX import SummaryWriter

    (tmp_path / "ours").mkdir()
    writer = MetricsWriter(tmp_path / "ours", start_step=4)
    writer.write(5, {"loss": 2.5, "lr": 1e-3, "nan": float("nan"), "name": "x"})
    writer.write(5, {"goodput/step_s": 1.0}, prefix="")
    writer.write_text(5, "samples", ["ROMEO:", "The king"])
    writer.close()
    reference = SummaryWriter(str(tmp_path / "theirs"), purge_step=5)
    reference.add_scalar("train/loss", 2.5, 5)
    reference.add_scalar("train/lr", 1e-3, 5)
    reference.add_scalar("goodput/step_s", 1.0, 5)
    reference.add_text("train/samples/0", "ROMEO:", 5)
    reference.add_text("train/samples/1", "The king", 5)
    reference.close()
    (ours,) = (tmp_path / "ours" / "tensorboard").glob("events.out.tfevents.*")
    (theirs,) = (tmp_path / "theirs").glob("events.out.tfevents.*")
    ours, theirs = _events(ours), _events(theirs)
    assert _values(ours) == _values(theirs) and len(_values(ours)) == 5
    starts = [(e.step, e.file_version, e.session_log.status) for e in ours if not e.summary.value]
    assert starts == [(e.step, e.file_version, e.session_log.status) for e in theirs
                      if not e.summary.value]
    assert (5, "", Event().session_log.START) in starts


def _in_time(fn, seconds: float = 20.0):
    """``fn()``'s exception (None if it returned) -- or a failure if it is still running after
    ``seconds`` (a blocked write)."""
    out = {}

    def target():
        try:
            fn()
        except Exception as err:  # noqa: BLE001 -- handed to the test
            out["err"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return out.get("err")


def test_a_full_disk_under_tensorboard_is_one_line_and_never_blocks(tmp_path, monkeypatch):
    """Guards case 3: the event file's write failing with ENOSPC (injected where tensorboardX
    writes records; with SummaryWriter that failure killed its worker thread and the next
    writes blocked for good) raises a one-line WriteError at the write that meets it."""
    from tensorboardX import record_writer

    writer = MetricsWriter(tmp_path, start_step=0)

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    err = _in_time(lambda: [writer.write(step, {"loss": 1.0}) for step in range(1, 100)])
    assert isinstance(err, WriteError)
    assert str(err).startswith(f"could not write {tmp_path / 'tensorboard'}: No space left on "
                               "device (") and "MiB free there); free space" in str(err)
    assert "\n" not in str(err)


def test_a_full_disk_under_metrics_jsonl_is_one_line(tmp_path):
    """The kernel's own ENOSPC (``/dev/full``) under metrics.jsonl: one line naming it."""
    writer = MetricsWriter(tmp_path, start_step=0)
    writer.file = open("/dev/full", "a")  # noqa: SIM115 -- the writer's file, closed by it
    err = _in_time(lambda: writer.write(1, {"loss": 1.0}))
    assert isinstance(err, WriteError)
    assert str(err).startswith(f"could not write {tmp_path / 'metrics.jsonl'}: No space left")


def test_the_trainer_starts_without_what_tensorboardx_would_import():
    """Guards train/tensorboard.py's import: tensorboardX's package imports PyTorch and the S3
    and GCS clients where they are installed (5 s of every trainer's start); the trainer's
    modules load without them (CI's floor stack has all three) and leave no ``None`` entry in
    ``sys.modules`` that would make a later import of them fail."""
    import subprocess
    import sys

    from boost_jax.train.tensorboard import UNUSED

    code = ("import sys; import boost_jax.train.loop, boost_jax.train.metrics; "
            "assert 'tensorboardX' in sys.modules; "
            f"print([sys.modules.get(n, 0) for n in {UNUSED!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([0] * len(UNUSED))  # neither imported nor left hidden
