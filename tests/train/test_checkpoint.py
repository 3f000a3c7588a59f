"""Nothing lost, nothing poisoned: checkpoints verified on restore, no silent fresh start, an
append-only metrics history, stale temporaries, a full disk (train/checkpoint.py, metrics.py,
integrity.py)."""

import errno
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.config import ConfigError
from boost_jax.train.checkpoint import CheckpointWriteError
from boost_jax.train.integrity import fingerprint, verify
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


def test_fingerprint_is_layout_free_and_sees_one_changed_bit():
    mesh = jax.make_mesh((8,), ("x",))
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 7
    tree = {"w": x, "b": x.astype(jnp.bfloat16), "n": jnp.int32(3)}
    sharded = dict(tree, w=jax.device_put(x, NamedSharding(mesh, P("x"))))
    sums, bad = fingerprint(tree)
    assert fingerprint(sharded) == (sums, []) and bad == []
    flipped = x.at[5, 2].set(jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x[5, 2], jnp.uint32) ^ 1, jnp.float32))
    assert fingerprint(dict(tree, w=flipped))[0]["['w']"] != sums["['w']"]
    swapped = x.at[0].set(x[1]).at[1].set(x[0])  # moved data
    assert fingerprint(dict(tree, w=swapped))[0]["['w']"] != sums["['w']"]
    assert verify(tree, sums) is None
    assert "checksum mismatch in 1 array(s), e.g. ['w']" in verify(dict(tree, w=flipped), sums)
    assert "non-finite values" in verify(dict(tree, w=x.at[0, 0].set(jnp.nan)), None)


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
    if damage == "other-state":
        assert "checksum mismatch" in warned[0]
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
