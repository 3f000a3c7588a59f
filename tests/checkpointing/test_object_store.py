"""Checkpoints on an object store, end to end, against local emulators this module starts
(moto's S3 server; gcp-storage-emulator for GCS): saved and listed in the bucket (nothing on
the local disk), chunk checksums on, a damaged chunk object quarantined with every object
moved, a save killed before its commit removed, the run's files folder (``run/``) never taken
for a step, and a trainer killed with SIGKILL that resumes exactly on a fresh workdir.

gcp-storage-emulator sends no ``x-goog-generation`` header with an object's bytes, which
TensorStore's gcs driver reads the generation from (GCS sends it): the fixture adds it
(:func:`_send_generations`), without which the trainer's saves on ``gs://`` fail.

Each scheme needs its extra and its emulator (``pip install 'boost_jax[s3]' 'moto[server]'``,
``pip install 'boost_jax[gcs]' gcp-storage-emulator``) and is skipped with that reason
otherwise. Only the checkpoint code's public API is used here, so that the same tests run
against an older checkpoint code (which made ``s3://...`` a local directory) and fail there."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.checkpointing.checkpointer import Checkpointer
from tests.train.test_cli import FAULTS, _cmd, _env, _tiny_gin
from tests.train.test_trainer import _losses

MARKER = "commit_success.txt"  # orbax's commit marker of a step saved in place
#: scheme -> what its emulator and the code need (import names), and how to install them
NEEDS = {"s3": (("s3fs", "moto", "boto3"), "pip install 'boost_jax[s3]' 'moto[server]'"),
         "gs": (("gcsfs", "google.cloud.storage", "gcp_storage_emulator"),
                "pip install 'boost_jax[gcs]' gcp-storage-emulator")}


class _Bucket:
    """A bucket of an emulator, listed and damaged through the store's own client (boto3,
    google-cloud-storage), not through the code tested."""

    def __init__(self, emulator: _Emulator, name: str):
        self.emulator, self.name = emulator, name
        self.url = f"{emulator.scheme}://{name}"
        emulator.create(name)

    def sizes(self, prefix: str = "") -> dict[str, int]:
        return self.emulator.sizes(self.name, prefix)

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(self.sizes(prefix))

    def committed(self, prefix: str) -> list[int]:
        """The steps under ``prefix`` with orbax's commit marker."""
        keys = self.keys(prefix + "/")
        return sorted(int(k.split("/")[-2]) for k in keys
                      if k.endswith("/" + MARKER) and k.split("/")[-2].isdigit()
                      and k.count("/") == prefix.count("/") + 2)

    def rot(self, prefix: str, nbytes: int = 4096) -> str:
        """Random bytes written inside the largest object under ``prefix`` (its size
        unchanged, as tests/checkpointing/test_checkpointer.py's ``_rot`` does on a disk); its
        key."""
        sizes = self.sizes(prefix)
        key = max(sizes, key=sizes.get)
        data = bytearray(self.emulator.read(self.name, key))
        start = len(data) // 3
        n = min(nbytes, len(data) - start)
        data[start:start + n] = np.random.default_rng(0).integers(0, 256, n,
                                                                  dtype=np.uint8).tobytes()
        self.emulator.write(self.name, key, bytes(data))
        return key


