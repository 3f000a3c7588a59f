"""The grain input pipeline over a prepared dataset's token shards (data/prepare.py).

Training stream, ``Data.packing='concat'``: each shard's train split is cut into windows of
``seq_len + 1`` tokens (stride ``seq_len``, so every token is a target once per epoch; attention
runs across the documents of a window), shuffled per epoch with the seed, repeated forever and
batched into *global* batches of ``batch_size`` windows. Elements are ``{"inputs", "targets"}``
int32 ``[rows, seq_len]``.

``Data.packing='pad'``: one document per row (data/packing.py :class:`DocumentRows`), cut to
``seq_len`` and padded, with ``segment_ids`` and ``positions`` that mark the padding: shuffled,
repeated and batched as ``concat``'s windows are, and read in order for eval.

``Data.packing='document'``: whole documents, shuffled, packed first-fit into rows with their
``segment_ids`` and ``positions`` (data/packing.py): attention stays within a document and the
loss skips padding. The global batch is packed in groups of ``Data.packing_bins`` rows; a
process packs only the groups that hold its rows.

A process reads only its rows ``[start, stop)`` of every global batch (those of the data shards
its devices hold, parallel/mesh.py), so the global batch is the same whatever the process
count. With ``Data.worker_count`` grain worker processes the concat stream is the same as
without; the packed stream depends on the worker count (each worker packs its share of the
documents), which a resumed run must keep.

The iterator state (``get_state``/``set_state``, a small dict) is saved in every checkpoint, so a
resumed run continues the exact stream.

Eval: the first ``n_batches`` global batches of the eval split, in order (no shuffle).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np
from absl import logging

from boost_jax.config import ConfigError, Data
from boost_jax.data.manifest import fingerprint, larger_eval_split
from boost_jax.data.packing import DocumentPieces, DocumentRows, packed_batches
from boost_jax.data.prepare import default_cache_dir, ensure_bundled, read_manifest
from boost_jax.data.tokenize_chunks import MIN_BPE_VOCAB

_ENDLESS = 2**62


class TokenWindows:
    """grain random-access source over a split's token regions (one per shard): window ``j`` is
    ``seq_len + 1`` consecutive tokens of one region (stride ``seq_len``; no window spans two
    shards)."""

    def __init__(self, path: str | Path, split: str, seq_len: int):
        self.path, self.split, self.seq_len = str(path), split, seq_len
        self.regions = _regions(Path(path), split)
        counts = [max((len(r) - 1) // seq_len, 0) for r in self.regions]
        self.ends = np.cumsum(counts)
        self.n = int(self.ends[-1]) if counts else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> dict[str, np.ndarray]:
        k = int(np.searchsorted(self.ends, int(j), side="right"))
        start = (int(j) - (int(self.ends[k - 1]) if k else 0)) * self.seq_len
        w = np.asarray(self.regions[k][start:start + self.seq_len + 1], dtype=np.int32)
        return {"inputs": w[:-1], "targets": w[1:]}

    def __getstate__(self):
        return {"path": self.path, "split": self.split, "seq_len": self.seq_len}

    def __setstate__(self, state):
        self.__init__(state["path"], state["split"], state["seq_len"])


def _regions(path: Path, split: str) -> list[np.ndarray]:
    """The split's tokens as 1-D memory maps, one per shard (format 1: one array)."""
    meta = read_manifest(path)
    if meta.get("format", 1) < 2:
        return [np.load(path / f"{split}.npy", mmap_mode="r")]
    out = []
    for shard in meta["shards"]:
        tokens = np.memmap(path / "shards" / shard["file"], np.dtype(meta["dtype"]), "r",
                           shape=(shard["tokens"],))
        cut = shard["train_tokens"]
        out.append(tokens[:cut] if split == "train" else tokens[cut:])
    return out


