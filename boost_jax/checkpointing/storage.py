"""Where checkpoints live -- a local directory, or a prefix in an object store
(``s3://bucket/run``, ``gs://bucket/run``) -- and the file operations the checkpoint code does
there, every one through :class:`etils.epath.Path` (what orbax itself uses), so that a local
path behaves exactly as before and an object store's key prefix is never taken for a local
directory.

What an object store needs (the ``cloud`` extra, pyproject.toml):

- **files** (step listing, metadata, temporaries): epath reaches ``s3://`` and ``gs://``
  through fsspec, i.e. ``s3fs`` and ``gcsfs``; orbax lists ``gs://`` steps with
  ``google-cloud-storage`` (its hierarchical-namespace check).
- **arrays**: orbax writes them through TensorStore, and builds TensorStore's kvstore spec
  itself, for local files and ``gs://`` only (orbax-checkpoint 0.12.8; any other path fails
  "Checkpoint path should be absolute"; google/orbax#872 asks for a hook, open). For ``s3://``,
  :func:`install_s3_kvstore` wraps orbax's private builder (:mod:`boost_jax.compat`, pinned in
  pyproject.toml) to give TensorStore's own ``s3`` driver, with the endpoint of
  ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (the AWS SDK's variables, which s3fs reads
  and TensorStore does not) and the region of ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` when set;
  credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``)
  when set, else from TensorStore's and botocore's default chains (profiles, instance roles).
- **commits by a marker**: a rename there is a copy of every object, not atomic, so a save is
  written in place and committed by orbax's ``commit_success.txt`` (orbax's ``COMMIT_FILE``
  atomicity, what it does for ``gs://`` by default); a step without it is not a checkpoint.
- **moving a step aside** (quarantine) is a server-side copy and delete of each object
  (:func:`move_aside`), its commit marker last, so that a move cut short leaves a checkpoint
  that is still listed, still damaged, and moved aside again at the next restore: nothing is
  deleted unread.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import re
import shutil
import threading
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from boost_jax import compat
from boost_jax.errors import ConfigError

#: object-store scheme -> ``(import name, pip name)`` of what reaching it needs
OBJECT_STORES: dict[str, tuple[tuple[str, str], ...]] = {
    "s3": (("s3fs", "s3fs"),),
    "gs": (("gcsfs", "gcsfs"), ("google.cloud.storage", "google-cloud-storage")),
}
EXTRAS = {"s3": "s3", "gs": "gcs"}  #: the extra of pyproject.toml that installs them
COMMIT_MARKER = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE  # orbax's "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's record of a step's save (its timestamps)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(path: str | os.PathLike) -> str | None:
    """The URL scheme of ``path`` (``"s3"``, ``"gs"``), None for a local path."""
    match = _URL.match(os.fspath(path))
    return match.group(1).lower() if match else None


def on_object_store(path: str | os.PathLike) -> bool:
    return scheme(path) is not None


def missing_packages(url_scheme: str) -> list[str]:
    """The pip names of what ``url_scheme`` needs and this environment lacks."""
    out = []
    for module, package in OBJECT_STORES[url_scheme]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package (google.cloud)
            found = False
        if not found:
            out.append(package)
    return out


def checkpoint_path(directory: str | os.PathLike) -> epath.Path:
    """``directory`` as the checkpoint code addresses it: a local path made absolute (orbax
    takes absolute paths only), an ``s3://`` or ``gs://`` URL as it is (trailing slashes
    dropped). Raises :class:`ConfigError` (one line) for another scheme or a missing package
    (``pip install 'boost_jax[s3]'``, ``[gcs]``, ``[cloud]``: both); on ``s3://`` installs
    :func:`install_s3_kvstore`."""
    text = os.fspath(directory)
    url_scheme = scheme(text)
    if url_scheme is None:
        return epath.Path(pathlib.Path(text).absolute())  # as before: ".." kept
    if url_scheme not in OBJECT_STORES:
        raise ConfigError(f"checkpoints at {text}: {url_scheme}:// is not supported (local "
                          f"paths, {', '.join(f'{s}://' for s in OBJECT_STORES)})")
    missing = missing_packages(url_scheme)
    if missing:
        raise ConfigError(f"checkpoints at {text} need {', '.join(missing)}: pip install "
                          f"'boost_jax[{EXTRAS[url_scheme]}]'")
    if url_scheme == "s3":
        install_s3_kvstore()
    return epath.Path(text.rstrip("/"))


def atomicity(directory: epath.Path) -> ocp.options.AtomicityOptions | None:
    """How orbax commits a save under ``directory``: a marker file on an object store, orbax's
    default (a rename of the finished temporary directory) on a local disk."""
    if not on_object_store(directory):
        return None
    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def _never_committed(step: epath.Path) -> bool:
    """A step directory on an object store that a save began and never committed: no commit
    marker, and orbax's metadata of it, which a commit completes, without a commit time
    (anything else, e.g. a checkpoint copied there by hand, is left alone)."""
    if not step.name.isdigit() or (step / COMMIT_MARKER).exists():
        return False
    try:
        meta = json.loads((step / STEP_METADATA).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("commit_timestamp_nsecs") is None


def unfinished_saves(directory: epath.Path, tmp_mark: str) -> list[epath.Path]:
    """The saves under ``directory`` that never completed (a run killed while writing), oldest
    name first: orbax's temporary directories (``<step><tmp_mark>...``), and on an object store
    the steps it began in place and never committed."""
    if not directory.exists():
        return []
    entries = list(directory.iterdir())
    stale = [p for p in entries if tmp_mark in p.name]
    if on_object_store(directory):
        stale += [p for p in entries if _never_committed(p)]
    return sorted(stale, key=lambda p: p.name)


def remove(path: epath.Path) -> None:
    """Delete the tree at ``path`` (best effort, as ``shutil.rmtree(ignore_errors=True)``)."""
    try:
        path.rmtree()
    except OSError:
        pass


def file_sizes(directory: epath.Path, prefix: str = "") -> dict[str, int]:
    """``{path relative to directory: size in bytes}`` of every file under ``directory`` (a
    listing per folder: epath globs no ``**`` on object stores)."""
    sizes = {}
    for path in directory.iterdir():
        if path.is_dir():
            sizes.update(file_sizes(path, f"{prefix}{path.name}/"))
        else:
            sizes[prefix + path.name] = path.stat().length
    return sizes


def free_bytes(directory: epath.Path) -> int | None:
    """Free bytes on the local disk holding ``directory``; None on an object store or when it
    does not exist."""
    if on_object_store(directory) or not directory.exists():
        return None
    return shutil.disk_usage(os.fspath(directory)).free


def move_aside(src: epath.Path, dest: epath.Path) -> None:
    """Move the step directory ``src`` to ``dest`` (same parent): a rename on a local disk.

    On an object store (where epath's directory rename fails: fsspec copies the "folders" too,
    which are no objects there) every object is copied server-side with fsspec, epath's
    backend, then the originals are deleted, the commit marker last: cut short anywhere, the
    step is still listed and still damaged, and the next restore moves what is left of it
    aside again."""
    if not on_object_store(src):
        src.rename(dest)
        return
    fs = compat.epath_filesystem(os.fspath(src))  # epath's own instance (its listing cache)
    root, target = (compat.strip_protocol(fs, os.fspath(p)) for p in (src, dest))
    keys = fs.find(root)
    if not keys:
        return
    fs.copy(keys, [target + k[len(root):] for k in keys])
    marker = f"{root}/{COMMIT_MARKER}"
    rest = [k for k in keys if k != marker]
    if rest:
        fs.rm(rest)
    if marker in keys:
        fs.rm(marker)


# --- s3:// arrays: TensorStore's s3 driver under orbax ------------------------------------

_LOCK = threading.Lock()


def _s3_spec(gcs: dict) -> dict:
    """TensorStore's ``s3`` kvstore for what orbax built as a ``gcs`` one (same bucket and
    key prefix), with the endpoint and region the environment names."""
    spec = {"driver": "s3", "bucket": gcs["bucket"], "path": gcs.get("path", "")}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        spec["endpoint"] = endpoint
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # else TensorStore's default chain, which logs
        spec["aws_credentials"] = {"type": "environment"}  # 5 lines for each missing ~/.aws file
    return spec


def as_s3(spec: Any) -> Any:
    """``spec`` (a kvstore spec orbax built for ``gs://``) with each ``gcs`` / ``gcs_grpc``
    kvstore in it replaced by :func:`_s3_spec`; a spec without one is returned unchanged."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc"):
            return _s3_spec(spec)
        return {k: as_s3(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [as_s3(v) for v in spec]
    return spec


def _s3_kvstores(build):
    """orbax's kvstore builder, with ``s3://`` directories built as the ``gs://`` one of the
    same bucket and path (orbax's object-store settings: larger data files, coalesced reads)
    and then given TensorStore's ``s3`` driver (:func:`as_s3`)."""
    @functools.wraps(build)
    def build_kvstore(directory, *args, **kwargs):
        text = os.fspath(directory)
        if scheme(text) != "s3":
            return build(directory, *args, **kwargs)
        built = build("gs://" + text[len("s3://"):], *args, **kwargs)
        spec = as_s3(built)
        if spec == built:  # no gcs kvstore in it to replace
            raise RuntimeError(
                f"orbax-checkpoint {compat.orbax_version()} built no gcs kvstore for a gs:// "
                f"path ({spec}); checkpoints on s3:// cannot be written: install a tested "
                "orbax-checkpoint (pyproject.toml)")
        return spec

    build_kvstore.unwrapped = build
    return build_kvstore


def install_s3_kvstore() -> None:
    """Install, once per process (thread-safe), the wrapper that makes orbax read and write
    the arrays of ``s3://`` checkpoints with TensorStore's ``s3`` driver; nothing else
    changes. Raises a one-line RuntimeError when the installed orbax moved its builder."""
    with _LOCK:
        build = compat.orbax_kvstore_builder()
        if getattr(build, "unwrapped", None) is None:
            compat.set_orbax_kvstore_builder(_s3_kvstores(build))
