"""Nothing lost, nothing poisoned: checkpoints verified on restore, no silent fresh start, an
append-only metrics history, stale temporaries, a full disk (checkpointing/checkpointer.py,
metrics.py,
integrity.py)."""

import contextlib
import dataclasses
import errno
import json
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from boost_jax.checkpointing.checkpointer import Checkpointer, CheckpointWriteError
from boost_jax.checkpointing.integrity import chunk_checksums_off, verify
from boost_jax.config import ConfigError
from boost_jax.train.loop import run
from tests.train.test_trainer import _config, _losses

ONE = jax.devices()[:1]


def _cfg(data, steps):
    return _config(data, steps, schedule_steps=12, checkpoint_every=4)


@pytest.fixture(scope="module")
def eight_steps(tiny_data, tmp_path_factory):
    """8 steps with checkpoints at 4 and 8; and the losses of steps 5..8."""
    workdir = tmp_path_factory.mktemp("eight")
    run(_cfg(tiny_data, 8), workdir, ONE)
    return workdir


def _copy(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _rot(checkpoint, nbytes=4096, seed=0):
    """Random bytes written inside the largest data file (its size unchanged)."""
    largest = max((f for f in (checkpoint / "state").rglob("*") if f.is_file()),
                  key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    start = len(data) // 3
    rng = np.random.default_rng(seed)
    data[start:start + nbytes] = rng.integers(0, 256, min(nbytes, len(data) - start),
                                              dtype=np.uint8).tobytes()
    largest.write_bytes(bytes(data))


def _chunk_codecs(checkpoint, array):
    """The codecs of ``array``'s chunks, as its stored ``zarr.json`` says."""
    import tensorstore as ts
    store = ts.KvStore.open({"driver": "ocdbt",
                             "base": (checkpoint / "state").absolute().as_uri() + "/"}).result()
    meta = json.loads(store.read(f"{array}/zarr.json").result().value)
    return meta["codecs"][0]["configuration"]["codecs"]


def _flip_one_byte(checkpoint):
    data = max((f for f in (checkpoint / "state").rglob("*") if f.is_file()),
               key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01  # inside a raw block, away from the block headers
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("checksums", [True, False])
def test_one_flipped_byte_fails_the_chunk_checksum(tmp_path, caplog, checksums):
    """Random bits do not compress (zstd stores them as raw blocks), so only the chunk's
    checksum sees one byte changed inside them: without it the damage restores silently."""
    x = jax.random.bits(jax.random.key(0), (256, 256), jnp.uint32)
    state = {"step": jnp.int32(3), "params": {"w": x}, "opt_state": {}}
    ckpt = Checkpointer(tmp_path, keep=1)
    with contextlib.nullcontext() if checksums else chunk_checksums_off():
        ckpt.save(3, state, {"state_format": "zarr3+zstd-checksum"}, wait=True)
    _flip_one_byte(tmp_path / "3")
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                         sharding=a.sharding), state)
    restored = ckpt.restore_latest(target)
    ckpt.close()
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    if checksums:
        assert restored is None
        assert len(damaged) == 1 and "Restored data doesn't match checksum" in damaged[0]
    else:
        assert restored.step == 3 and damaged == []
        assert np.sum(np.asarray(restored.state["params"]["w"]) != np.asarray(x)) == 1



def _checksummed(checkpoint, array) -> bool:
    (zstd,) = [c for c in _chunk_codecs(checkpoint, array) if c["name"] == "zstd"]
    return zstd.get("configuration", {}).get("checksum", False)


def test_checksums_are_each_checkpointers_own(tmp_path):
    """Two checkpointers saving from two threads, one of them without chunk checksums
    (chunk_checksums_off, as bench checkpoint saves) while the other saves: each checkpoint is
    written as its own thread asked. orbax used directly in the same process, with both
    checkpointers open, writes as orbax does (no checksums): the hook is not process-wide."""
    state = {"step": jnp.int32(3), "params": {"w": jnp.ones((64, 64), jnp.float32)},
             "opt_state": {}}
    plain, checked = (Checkpointer(tmp_path / name, keep=1) for name in ("plain", "checked"))
    inside, saved, errors = threading.Event(), threading.Event(), []

    def save_plain() -> None:
        try:
            with chunk_checksums_off():
                inside.set()
                assert saved.wait(300)  # the other thread saves while this one is inside
                plain.save(3, state, {}, wait=True)
        except BaseException as err:  # reported below
            errors.append(err)
        finally:
            inside.set()

    def save_checked() -> None:
        try:
            assert inside.wait(300)
            checked.save(3, state, {}, wait=True)
        except BaseException as err:
            errors.append(err)
        finally:
            saved.set()

    threads = [threading.Thread(target=f) for f in (save_plain, save_checked)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)).save(
        tmp_path / "orbax" / "state", {"w": np.ones((64, 64), np.float32)})
    plain.close()
    checked.close()
    assert errors == []
    assert _checksummed(tmp_path / "checked" / "3", "params.w")
    assert not _checksummed(tmp_path / "plain" / "3", "params.w")
    assert not _checksummed(tmp_path / "orbax", "w")