class _Emulator:
    """A local object-store server (moto's S3, or gcp-storage-emulator's GCS) and the
    environment that points every client at it."""

    def __init__(self, scheme: str, endpoint: str, env: dict[str, str]):
        self.scheme, self.endpoint, self.env = scheme, endpoint, env
        if scheme == "s3":
            import boto3

            self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")
        else:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self.gcs = storage.Client(project="test", credentials=AnonymousCredentials(),
                                      client_options={"api_endpoint": endpoint})

    def bucket(self, name: str) -> _Bucket:
        return _Bucket(self, name)

    def create(self, bucket: str) -> None:
        if self.scheme == "s3":
            self.s3.create_bucket(Bucket=bucket)
        else:
            self.gcs.create_bucket(bucket)

    def sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        if self.scheme == "gs":
            return {b.name: b.size for b in self.gcs.list_blobs(bucket, prefix=prefix)}
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}

    def read(self, bucket: str, key: str) -> bytes:
        if self.scheme == "gs":
            return self.gcs.bucket(bucket).blob(key).download_as_bytes()
        return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    def write(self, bucket: str, key: str, data: bytes) -> None:
        if self.scheme == "gs":
            self.gcs.bucket(bucket).blob(key).upload_from_string(data)
        else:
            self.s3.put_object(Bucket=bucket, Key=key, Body=data)

    def kvstore(self, bucket: str, prefix: str) -> dict:
        """TensorStore's kvstore of ``prefix`` in ``bucket`` (to read what orbax wrote)."""
        if self.scheme == "gs":  # the endpoint: TENSORSTORE_GCS_HTTP_URL
            return {"driver": "gcs", "bucket": bucket, "path": prefix}
        return {"driver": "s3", "bucket": bucket, "path": prefix, "endpoint": self.endpoint,
                "aws_region": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(scheme: str) -> tuple[object, str, dict[str, str]]:
    """The emulator of ``scheme`` serving on a free local port: ``(server, endpoint, the
    environment that points the clients at it, with fake credentials)``."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    if scheme == "s3":  # s3fs reads AWS_ENDPOINT_URL; boost_jax hands it to TensorStore
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
    else:  # gcsfs and google-cloud-storage read STORAGE_EMULATOR_HOST, TensorStore its own
        from gcp_storage_emulator.server import create_server

        server = create_server("127.0.0.1", port, in_memory=True)
        env = {"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": endpoint,
               "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing", "GOOGLE_CLOUD_PROJECT": "test"}
    server.start()
    for name in ("werkzeug", "gcp_storage_emulator", "gcsfs"):  # a line per request otherwise
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return server, endpoint, env


@contextlib.contextmanager
def emulated(scheme: str) -> Iterator[_Emulator]:
    """An object-store emulator of ``scheme`` on a free local port (moto's S3 server;
    gcp-storage-emulator for GCS) and this process's environment pointing at it, while the
    block runs; the test is skipped, saying what to install, where the packages are missing.
    (Shared with tests/checkpointing/test_object_store_runs.py.)"""
    modules, install = NEEDS[scheme]
    missing = [m for m in modules if not _importable(m)]
    if missing:
        pytest.skip(f"checkpoints on {scheme}:// need {', '.join(missing)}: {install}")
    with pytest.MonkeyPatch.context() as mp:
        if scheme == "gs":
            _send_generations(mp)
        _forget_clients()
        server, endpoint, env = _start(scheme)
        try:
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION",
                         "AWS_SESSION_TOKEN"):
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            yield _Emulator(scheme, endpoint, env)
        finally:
            server.stop()
            _forget_clients()


def _forget_clients() -> None:
    """Drop the object-store filesystems that fsspec and epath keep for the process: they
    hold the endpoint of the emulator they were made for (another module's, stopped)."""
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
    for module, cls in (("s3fs", "S3FileSystem"), ("gcsfs", "GCSFileSystem")):
        if _importable(module):
            getattr(importlib.import_module(module), cls).clear_instance_cache()


def _send_generations(mp: pytest.MonkeyPatch) -> None:
    """gcp-storage-emulator's media downloads with the ``x-goog-generation`` and
    ``x-goog-metageneration`` headers that GCS sends with every object's bytes (the emulator
    omits them): TensorStore's gcs driver takes a read's generation from that header alone,
    and without it its revalidating re-read of an OCDBT manifest fails "Malformed
    StorageGeneration". The emulator's HTTP server is single-threaded, so the object's record
    read here is that of the bytes just served."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    download = objects.download

    def with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"],
                                       request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj["metageneration"])

    mp.setattr(objects, "download", with_generation)  # objects.get(alt=media) calls it
    mp.setattr(server, "HANDLERS", tuple(
        (regex, {method: with_generation if handler is download else handler
                 for method, handler in handlers.items()})
        for regex, handlers in server.HANDLERS))


@pytest.fixture(scope="module", params=["s3", "gs"])
def store(request):
    """:func:`emulated` for this module only."""
    with emulated(request.param) as emulator:
        yield emulator


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def _tracebacks(stderr: str) -> list[str]:
    """The tracebacks in ``stderr`` but the emulator's own (gcp-storage-emulator's HTTP server
    prints one for each connection a client drops)."""
    return [t for t in stderr.split("Traceback (most recent call last):")[1:]
            if "socketserver.py" not in t]


def _state(step: int) -> dict:
    w = jax.random.normal(jax.random.key(step), (128, 128), jnp.float32)  # incompressible
    return {"step": jnp.int32(step), "params": {"w": w}, "opt_state": {"mu": w / 3}}


def _target(state: dict) -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)


def _chunk_checksum_on(store: _Emulator, bucket: str, state_prefix: str, array: str) -> bool:
    """Whether the Zarr v3 array ``array`` of a state saved under ``state_prefix`` has zstd's
    chunk checksum on, read from its ``zarr.json`` in orbax's OCDBT store on the bucket."""
    import tensorstore as ts

    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": store.kvstore(
        bucket, state_prefix + "/")}).result()
    meta = json.loads(kvstore.read(f"{array}/zarr.json").result().value)
    (zstd,) = [c for c in meta["codecs"][0]["configuration"]["codecs"] if c["name"] == "zstd"]
    return zstd.get("configuration", {}).get("checksum", False)