class _ProcessRows:
    """Maps the j-th element of this process's stream to its global element."""

    def __init__(self, source, global_batch: int, rows: tuple[int, int]):
        self.source, self.local = source, rows[1] - rows[0]
        self.global_batch, self.offset = global_batch, rows[0]

    def __call__(self, j: int):
        row, col = divmod(int(j), self.local)
        return self.source[row * self.global_batch + self.offset + col]


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset directory, its manifest (data/prepare.py), and the ``Data`` config
    it was opened with (packing, where document-packing indexes go)."""

    path: Path
    meta: dict
    data: Data

    @property
    def cache_dir(self) -> Path:
        return Path(self.data.cache_dir) if self.data.cache_dir else default_cache_dir()

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def ids_used(self) -> int:
        """The model rows its tokens need: its largest token id + 1 (a manifest of an older
        version: the tokenizer's vocabulary)."""
        return self.meta.get("max_id", self.vocab_size - 1) + 1

    @functools.cached_property
    def fingerprint(self) -> str:
        """What its tokens are (data/manifest.py :func:`fingerprint`), kept in checkpoints."""
        return fingerprint(self.path, self.meta)

    def windows(self, split: str, seq_len: int) -> TokenWindows:
        return TokenWindows(self.path, split, seq_len)

    def pieces(self, split: str, seq_len: int) -> DocumentPieces:
        return DocumentPieces(self.path, split, seq_len, self.cache_dir)

    def rows(self, split: str, seq_len: int) -> DocumentRows:
        return DocumentRows(self.path, split, seq_len)

    def sequences(self, split: str, seq_len: int) -> TokenWindows | DocumentRows:
        """The elements of a stream that is not packed: ``concat``'s windows, or ``pad``'s
        rows (one document each)."""
        return self.rows(split, seq_len) if self.data.packing == "pad" else \
            self.windows(split, seq_len)

    def describe(self, split: str, seq_len: int) -> str:
        """How many elements the split has, in words (for messages)."""
        if self.data.packing == "concat":
            return f"{len(self.windows(split, seq_len))} windows of {seq_len + 1} tokens"
        if self.data.packing == "pad":
            return f"{len(self.rows(split, seq_len))} documents"
        return f"{len(self.pieces(split, seq_len))} document pieces"


def open_dataset(data: Data) -> Dataset:
    """Resolve ``Data.path`` (preparing a bundled corpus on first use) and check it."""
    if data.path.startswith("bundled:"):
        try:
            path = ensure_bundled(data.path.split(":", 1)[1], data.tokenizer, data.eval_fraction,
                                  data.cache_dir)
        except (FileNotFoundError, ValueError, TimeoutError) as err:
            raise ConfigError(f"Data.path={data.path!r}: {err}") from None
    else:
        path = Path(data.path)
    verify = f"check it with python -m boost_jax.data.prepare --verify={path}"
    try:
        meta = read_manifest(path)
    except FileNotFoundError:
        raise ConfigError(f"Data.path={data.path!r}: no prepared dataset there (missing "
                          f"manifest.json; run python -m boost_jax.data.prepare)") from None
    except ValueError as err:  # json's error: a truncated or overwritten manifest
        raise ConfigError(f"Data.path={data.path!r}: its manifest is not valid JSON ({err}); "
                          f"{verify}, or prepare the dataset again") from None
    if meta.get("format", 1) < 2:
        if data.packed:
            raise ConfigError(f"Data.path={data.path!r}: Data.packing={data.packing!r} needs "
                              "the document offsets of format 2; prepare the dataset again")
        files = [path / f"{split}.npy" for split in ("train", "eval")]
    else:
        files = [path / "shards" / s[k] for s in meta["shards"] for k in ("file", "docs")]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"Data.path={data.path!r}: missing {f.relative_to(path)}")
    for shard in meta.get("shards", []):  # a truncated shard, before it is memory-mapped
        f = path / "shards" / shard["file"]
        expected = shard["tokens"] * np.dtype(meta["dtype"]).itemsize
        if (size := f.stat().st_size) != expected:
            raise ConfigError(f"Data.path={data.path!r}: {f.relative_to(path)} holds {size:,} "
                              f"bytes, its manifest says {expected:,} (truncated?); {verify}")
    return Dataset(path, meta, data)


def open_dataset_on_all(data: Data) -> Dataset:
    """:func:`open_dataset` in a multi-process run: process 0 opens (and, for a bundled corpus
    on a fresh cache, prepares) first while the others wait; then all agree on the outcome
    (one broadcast), so a failure on process 0 stops every process with a clear error instead
    of leaving them to race or hang. The others then open the finished dataset (or, when
    their host has its own cache, prepare the same one there, one process of a host at a
    time)."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return open_dataset(data)
    first, error = None, None
    if jax.process_index() == 0:
        try:
            first = open_dataset(data)
        except Exception as err:  # noqa: BLE001 -- told to the others, then raised here
            error = err
    failed = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if error is not None:
        raise error
    if failed:
        raise ConfigError(f"Data.path={data.path!r}: process 0 could not open or prepare the "
                          "dataset (its log says why)")
    return first if first is not None else open_dataset(data)


def check_vocab(vocab: int, data: Data, ids_used: int) -> None:
    """A model's embedding of ``vocab`` rows (``Model.vocab_size``) holds every token id of the
    dataset of ``data`` (``ids_used``: its largest + 1); else a ConfigError whose one line
    names the binding that fixes it -- a larger ``Model.vocab_size`` or, for a bundled corpus,
    a tokenizer that fits the model's (``Data.tokenizer='bpe:<vocab>'``)."""
    if ids_used <= vocab:
        return
    fits = (f", or prepare the bundled corpus with a tokenizer that fits the model: "
            f"--gin_param=\"Data.tokenizer='bpe:{vocab}'\""
            if data.path.startswith("bundled:") and vocab >= MIN_BPE_VOCAB else "")
    raise ConfigError(f"Model.vocab_size={vocab} is smaller than the vocabulary of "
                      f"Data.path={data.path!r} (its largest token id + 1: {ids_used}): "
                      f"add --gin_param=Model.vocab_size={ids_used}{fits}")