def test_every_chunk_is_checksummed_and_the_state_checked(eight_steps):
    """Orbax's Zarr v3 chunks end in TensorStore's crc32c codec (an orbax upgrade that changes
    how it builds them fails here); verify() sees a non-finite value and another step's state."""
    codecs = _chunk_codecs(eight_steps / "checkpoints" / "8", "params.blocks.down.a")
    assert [c["name"] for c in codecs] == ["bytes", "zstd"]
    assert codecs[1]["configuration"]["checksum"] is True
    meta = json.loads((eight_steps / "checkpoints" / "8" / "meta" / "metadata").read_text())
    assert meta["state_format"] == "zarr3+zstd-checksum"
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 7
    state = {"step": jnp.int32(8), "params": {"w": x, "b": x.astype(jnp.bfloat16)},
             "opt_state": {"count": jnp.int32(8)}}
    assert verify(state, 8) is None
    assert verify(state, 4) == "it holds the state of step 8, not 4"
    bad = dict(state, params={"w": x.at[3, 1].set(jnp.inf), "b": state["params"]["b"]})
    assert verify(bad, 8) == "non-finite values in 1 array(s), e.g. ['params']['w']"


@pytest.mark.parametrize("damage", ["rot", "other-state"])
def test_bit_rot_is_caught_and_the_older_step_used(tiny_data, eight_steps, tmp_path, capfd,
                                                   caplog, damage):
    """4 KiB of random bytes inside the newest checkpoint's largest data file (it may fail to
    decode, or decode to other values), or files that read perfectly but hold other values
    (step 4's arrays under step 8's metadata): quarantined with one warning line (no
    traceback), step 4 restored; the steps that follow are those of the first run."""
    workdir = _copy(eight_steps, tmp_path)
    ckpt = workdir / "checkpoints"
    if damage == "rot":
        _rot(ckpt / "8")
    else:
        shutil.rmtree(ckpt / "8" / "state")
        shutil.copytree(ckpt / "4" / "state", ckpt / "8" / "state")
    s = run(_cfg(tiny_data, 8), workdir, ONE)
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    if damage == "rot":  # where the bytes land: a zstd frame, its content, or a shard index
        assert any(why in warned[0] for why in ("ZSTD_decompressStream() failed",
                                                "doesn't match checksum", "Digest mismatch"))
    else:
        assert "holds the state of step 4" in warned[0]
    assert (s.start_step, s.step) == (4, 8)
    assert [p.name.split("-")[:2] for p in (workdir / "checkpoints").glob("corrupt-*")] == [
        ["corrupt", "8"]]
    first = json.loads((workdir / "metrics.rewound-4.jsonl").read_text().splitlines()[0])
    assert first["step"] == 5  # the first run's steps 5..8, set aside
    before = {r["step"]: r["loss"] for r in map(json.loads, (
        workdir / "metrics.rewound-4.jsonl").read_text().splitlines()) if "loss" in r}
    after = _losses(workdir)
    assert [after[k] for k in range(5, 9)] == [before[k] for k in range(5, 9)]
    assert sorted(after) == list(range(1, 9))  # each step once
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err


def test_every_checkpoint_damaged_is_an_error_and_changes_nothing(tiny_data, eight_steps, tmp_path):
    workdir = _copy(eight_steps, tmp_path)
    for step in (4, 8):
        _rot(workdir / "checkpoints" / str(step), seed=step)
    metrics = (workdir / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"no usable checkpoint .* moved aside \(corrupt-8-"
                                          r"\d+, corrupt-4-\d+\); rerun with --fresh_start"):
        run(_cfg(tiny_data, 12), workdir, ONE)
    assert (workdir / "metrics.jsonl").read_bytes() == metrics
    s = run(_cfg(tiny_data, 2), workdir, ONE, fresh_start=True)
    assert (s.start_step, s.step) == (0, 2)
    assert sorted(_losses(workdir)) == [1, 2]
    rewound = (workdir / "metrics.rewound-0.jsonl").read_text().splitlines()
    assert len(rewound) == len(metrics.decode().splitlines())  # the old history, kept


