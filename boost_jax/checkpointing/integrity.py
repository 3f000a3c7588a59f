"""What makes a restored train state trustworthy: checksummed chunks and a finite state.

**Chunk checksums.** The state is written in Zarr v3 (orbax's ``use_zarr3``), each chunk
compressed by zstd. Each :class:`~boost_jax.checkpointing.checkpointer.Checkpointer` claims its
directory (:class:`ChunkChecksums`), and every Zarr v3 array orbax writes under it gets the
zstd codec's ``checksum`` option: zstd stores a 32-bit XXH64 digest of each chunk's content in
its frame, and TensorStore checks it when it decompresses the chunk, so a byte flipped inside a
data file fails the read instead of restoring silently. Reading needs nothing: the codecs are
in each array's ``zarr.json``, so any Zarr v3 reader checks them.

orbax builds the codec chain itself and offers no option for it (nor any public hook into the
write spec), so :func:`install_chunk_checksums` wraps its private ``build_array_write_spec``
(:mod:`boost_jax.compat`, pinned in pyproject.toml and checked by tests/test_compat.py) once
per process, under a lock, and never swaps it again. The wrapper changes only the arrays
written under a claimed directory, with the decision that directory's save took
(:func:`chunk_checksums_off` in the thread that started it): it is taken per save and
travels with the directory, because orbax writes in threads of its own. Other threads'
checkpointers and orbax's other users in the process are unaffected.

Why zstd's digest and not Zarr v3's ``crc32c`` codec (which orbax puts on the shard index
only): both are the storage layer's own, both computed by TensorStore's writer threads during
orbax's background write, but the digest is taken while zstd already holds the chunk in cache,
the CRC in a separate pass: encoding 512 MiB of random floats, the CRC added 12 % to the zstd
encode, the digest 4 %. At the 1B shape on a 2-core CPU the digest costs 3 % of a save
(``python -m boost_jax.bench checkpoint``).

**A finite state of the right step.** :func:`verify` is one jitted reduction over the restored
state: every floating value finite, and the state's ``step`` counter equal to the checkpoint's
step (arrays that read perfectly but belong to another checkpoint).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath

from boost_jax import compat
from boost_jax.checkpointing import storage

STATE_FORMAT = "zarr3+zstd-checksum"  # recorded in a checkpoint's meta; absent: written without


def _compression(metadata: dict) -> list[dict]:
    """The zstd codec of each chunk inside orbax's ``sharding_indexed`` shards (none when
    uncompressed)."""
    (shard,) = metadata["codecs"]
    if shard.get("name") != "sharding_indexed":
        raise KeyError(shard.get("name"))
    return [c for c in shard["configuration"]["codecs"] if c["name"] == "zstd"]


def _with_chunk_checksum(metadata: dict) -> dict:
    """Zarr v3 ``metadata`` with zstd's chunk checksum on (edited in place; returned)."""
    for zstd in _compression(metadata):
        zstd.setdefault("configuration", {})["checksum"] = True
    return metadata


def _spec_metadata(spec: dict) -> dict:
    """The Zarr metadata of a TensorStore write spec (under a ``cast`` driver's ``base``)."""
    while "metadata" not in spec:
        spec = spec["base"]
    return spec["metadata"]


_LOCK = threading.Lock()
#: claimed checkpoint directory -> (its :class:`ChunkChecksums`, whether its save checksums)
_CLAIMED: dict[epath.Path, tuple[ChunkChecksums, bool]] = {}
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("boost_jax_chunk_checksums_off",
                                                           default=False)


def _checksummed_under(directory: str | os.PathLike) -> bool:
    """Whether an array orbax writes under ``directory`` checksums its chunks: the innermost
    claimed directory holding it says (none: no). Local or an object store's URL: orbax's
    ``parent_dir`` is absolute, as :func:`~boost_jax.checkpointing.storage.checkpoint_path` makes a
    claimed directory."""
    path = epath.Path(os.fspath(directory))
    with _LOCK:
        claims = [c for c in _CLAIMED if c == path or c in path.parents]
        return bool(claims) and _CLAIMED[max(claims, key=lambda c: len(c.parts))][1]


