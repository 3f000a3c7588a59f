"""Checkpoints on an object store, end to end, against a local S3 emulator this module starts
(moto's server mode): saved and listed in the bucket (nothing on the local disk), chunk
checksums on, a damaged chunk object quarantined with every object moved, a save killed before
its commit removed, and a trainer killed with SIGKILL that resumes exactly.

Needs the ``cloud`` extra and moto (``pip install 'boost_jax[cloud]' 'moto[server]'``);
skipped with that reason otherwise. Only the checkpoint code's public API is used here, so that
the same tests run against an older checkpoint code (which made ``s3://...`` a local
directory) and fail there."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.train.checkpoint import Checkpointer
from tests.train.test_cli import FAULTS, _cmd, _env, _tiny_gin
from tests.train.test_trainer import _losses

NEEDS = ("s3fs", "moto", "boto3")
MARKER = "commit_success.txt"  # orbax's commit marker of a step saved in place


class _Bucket:
    """A bucket of the emulator, read and damaged with boto3 (not through the code tested)."""

    def __init__(self, client, name: str):
        self.client, self.name = client, name
        client.create_bucket(Bucket=name)

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name,
                                                                       Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def committed(self, prefix: str) -> list[int]:
        """The steps under ``prefix`` with orbax's commit marker."""
        keys = self.keys(prefix + "/")
        return sorted(int(k.split("/")[-2]) for k in keys
                      if k.endswith("/" + MARKER) and k.split("/")[-2].isdigit()
                      and k.count("/") == prefix.count("/") + 2)

    def rot(self, prefix: str, nbytes: int = 4096) -> str:
        """Random bytes written inside the largest object under ``prefix`` (its size
        unchanged, as tests/train/test_checkpoint.py's ``_rot`` does on a disk); its key."""
        sizes = {o["Key"]: o["Size"] for page in self.client.get_paginator(
            "list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
            for o in page.get("Contents", [])}
        key = max(sizes, key=sizes.get)
        data = bytearray(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())
        start = len(data) // 3
        n = min(nbytes, len(data) - start)
        data[start:start + n] = np.random.default_rng(0).integers(0, 256, n,
                                                                  dtype=np.uint8).tobytes()
        self.client.put_object(Bucket=self.name, Key=key, Body=bytes(data))
        return key


class _Emulator:
    def __init__(self, endpoint: str, env: dict[str, str]):
        import boto3

        self.endpoint, self.env = endpoint, env
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")

    def bucket(self, name: str) -> _Bucket:
        return _Bucket(self.client, name)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free local port, and this process's environment pointing at it
    (fake credentials; the endpoint through ``AWS_ENDPOINT_URL``, which s3fs reads and
    boost_jax hands to TensorStore's s3 driver), for this module only."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"checkpoints on s3:// need {', '.join(missing)}: pip install "
                    "'boost_jax[cloud]' 'moto[server]'")
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN"):
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            yield _Emulator(endpoint, env)
    finally:
        server.stop()


def _state(step: int) -> dict:
    w = jax.random.normal(jax.random.key(step), (128, 128), jnp.float32)  # incompressible
    return {"step": jnp.int32(step), "params": {"w": w}, "opt_state": {"mu": w / 3}}


def _target(state: dict) -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)