def test_a_torn_metrics_line_is_skipped_with_a_warning(tiny_data, eight_steps, tmp_path, caplog):
    workdir = _copy(eight_steps, tmp_path)
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "loss": 5.1')  # a write cut off by a kill
    s = run(_cfg(tiny_data, 10), workdir, ONE)
    assert (s.start_step, s.step) == (8, 10)
    assert sorted(_losses(workdir)) == list(range(1, 11))
    assert "1 unreadable line(s)" in caplog.text
    assert (workdir / "metrics.rewound-8.jsonl").read_text() == '{"step": 9, "loss": 5.1\n'


def test_stale_temporaries_are_removed(tiny_data, eight_steps, tmp_path, caplog):
    workdir = _copy(eight_steps, tmp_path)
    ckpt = workdir / "checkpoints"
    shutil.copytree(ckpt / "8", ckpt / "12.orbax-checkpoint-tmp-1234")
    caplog.set_level("INFO")
    s = run(_cfg(tiny_data, 9), workdir, ONE)
    assert s.start_step == 8
    assert not list(ckpt.glob("*orbax-checkpoint-tmp*"))
    assert "removed 1 unfinished checkpoint save(s)" in caplog.text


def test_a_full_disk_stops_the_run_and_keeps_the_older_checkpoints(tiny_data, eight_steps, tmp_path,
                                                                  monkeypatch):
    """The checkpoint writer raises ENOSPC (a test hook in orbax's metadata writer): one-line
    error naming the path and the size; steps 4 and 8 intact, and a resume from 8 works."""
    workdir = _copy(eight_steps, tmp_path)
    real = ocp.JsonCheckpointHandler._save_fn

    async def full(self, x, directory):
        if "12" in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
    with pytest.raises(CheckpointWriteError) as err:
        run(_cfg(tiny_data, 12), workdir, ONE)
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and "MiB" in msg
    assert _steps(workdir) == [4, 8]
    monkeypatch.undo()
    s = run(_cfg(tiny_data, 12), workdir, ONE)
    assert (s.start_step, s.step) == (8, 12)
    assert sorted(_losses(workdir)) == list(range(1, 13))


#: what TensorStore 0.1.x raised writing a checkpoint's array to a full 2 MB tmpfs (recorded
#: 2026-11-28): a ValueError, the OS error only in its text
TENSORSTORE_FULL_DISK = (
    'RESOURCE_EXHAUSTED: Error writing local file "{path}": Failed writing: "{path}.__lock": '
    "Failed to write 2101248 bytes to file 3: No space left on device [os_error_code='28']")


def test_a_full_disk_seen_by_tensorstore_is_one_line(tmp_path, monkeypatch):
    """Guards read_failures.os_error on TensorStore's errors: a full disk reported by TensorStore
    (a ValueError whose text holds the file and ``os_error_code='28'``, not an OSError) is the
    same one-line CheckpointWriteError as an OSError: the file, "No space left on device", the
    checkpoint's size."""
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, asynchronous=False)
    path = str(tmp_path / "ckpt" / "3" / "state" / "c" / "0")

    def full(*args, **kwargs):
        raise ValueError(TENSORSTORE_FULL_DISK.format(path=path))

    monkeypatch.setattr(ckpt.mngr, "save", full)
    with pytest.raises(CheckpointWriteError) as err:
        ckpt.save(3, {"w": jnp.zeros((1024, 256))}, {})
    assert str(err.value).startswith(f"could not write a checkpoint to {path}: No space left on "
                                     "device; a checkpoint takes about 1 MiB")
    assert "\n" not in str(err.value)


def test_a_save_that_fails_in_the_background_ends_the_run_at_the_next_step(tiny_data, tmp_path,
                                                                           small_disk):
    """Guards issue 46 case 2: the asynchronous save at step 100 fails on a full disk (a real
    one, checkpointing/checkpointer.py ``check``); the run ends with the one-line
    CheckpointWriteError a
    few steps later -- not at the final save of step 200, 100 steps of work later."""
    cfg = _config(tiny_data, 200, checkpoint_every=100, log_every=1)
    with pytest.raises(CheckpointWriteError) as err:
        run(cfg, tmp_path / "run", ONE, checkpoint_dir=str(small_disk / "ckpt"))
    assert str(err.value).startswith(f"could not write a checkpoint to {small_disk / 'ckpt'}")
    assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
    assert 100 <= max(_losses(tmp_path / "run")) < 200