def _checksumming(build_spec: Callable[..., Any]) -> Callable[..., Any]:
    """orbax's ``build_array_write_spec``, with zstd's chunk checksum in the Zarr v3 arrays
    written under a claimed directory."""
    @functools.wraps(build_spec)
    def build(info, *args, **kwargs):  # orbax passes ``info=`` by keyword
        spec = build_spec(info, *args, **kwargs)
        if info.use_zarr3 and _checksummed_under(info.parent_dir):
            _with_chunk_checksum(_spec_metadata(spec.json))
        return spec

    build.unwrapped = build_spec
    return build


def install_chunk_checksums() -> None:
    """Install, once per process (thread-safe), the hook that checksums the chunks of the Zarr
    v3 arrays orbax writes under a directory a :class:`ChunkChecksums` claimed; it changes
    nothing elsewhere.

    orbax has no option for it: the hook wraps orbax's private write-spec builder
    (:func:`boost_jax.compat.orbax_write_spec_builder`). Raises a one-line RuntimeError when the
    installed orbax has moved it or its Zarr v3 metadata builder, or builds that metadata in a
    way this hook does not know (an orbax upgrade): checkpoints are never written unverified
    without saying so."""
    build = compat.orbax_zarr3_builder()
    try:
        (_,) = _compression(build((8,), (8,), use_compression=True))
    except Exception as err:
        raise RuntimeError(
            f"orbax-checkpoint {compat.orbax_version()} builds its Zarr v3 metadata "
            f"differently from what boost_jax/checkpointing/integrity.py expects "
            f"({type(err).__name__}: {err}); chunk checksums cannot be installed: install a "
            "tested orbax-checkpoint (pyproject.toml)") from None
    with _LOCK:
        build_spec = compat.orbax_write_spec_builder()
        if getattr(build_spec, "unwrapped", None) is None:
            compat.set_orbax_write_spec_builder(_checksumming(build_spec))


class ChunkChecksums:
    """Chunk checksums for the arrays orbax writes under ``directory`` (one per
    :class:`~boost_jax.checkpointing.checkpointer.Checkpointer`, claimed until :meth:`release`)."""

    def __init__(self, directory: str | os.PathLike):
        install_chunk_checksums()
        self.directory = storage.checkpoint_path(directory)
        self.arm()

    def arm(self) -> bool:
        """Before a save: its arrays checksum their chunks unless the calling thread is inside
        :func:`chunk_checksums_off`. The decision stays with the directory until the next
        save (orbax writes in the background, in threads of its own; a CheckpointManager
        finishes one save before it starts the next). Returns it."""
        on = not _OFF.get()
        with _LOCK:
            _CLAIMED[self.directory] = (self, on)
        return on

    def release(self) -> None:
        """Give the directory up (idempotent; a later claim of it by another is kept)."""
        with _LOCK:
            if _CLAIMED.get(self.directory, (None, False))[0] is self:
                del _CLAIMED[self.directory]


def zarr3_metadata(shape: list[int], checksum: bool = True) -> dict:
    """The Zarr v3 metadata orbax writes for an array of ``shape`` in one chunk, with or
    without the chunk checksum (for ``bench checkpoint``'s encode timing)."""
    metadata = compat.orbax_zarr3_builder()(shape, shape, True)
    return _with_chunk_checksum(metadata) if checksum else metadata


@contextlib.contextmanager
def chunk_checksums_off():
    """Saves started inside this block, by this thread, write without chunk checksums (for
    ``bench checkpoint`` and tests only); other threads' saves keep them."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


@jax.jit
def _health(state: dict) -> tuple[jax.Array, jax.Array]:
    """``(every floating value finite, the step counter)``: one reduction over the state."""
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    finite = jnp.all(jnp.stack([jnp.bool_(True)] + [jnp.isfinite(x).all() for x in leaves]))
    return finite, state["step"]


def verify(state: dict, step: int) -> str | None:
    """Why the restored ``state`` of checkpoint ``step`` is unusable (a short reason), or None.

    ``state`` is the train state (``{"step", "params", "opt_state"}``), sharded anywhere."""
    finite, held = jax.device_get(_health(state))
    if int(held) != step:
        return f"it holds the state of step {int(held)}, not {step}"
    if not bool(finite):
        bad = [jax.tree_util.keystr(path) for path, x in
               jax.tree_util.tree_flatten_with_path(state)[0]
               if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jnp.isfinite(x).all())]
        return f"non-finite values in {len(bad)} array(s), e.g. {bad[0]}"
    return None