def test_checkpoints_are_verified_and_damage_is_moved_aside(store, tmp_path, monkeypatch,
                                                             caplog, capfd):
    """Saved as objects of the bucket (nothing on the local disk), with chunk checksums; a
    chunk object damaged in the bucket: restore reports it in one line, moves every object of
    that step under ``corrupt-4-<time>/`` and restores step 2; a fresh checkpointer lists 2."""
    monkeypatch.chdir(tmp_path)  # where a local directory named "s3:" or "gs:" would appear
    bucket = store.bucket("unit")
    url = f"{bucket.url}/run/checkpoints"
    ckpt = Checkpointer(url, keep=3)
    for step in (2, 4):
        ckpt.save(step, _state(step), {"step": step}, wait=True)
    assert ckpt.steps() == [2, 4] and str(ckpt.directory) == url
    assert bucket.committed("run/checkpoints") == [2, 4]
    assert list(tmp_path.iterdir()) == []
    assert _chunk_checksum_on(store, bucket.name, "run/checkpoints/4/state", "params.w")
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
    err = capfd.readouterr().err
    assert _tracebacks(err) == [] and "Event loop is closed" not in err


def test_a_save_never_committed_is_removed_at_start(store, tmp_path, monkeypatch, caplog):
    """A save whose commit never came (its process killed before the marker: simulated by a
    commit that does nothing) is no checkpoint, and the next checkpointer removes it."""
    from orbax.checkpoint._src.path import atomicity

    monkeypatch.chdir(tmp_path)
    bucket = store.bucket("uncommitted")
    url = f"{bucket.url}/ckpt"
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


