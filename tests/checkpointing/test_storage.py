"""Where checkpoints live (checkpointing/storage.py), without any storage server: local paths as
before, object-store URLs kept as URLs (never a local directory), what each scheme needs, and
the s3:// kvstore that orbax's private builder is wrapped to give (fails when orbax moves it)."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import orbax.checkpoint as ocp
import pytest
from etils import epath

from boost_jax import compat
from boost_jax.checkpointing import storage
from boost_jax.errors import ConfigError


def test_a_local_directory_is_made_absolute_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("run/checkpoints", pathlib.Path("run/checkpoints"), "run/../run/checkpoints/"):
        path = storage.checkpoint_path(given)
        assert isinstance(path, epath.Path)
        assert str(path) == str(pathlib.Path(given).absolute())  # ".." kept, as Path does
    assert storage.atomicity(storage.checkpoint_path("run")) is None  # orbax's rename
    assert not storage.on_object_store(tmp_path) and storage.scheme("/a/s3://b") is None


@pytest.mark.parametrize("url_scheme", ["s3", "gs"])
def test_an_object_store_url_stays_a_url(url_scheme):
    missing = storage.missing_packages(url_scheme)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: pip install "
                    f"'boost_jax[{storage.EXTRAS[url_scheme]}]'")
    path = storage.checkpoint_path(f"{url_scheme}://bucket/run/checkpoints/")
    url = f"{url_scheme}://bucket/run/checkpoints"
    assert os.fspath(path) == str(path) == url and storage.on_object_store(path)
    assert str(path / "4") == f"{url}/4" and (path / "4").name == "4"
    assert storage.checkpoint_path(path) == path
    options = storage.atomicity(path)
    assert options.mode == ocp.options.AtomicityMode.COMMIT_FILE  # committed by a marker


def test_what_a_scheme_needs_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^checkpoints at az://c/run: az:// is not supported "
                                          r"\(local paths, s3://, gs://\)$"):
        storage.checkpoint_path("az://c/run")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("s3fs", "gcsfs") else real(name, *a))
    with pytest.raises(ConfigError, match=r"^checkpoints at s3://b/run need s3fs: pip install "
                                          r"'boost_jax\[s3\]'$"):
        storage.checkpoint_path("s3://b/run")
    with pytest.raises(ConfigError, match=r"^checkpoints at gs://b/run need gcsfs(, "
                                          r"google-cloud-storage)?: pip install "
                                          r"'boost_jax\[gcs\]'$"):
        storage.checkpoint_path("gs://b/run")


def test_local_saves_never_committed_are_only_orbax_temporaries(tmp_path):
    """On a local disk (rename commits) a step directory is never taken for an unfinished
    save, with or without orbax's marker: only ``*.orbax-checkpoint-tmp*`` names are."""
    for name in ("4", "6", "8.orbax-checkpoint-tmp-17", "corrupt-2-1"):
        (tmp_path / name).mkdir()
    (tmp_path / "6" / storage.STEP_METADATA).write_text('{"init_timestamp_nsecs": 1}')
    stale = storage.unfinished_saves(storage.checkpoint_path(tmp_path), ".orbax-checkpoint-tmp")
    assert [p.name for p in stale] == ["8.orbax-checkpoint-tmp-17"]
    assert storage.unfinished_saves(storage.checkpoint_path(tmp_path / "none"), ".tmp") == []


def _gcs_built(directory: str, **kwargs) -> dict:
    return compat.orbax_kvstore_builder()(directory, **kwargs)


def test_orbax_kvstore_builder_gives_s3_for_s3_urls(monkeypatch):
    """The private builder exists and, for ``gs://``, builds ``gcs`` kvstores (what the
    wrapper turns into ``s3``); wrapped, an ``s3://`` directory gets TensorStore's ``s3`` driver
    with the endpoint and region of the environment, a local one what orbax builds."""
    storage.install_s3_kvstore()
    build = compat.orbax_kvstore_builder()
    assert callable(build.unwrapped)  # installed once, never twice
    storage.install_s3_kvstore()
    assert compat.orbax_kvstore_builder() is build
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:2")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    spec = build("s3://bkt/run/4/state", use_ocdbt=True)
    assert spec["driver"] == "ocdbt"
    assert spec["base"] == {"driver": "s3", "bucket": "bkt", "path": "run/4/state",
                            "endpoint": "http://s3-only:2", "aws_region": "eu-west-3"}
    assert build("s3://bkt/run/4/state", "_sharding", use_ocdbt=False) == {
        "driver": "s3", "bucket": "bkt", "path": "run/4/state/_sharding",
        "endpoint": "http://s3-only:2", "aws_region": "eu-west-3"}
    gcs = build.unwrapped("gs://bkt/run/4/state", use_ocdbt=True)
    assert gcs["base"]["driver"] in ("gcs", "gcs_grpc") and gcs["base"]["bucket"] == "bkt"
    assert storage.as_s3(gcs) == spec
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")  # then from the environment, not ~/.aws
    assert build("s3://bkt/x", use_ocdbt=False)["aws_credentials"] == {"type": "environment"}
    for local in ("/ckpt/4/state", "gs://bkt/run/4/state"):
        assert build(local, use_ocdbt=True) == build.unwrapped(local, use_ocdbt=True)


def test_orbax_kvstore_builder_moved_is_a_clear_error(monkeypatch):
    module, _ = compat.ORBAX_KVSTORE_BUILDER
    monkeypatch.setattr(compat, "ORBAX_KVSTORE_BUILDER", (module, "_gone"))
    with pytest.raises(RuntimeError, match=r"orbax-checkpoint \S+ has no .*\._gone .*; "
                                           r"checkpoints on s3:// cannot be written"):
        storage.install_s3_kvstore()
    wrapped = storage._s3_kvstores(lambda directory, *a, **k: {"driver": "file",
                                                                "path": directory})
    with pytest.raises(RuntimeError, match=r"built no gcs kvstore for a gs:// path"):
        wrapped("s3://bkt/x", use_ocdbt=False)