def _chunk_checksum_on(endpoint: str, bucket: str, state_prefix: str, array: str) -> bool:
    """Whether the Zarr v3 array ``array`` of a state saved under ``state_prefix`` has zstd's
    chunk checksum on, read from its ``zarr.json`` in orbax's OCDBT store on the bucket."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": {
        "driver": "s3", "bucket": bucket, "path": state_prefix + "/", "endpoint": endpoint,
        "aws_region": "us-east-1"}}).result()
    meta = json.loads(store.read(f"{array}/zarr.json").result().value)
    (zstd,) = [c for c in meta["codecs"][0]["configuration"]["codecs"] if c["name"] == "zstd"]
    return zstd.get("configuration", {}).get("checksum", False)


def test_checkpoints_on_s3_are_verified_and_damage_is_moved_aside(s3, tmp_path, monkeypatch,
                                                                   caplog):
    """Saved as objects of the bucket (nothing on the local disk), with chunk checksums; a
    chunk object damaged in the bucket: restore reports it in one line, moves every object of
    that step under ``corrupt-4-<time>/`` and restores step 2; a fresh checkpointer lists 2."""
    monkeypatch.chdir(tmp_path)  # where a local directory named "s3:" would appear
    bucket = s3.bucket("unit")
    url = f"s3://{bucket.name}/run/checkpoints"
    ckpt = Checkpointer(url, keep=3)
    for step in (2, 4):
        ckpt.save(step, _state(step), {"step": step}, wait=True)
    assert ckpt.steps() == [2, 4] and str(ckpt.directory) == url
    assert bucket.committed("run/checkpoints") == [2, 4]
    assert list(tmp_path.iterdir()) == []
    assert _chunk_checksum_on(s3.endpoint, bucket.name, "run/checkpoints/4/state", "params.w")
    before = bucket.keys("run/checkpoints/4/")
    bucket.rot("run/checkpoints/4/state/")
    restored = ckpt.restore_latest(_target(_state(4)))
    ckpt.close()
    assert restored is not None and restored.step == 2
    assert np.array_equal(np.asarray(restored.state["params"]["w"]),
                          np.asarray(_state(2)["params"]["w"]))
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and warned[0].startswith("checkpoint 4")
    (moved,) = ckpt.quarantined
    assert moved.name.startswith("corrupt-4-") and str(moved) == f"{url}/{moved.name}"
    assert bucket.keys("run/checkpoints/4/") == []  # every object moved, none left or lost
    assert [k.replace(f"/{moved.name}/", "/4/") for k in
            bucket.keys(f"run/checkpoints/{moved.name}/")] == before
    assert Checkpointer(url, keep=3).steps() == [2]
    assert list(tmp_path.iterdir()) == []


def test_a_save_never_committed_on_s3_is_removed_at_start(s3, tmp_path, monkeypatch, caplog):
    """A save whose commit never came (its process killed before the marker: simulated by a
    commit that does nothing) is no checkpoint, and the next checkpointer removes it."""
    from orbax.checkpoint._src.path import atomicity

    monkeypatch.chdir(tmp_path)
    bucket = s3.bucket("uncommitted")
    url = f"s3://{bucket.name}/ckpt"
    ckpt = Checkpointer(url, keep=3)
    ckpt.save(2, _state(2), {}, wait=True)
    real = atomicity.CommitFileTemporaryPath.finalize

    async def killed_before_commit(self, *args, **kwargs):
        if self.get_final().name != "6":
            return await real(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.CommitFileTemporaryPath, "finalize", killed_before_commit)
    ckpt.save(6, _state(6), {}, wait=True)
    ckpt.close()
    monkeypatch.undo()
    assert bucket.committed("ckpt") == [2] and bucket.keys("ckpt/6/")
    caplog.set_level("INFO")
    again = Checkpointer(url, keep=3)
    assert again.steps() == [2] and bucket.keys("ckpt/6/") == []
    assert "removed 1 unfinished checkpoint save(s) of an earlier run: 6" in caplog.text
    assert again.restore_latest(_target(_state(2))).step == 2
    again.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_run_on_s3_killed_resumes_exactly_and_damage_is_quarantined(s3, tiny_data, tmp_path):
    """``python -m boost_jax.train`` with its checkpoints on ``s3://``: SIGKILL while checkpoint
    6 is being committed, then a plain resume: the losses of an uninterrupted run (fp32), the
    unfinished save removed. Then a chunk object of the newest checkpoint (10) is damaged in the
    bucket: the next run moves that step aside (every object), resumes from 8 and trains steps
    9 and 10 to the same losses again."""
    gin = [*_tiny_gin(tiny_data), "Train.steps=10", "Train.schedule_steps=10",
           "Train.checkpoint_every=2", "Parallel.data=1", "Parallel.tensor=1",
           "Parallel.tp_plan='none'"]
    ref = tmp_path / "ref"
    out = subprocess.run(_cmd(ref, *gin), capture_output=True, text=True, env=_env(),
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    bucket = s3.bucket("train")
    url = f"s3://{bucket.name}/run/checkpoints"
    work = tmp_path / "work"
    env = dict(_env(), **s3.env, PYTHONPATH=os.pathsep.join(
        [FAULTS, *filter(None, [os.environ.get("PYTHONPATH")])]), BOOST_JAX_TEST_CHECKPOINTS=url)

    def train(**fault: str) -> subprocess.CompletedProcess:
        return subprocess.run(_cmd(work, *gin), capture_output=True, text=True,
                              env=dict(env, **fault), timeout=600, cwd=tmp_path)

    out = train(BOOST_JAX_FAULT_KILL="6:commit")
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert bucket.committed("run/checkpoints") == [2, 4]
    assert bucket.keys("run/checkpoints/6/")  # written, not committed
    out = train()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "removed 1 unfinished checkpoint save(s) of an earlier run: 6" in out.stderr
    assert f"resumed from {url}/4 at step 4" in out.stdout
    assert bucket.committed("run/checkpoints") == [6, 8, 10]
    assert _losses(work) == _losses(ref)
    assert not (work / "checkpoints").exists() and not list(tmp_path.glob("s3*"))

    before = bucket.keys("run/checkpoints/10/")
    bucket.rot("run/checkpoints/10/state/")
    out = train()
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "is damaged" in x]
    assert "checkpoint 10 is damaged" in line and "moved aside to corrupt-10-" in line
    assert f"resumed from {url}/8 at step 8" in out.stdout
    (moved,) = {k.split("/")[2] for k in bucket.keys("run/checkpoints/corrupt-10-")}
    assert [k.replace(f"/{moved}/", "/10/") for k in
            bucket.keys(f"run/checkpoints/{moved}/")] == before
    assert bucket.committed("run/checkpoints") == [6, 8, 10]
    assert _losses(work) == _losses(ref)