def test_rerunning_a_finished_run_adds_nothing(tiny_data, eight_steps, tmp_path, capsys):
    workdir = _copy(eight_steps, tmp_path)
    before = {p.name: p.read_bytes() for p in workdir.glob("metrics*.jsonl")}
    s = run(_cfg(tiny_data, 8), workdir, ONE)
    assert (s.start_step, s.step) == (8, 8)
    assert {p.name: p.read_bytes() for p in workdir.glob("metrics*.jsonl")} == before
    assert "nothing to do" in capsys.readouterr().out
    assert _steps(workdir) == [4, 8]


def test_another_model_is_refused_naming_the_choice_that_differs(eight_steps):
    from boost_jax.config import Config
    from boost_jax.train.resume import check_resume

    meta = json.loads((eight_steps / "checkpoints" / "8" / "meta" / "metadata").read_text())
    saved = meta["config"]
    other = Config(**{k: v for k, v in zip(
        ("model", "parallel", "train", "data"), _config_groups(saved, size="small"))})
    with pytest.raises(ConfigError, match=r"another model \(Model.size='tiny', now 'small'\)"):
        check_resume(meta["config"], other, "W")


def _config_groups(saved, size):
    from boost_jax.config import Data, Model, Parallel, Train

    model = {k: saved["Model"][k] for k in ("arch", "rank")}
    return (Model(size=size, **model), Parallel(**{**saved["Parallel"], "data": 1, "tensor": 1}),
            Train(**saved["Train"]), Data(**saved["Data"]))


# --- damage, mismatch, or neither ---------------------------------------------------------
@pytest.mark.parametrize("err, kind", [
    (UnicodeDecodeError("utf-8", b"\xcf", 0, 1, "invalid continuation byte"), "DAMAGED"),
    (json.JSONDecodeError("Expecting value", "{", 1), "DAMAGED"),
    (ValueError("DATA_LOSS: Error reading ... CRC-32C checksum verification failed"), "DAMAGED"),
    (ValueError("FAILED_PRECONDITION: Error reading shard entry {0, 0}: "
                "ZSTD_decompressStream() failed"), "DAMAGED"),
    (ValueError('FAILED_PRECONDITION: Error reading local file "_sharding": Invalid JSON'),
     "DAMAGED"),
    (OSError(errno.EIO, "Input/output error"), "TRANSIENT"),
    (ValueError("UNAVAILABLE: Error reading gs://bucket/x: HTTP 503"), "TRANSIENT"),
    (ValueError("DEADLINE_EXCEEDED: read timed out"), "TRANSIENT"),
    (FileNotFoundError(errno.ENOENT, "No such file", "x"), "MISSING"),
    (ValueError("NOT_FOUND: Error reading local file x"), "MISSING"),
    (ValueError("Tree structures differ: {'a': *} vs {'b': *}"), "UNKNOWN"),
])
def test_what_counts_as_damage(err, kind):
    from boost_jax.checkpointing.read_failures import Failure, classify

    wrapped = RuntimeError("Encountered error while reading")
    wrapped.__cause__ = err
    assert classify(err) == classify(wrapped) == Failure[kind]



def test_root_cause_follows_causes_and_contexts():
    """The one unwrapping of orbax's errors (checkpoint restores, trained.read_params): explicit
    causes and implicit contexts, down to the innermost; a cycle ends it."""
    from boost_jax.checkpointing.read_failures import root_cause

    inner = ValueError("DATA_LOSS: Digest mismatch")
    middle = RuntimeError("Encountered error while reading")
    middle.__context__ = inner
    outer = RuntimeError("restore failed")
    outer.__cause__ = middle
    assert root_cause(outer) is inner and root_cause(inner) is inner
    inner.__context__ = outer  # a cycle
    assert root_cause(outer) is inner