def test_the_run_files_folder_is_never_a_step(store, tmp_path, monkeypatch):
    """``<checkpoint_dir>/run/`` (the run's files, checkpointing/run_files.py) beside the steps:
    never
    listed as a step (by the checkpointer or boost_jax.eval's listing), never removed as an
    unfinished save, never moved aside with a damaged step, never deleted by ``keep``."""
    from boost_jax.checkpointing.run_files import RunFiles
    from boost_jax.train.trained import checkpoint_steps

    monkeypatch.chdir(tmp_path)
    bucket = store.bucket("runfiles")
    url = f"{bucket.url}/ckpt"
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.gin").write_text("Train.steps = 8\n")
    (work / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert RunFiles(work, url).upload() == ["config.gin", "metrics.jsonl"]
    files = {k: store.read(bucket.name, k) for k in bucket.keys("ckpt/run/")}
    assert sorted(files) == ["ckpt/run/config.gin", "ckpt/run/metrics.jsonl"]
    ckpt = Checkpointer(url, keep=2)
    for step in (2, 4):
        ckpt.save(step, _state(step), {}, wait=True)
    ckpt.close()
    bucket.rot("ckpt/4/state/")
    again = Checkpointer(url, keep=2)  # (its clean-up of unfinished saves ran)
    assert again.steps() == [2, 4] and checkpoint_steps(url) == [2, 4]
    assert again.restore_latest(_target(_state(4))).step == 2
    (moved,) = again.quarantined
    assert moved.name.startswith("corrupt-4-")
    for step in (6, 8):  # keep=2: orbax deletes step 2
        again.save(step, _state(step), {}, wait=True)
    again.close()
    assert Checkpointer(url, keep=2).steps() == [6, 8] and checkpoint_steps(url) == [6, 8]
    assert {k: store.read(bucket.name, k) for k in bucket.keys("ckpt/run/")} == files


def test_the_lease_on_a_bucket(store):
    """Guards checkpointing/lease.py on S3 and GCS: the lease is an object under
    ``<checkpoint_dir>/run/`` (never a step); a second run is refused once the holder's renewal
    shows it alive; a clean end deletes the lease, and the next run takes it at once."""
    from boost_jax.checkpointing.lease import CheckpointDirBusy, Lease

    bucket = store.bucket("lease")
    url = f"{bucket.url}/ckpt"
    with Lease(url, ttl_s=30, renew_s=0.2, settle_s=0):
        assert bucket.keys("ckpt/") == ["ckpt/run/lease.json"]
        with pytest.raises(CheckpointDirBusy, match="is in use by another run: pid "):
            with Lease(url, ttl_s=30, renew_s=0.2, settle_s=0):
                pass
    assert bucket.keys("ckpt/") == []
    with Lease(url, ttl_s=30, renew_s=0.2, settle_s=0):
        pass


def _killed_run_gin(data: Path) -> list[str]:
    return [*_tiny_gin(data), "Train.steps=10", "Train.schedule_steps=10",
            "Train.checkpoint_every=2", "Parallel.data=1", "Parallel.tensor=1",
            "Parallel.tp_plan='none'"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory) -> dict[int, float]:
    """The losses of the killed run's configuration, run through on a local disk (one run for
    both schemes)."""
    ref = tmp_path_factory.mktemp("uninterrupted")
    out = subprocess.run(_cmd(ref, *_killed_run_gin(tiny_data)), capture_output=True,
                         text=True, env=_env(), timeout=600, cwd=ref)
    assert out.returncode == 0, out.stderr[-2000:]
    return _losses(ref)


#: CI runs the killed run on the S3 emulator (``emulator_run``); on GCS's with ``-m slow``:
#: what differs between the schemes under it -- verification, quarantine, unfinished saves,
#: the run's files -- the unmarked tests above check on both
@pytest.mark.slow
@pytest.mark.parametrize("store", [pytest.param("s3", marks=pytest.mark.emulator_run), "gs"],
                         indirect=True)
def test_a_run_killed_resumes_exactly_and_damage_is_quarantined(store, tiny_data, tmp_path,
                                                                uninterrupted):
    """``python -m boost_jax.train`` with its checkpoints on the object store: SIGKILL while
    checkpoint 6 is being committed, then a resume on a fresh machine (a new, empty workdir;
    the same --checkpoint_dir): the unfinished save removed, the run's history taken from the
    bucket (checkpointing/run_files.py) and steps 1..10 logged once each, with the losses of an
    uninterrupted run (fp32). Then a chunk object of the newest checkpoint (10) is damaged in
    the bucket: the next run moves that step aside (every object), resumes from 8 and trains
    steps 9 and 10 to the same losses again."""
    gin = _killed_run_gin(tiny_data)
    bucket = store.bucket("train")
    url = f"{bucket.url}/run/checkpoints"
    work, fresh = tmp_path / "work", tmp_path / "fresh"  # the second machine's workdir
    env = dict(_env(), **store.env, PYTHONPATH=os.pathsep.join(
        [FAULTS, *filter(None, [os.environ.get("PYTHONPATH")])]))

    def train(workdir: Path = fresh, **fault: str) -> subprocess.CompletedProcess:
        return subprocess.run([*_cmd(workdir, *gin), f"--checkpoint_dir={url}"],
                              capture_output=True, text=True,
                              env=dict(env, **fault), timeout=600, cwd=tmp_path)

    out = train(work, BOOST_JAX_FAULT_KILL="6:commit")
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert bucket.committed("run/checkpoints") == [2, 4]
    assert bucket.keys("run/checkpoints/6/")  # written, not committed
    out = train()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "removed 1 unfinished checkpoint save(s) of an earlier run: 6" in out.stderr
    assert f"resumed from {url}/4 at step 4" in out.stdout
    assert bucket.committed("run/checkpoints") == [6, 8, 10]
    assert _logged_once(fresh) and _losses(fresh) == uninterrupted
    assert not (fresh / "checkpoints").exists() and not list(tmp_path.glob(f"{store.scheme}*"))

    before = bucket.keys("run/checkpoints/10/")
    bucket.rot("run/checkpoints/10/state/")
    out = train()
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "is damaged" in x]
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr
    assert "checkpoint 10 is damaged" in line and "moved aside to corrupt-10-" in line
    assert f"resumed from {url}/8 at step 8" in out.stdout
    (moved,) = {k.split("/")[2] for k in bucket.keys("run/checkpoints/corrupt-10-")}
    assert [k.replace(f"/{moved}/", "/10/") for k in
            bucket.keys(f"run/checkpoints/{moved}/")] == before
    assert bucket.committed("run/checkpoints") == [6, 8, 10]
    assert _logged_once(fresh) and _losses(fresh) == uninterrupted
    assert store.read(bucket.name, "run/checkpoints/run/metrics.jsonl") == (
        fresh / "metrics.jsonl").read_bytes()


def _logged_once(workdir: Path) -> bool:
    """Whether ``workdir``'s metrics.jsonl logs each step's loss once (steps 1..n)."""
    steps = [r["step"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text()
                                    .splitlines()) if "loss" in r]
    return steps == list(range(1, len(steps) + 1))