def _no_eval(ds: Dataset, why: str) -> None:
    logging.warning("no evaluation: the eval split of %s is too small (%s); %s, or lower "
                    "Train.batch_size", ds.path, why, larger_eval_split(ds.meta))


def _too_short(ds: Dataset, split: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"Data.path={str(ds.path)!r}: the {split} split {what}; {fix}")


def _shorter(ds: Dataset, fit: int, global_batch: int) -> str:
    """What makes a batch fit a train split that holds ``fit`` of its elements: a smaller batch
    (when one element fits at all), a shorter sequence (for windows over concatenated
    documents, the longest whose windows fill a batch), a larger corpus."""
    seq = "Train.seq_len"
    if ds.data.packing == "concat":
        sizes = [len(r) - 1 for r in ds.windows("train", 1).regions]
        lo, hi = 0, max(sizes, default=0)  # the longest seq_len with a batch of windows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sum(n // mid for n in sizes) >= global_batch else (lo, mid - 1)
        seq = f"Train.seq_len to at most {lo}" if lo else seq
    batch = f"Train.batch_size to at most {fit} or " if fit else ""
    return f"lower {batch}{seq}, or use a larger corpus"


def train_iterator(ds: Dataset, seq_len: int, global_batch: int, seed: int,
                   rows: tuple[int, int] | None = None, worker_count: int = 0,
                   put: Callable[[dict], dict] | None = None, prefetch: int = 0):
    """A checkpointable grain iterator over this process's ``rows`` (default: all) of the
    training stream (packed as ``ds.data.packing`` says, see the module docstring).

    ``put``: a function of each batch (the trainer's: onto the devices), run ``prefetch``
    batches ahead in a background thread when ``prefetch > 0`` (grain's
    ``ThreadPrefetchIterDataset``: a bounded queue; its state is that of the batches handed
    out, not of those waiting, so a checkpoint resumes at the next batch a step takes)."""
    rows = rows or (0, global_batch)
    if ds.data.packing == "document":
        pieces = ds.pieces("train", seq_len)
        if len(pieces) < global_batch:
            raise _too_short(ds, "train", f"has {len(pieces)} documents, fewer than "
                             f"Train.batch_size={global_batch}", "lower Train.batch_size to "
                             f"at most {len(pieces)} or use a larger corpus")
        it = packed_batches(pieces, global_batch, rows, seed, ds.data.packing_bins,
                            ds.data.max_segments)
    else:
        windows = ds.sequences("train", seq_len)
        if len(windows) < global_batch:
            raise _too_short(ds, "train", f"has {ds.describe('train', seq_len)}, fewer than "
                             f"Train.batch_size={global_batch}", _shorter(ds, len(windows),
                                                                          global_batch))
        stream = grain.MapDataset.source(windows).seed(seed).shuffle().repeat(None)
        local = grain.MapDataset.range(0, _ENDLESS).map(_ProcessRows(stream, global_batch, rows))
        local = local.batch(rows[1] - rows[0], drop_remainder=True)
        it = local.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    if worker_count > 0:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    if put is not None:
        it = it.map(put)
    if prefetch > 0:
        it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=prefetch)
    return iter(it)


def iter_eval_batches(ds: Dataset, seq_len: int, global_batch: int,
                      rows: tuple[int, int] | None = None, max_batches: int | None = None
                      ) -> Iterator[dict[str, np.ndarray]]:
    """This process's ``rows`` (default: all) of every full global batch of the eval split,
    in order (the first ``max_batches`` if given), produced lazily."""
    rows = rows or (0, global_batch)
    if ds.data.packing == "document":
        pieces = ds.pieces("eval", seq_len)
        yield from itertools.islice(
            packed_batches(pieces, global_batch, rows, None, ds.data.packing_bins,
                           ds.data.max_segments), max_batches)
        return
    windows = ds.sequences("eval", seq_len)
    pick = _ProcessRows(windows, global_batch, rows)
    n = len(windows) // global_batch
    for b in range(n if max_batches is None else min(n, max_batches)):
        items = [pick(b * pick.local + j) for j in range(pick.local)]
        yield {k: np.stack([it[k] for it in items]) for k in items[0]}


def eval_batches(ds: Dataset, seq_len: int, global_batch: int, n_batches: int,
                 rows: tuple[int, int] | None = None) -> list[dict[str, np.ndarray]]:
    """This process's ``rows`` (default: all) of the first ``n_batches`` global eval batches
    (fewer if the split is short; none, with a warning, if it cannot fill one)."""
    if n_batches <= 0:
        return []
    out = list(iter_eval_batches(ds, seq_len, global_batch, rows, n_batches))
    if not out and ds.data.packing == "document":
        _no_eval(ds, f"its {len(ds.pieces('eval', seq_len))} documents cannot fill one batch "
                 f"of {global_batch} packed rows")
    elif not out:
        _no_eval(ds, f"its {ds.describe('eval', seq_len)} cannot fill one batch of "
                 f"Train.batch_size={global_batch}")
    return out