def _failing_reads(monkeypatch, step, times):
    """The state of checkpoint ``step`` raises an injected I/O error on its first ``times``
    reads; returns the list of failed attempts."""
    from boost_jax.checkpointing import checkpointer as checkpoint

    monkeypatch.setattr(checkpoint, "RETRY_DELAY_S", 0.0)
    real, failed = ocp.StandardCheckpointHandler.restore, []

    def restore(self, directory, *args, **kwargs):
        if directory.parent.name == str(step) and len(failed) < times:
            failed.append(directory)
            raise OSError(errno.EIO, "Input/output error (injected)", str(directory))
        return real(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", restore)
    return failed


def test_a_transient_read_error_is_retried_and_the_run_resumes(tiny_data, eight_steps, tmp_path,
                                                                monkeypatch, caplog):
    workdir = _copy(eight_steps, tmp_path)
    failed = _failing_reads(monkeypatch, 8, times=2)
    s = run(_cfg(tiny_data, 10), workdir, ONE)
    assert len(failed) == 2 and (s.start_step, s.step) == (8, 10)
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == 2 and "Input/output error (injected)" in retried[0]
    assert not list(workdir.glob("checkpoints/corrupt-*"))


def test_a_read_error_that_persists_is_reported_not_quarantined(tiny_data, eight_steps, tmp_path,
                                                                monkeypatch):
    from boost_jax.checkpointing.checkpointer import READ_ATTEMPTS, CheckpointReadError

    workdir = _copy(eight_steps, tmp_path)
    before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    metrics = (workdir / "metrics.jsonl").read_bytes()
    failed = _failing_reads(monkeypatch, 8, times=100)
    with pytest.raises(CheckpointReadError) as err:
        run(_cfg(tiny_data, 10), workdir, ONE)
    assert len(failed) == READ_ATTEMPTS
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("could not read checkpoint 8's arrays")
    assert "left in place" in msg and "Input/output error (injected)" in msg
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
    assert (workdir / "metrics.jsonl").read_bytes() == metrics
    monkeypatch.undo()  # the storage is back: the run resumes from step 8
    assert run(_cfg(tiny_data, 9), workdir, ONE).start_step == 8


def test_an_optimizer_state_of_another_shape_is_a_mismatch(tiny_data, eight_steps, tmp_path,
                                                           monkeypatch):
    """An upgrade that changes the optimizer state's tree (simulated: one more count in the
    chain): one line naming the first difference, nothing moved; the old version resumes."""
    import optax

    from boost_jax.optim import make_optimizer
    from boost_jax.train import loop
    from boost_jax.train.resume import ResumeMismatch

    def upgraded(train, model=None):
        opt = make_optimizer(train, model)
        return dataclasses.replace(opt, tx=optax.chain(opt.tx, optax.scale_by_schedule(
            lambda count: 1.0)))

    workdir = _copy(eight_steps, tmp_path)
    before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    monkeypatch.setattr(loop, "make_optimizer", upgraded)
    with pytest.raises(ResumeMismatch) as err:
        run(_cfg(tiny_data, 10), workdir, ONE)
    msg = str(err.value)
    assert msg.startswith("checkpoint 8's state does not fit this run's: opt_state.0.0.count "
                          "is in this run's state, not in the checkpoint (")
    assert "nothing was moved" in msg and "\n" not in msg
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
    monkeypatch.undo()
    assert run(_cfg(tiny_data, 9), workdir, ONE).start_step == 8


def test_a_truncated_data_file_is_damage_by_the_recorded_sizes(tiny_data, eight_steps,
                                                               tmp_path, monkeypatch, caplog):
    """Guards Checkpointer's size record (checkpoint.SIZES): the newest checkpoint's largest
    data file cut to half (TensorStore then says OUT_OF_RANGE, which alone proves nothing: a
    storage error) keeps failing, its size is not the one recorded at save, so it is damage:
    moved aside, and the run resumes from checkpoint 4 -- instead of stopping with "left in
    place" at every rerun."""
    from boost_jax.checkpointing import checkpointer as checkpoint

    monkeypatch.setattr(checkpoint, "RETRY_DELAY_S", 0.0)
    workdir = _copy(eight_steps, tmp_path)
    step8 = workdir / "checkpoints" / "8"
    recorded = json.loads((step8 / checkpoint.SIZES).read_text())
    biggest = max((p for p in step8.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    name = str(biggest.relative_to(step8))
    assert recorded[name] == biggest.stat().st_size and len(recorded) > 10
    biggest.write_bytes(biggest.read_bytes()[:biggest.stat().st_size // 2])
    caplog.set_level("WARNING")
    s = run(_cfg(tiny_data, 9), workdir, ONE)
    assert (s.start_step, s.step) == (4, 9)
    assert (f"its files are not those saved: {name} is {recorded[name] // 2:,} bytes, "
            f"{recorded[name]:,} bytes when it was saved") in caplog.text
    assert [p.name.split("-")[:2] for p in (workdir / "checkpoints").glob("corrupt-*")] == [
        ["corrupt", "8"]]
