"""Document packing (``Data.packing='document'``): whole documents, first-fit into rows; and
one padded document per row (``Data.packing='pad'``, :class:`DocumentRows`).

A split's documents come from the shards' document offsets (data/prepare.py); a document that
straddles a shard's train/eval cut is cut there too. Document ``t_0 .. t_{n-1}`` (its last token
the end-of-text id) is read as the sequence ``eos, t_0, .., t_{n-1}`` -- the previous end-of-text
starts it, as it does in ``concat`` mode -- so its ``n`` tokens are all targets, as there. A
document longer than a row is cut into pieces of ``seq_len + 1`` tokens overlapping by one
(stride ``seq_len``), each its own segment.

:class:`DocumentPieces` is a grain random-access source over the pieces; grain's
``FirstFitPackIterDataset`` packs them into rows with ``segment_ids`` (1, 2, ..., 0 for padding)
and per-document ``positions``, which the model uses to mask attention to each document and to
restart RoPE (models/attention.py); the loss counts only non-padding tokens (models/batch.py).

Random access needs, per split and row length, the cumulative piece count of every document:
8 bytes a document, kept in a memory-mapped file in the cache (``pieces/``; built once per
dataset, split and ``seq_len``, one shard at a time, so memory stays bounded), shared by every
process and grain worker of a host.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grain
import numpy as np

from boost_jax.data.prepare import read_manifest

#: the arrays a packed row holds (models/batch.py) <- grain's packing features
PACKED = {"inputs": "inputs", "targets": "targets", "segment_ids": "inputs_segment_ids",
          "positions": "inputs_positions"}


class _SplitDocuments:
    """One shard's documents within a split, read from its memory-mapped offsets (nothing
    per document is held in memory): document ``i`` is tokens ``[start, end)``."""

    def __init__(self, offsets: np.ndarray, cut: int, split: str):
        self.offsets, self.cut, self.train = offsets, int(cut), split == "train"
        if self.train:  # the documents that start before the cut, the last one cut there
            self.count = int(np.searchsorted(offsets, cut, side="left"))
        else:  # from the cut: its document's tail, then every later document
            self.first = int(np.searchsorted(offsets, cut, side="right"))
            self.count = len(offsets) - self.first if cut < offsets[-1] else 0

    def bounds(self, i: int) -> tuple[int, int]:
        if self.train:
            return int(self.offsets[i]), min(int(self.offsets[i + 1]), self.cut)
        k = self.first + i
        return (self.cut if i == 0 else int(self.offsets[k - 1])), int(self.offsets[k])

    def lengths(self) -> np.ndarray:
        """Every document's length (a shard's worth of int64, for building the index)."""
        o = np.asarray(self.offsets, np.int64)
        if self.train:
            return np.minimum(o[1:self.count + 1], self.cut) - o[:self.count]
        starts = np.concatenate([[self.cut], o[self.first:-1]])
        return o[self.first:] - starts[:self.count]


def _split_documents(path: Path, split: str, packing: str
                     ) -> tuple[int, list[np.ndarray], list[_SplitDocuments], np.ndarray]:
    """A prepared dataset's split as documents: the end-of-text id, each shard's tokens
    (memory-mapped), its documents in the split, and the global index of each shard's first
    document (nothing per document is read)."""
    meta = read_manifest(path)
    if meta.get("format", 1) < 2:
        raise ValueError(f"{path}: Data.packing={packing!r} needs document offsets; prepare "
                         "the dataset again (format 2)")
    dtype, tokens, docs = np.dtype(meta["dtype"]), [], []
    for shard in meta["shards"]:
        shard_dir = path / "shards"
        tokens.append(np.memmap(shard_dir / shard["file"], dtype, "r", shape=(shard["tokens"],)))
        offsets = np.load(shard_dir / shard["docs"], mmap_mode="r")
        docs.append(_SplitDocuments(offsets, shard["train_tokens"], split))
    return int(meta["eos_id"]), tokens, docs, np.cumsum([0] + [d.count for d in docs])


def _index_path(path: Path, split: str, seq_len: int, cache_dir: Path) -> Path:
    digest = hashlib.sha1((path / "manifest.json").read_bytes()).hexdigest()[:16]
    return cache_dir / "pieces" / f"{digest}-{split}-{seq_len}.bin"


class DocumentPieces:
    """grain random-access source over the pieces of a split's documents: element ``j`` is
    ``{"inputs", "targets"}`` int32 ``[n]`` with ``n <= seq_len`` (one document, or one piece
    of a long one)."""

    def __init__(self, path: str | Path, split: str, seq_len: int, cache_dir: str | Path):
        self.path, self.split, self.seq_len = Path(path), split, seq_len
        self.cache_dir = Path(cache_dir)
        self.eos, self.tokens, self.docs, self.first_doc = _split_documents(
            self.path, split, "document")
        self.ends = self._piece_ends()
        self.n = int(self.ends[-1]) if len(self.ends) else 0

    def _piece_ends(self) -> np.ndarray:
        """Cumulative piece count of every document (memory-mapped, built once)."""
        index = _index_path(self.path, self.split, self.seq_len, self.cache_dir)
        if not index.is_file():
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = index.with_name(f"{index.name}.{os.getpid()}.tmp")
            total = 0
            with open(tmp, "wb") as f:
                for docs in self.docs:
                    pieces = -(-docs.lengths() // self.seq_len)  # ceil(n / seq_len)
                    ends = total + np.cumsum(pieces, dtype=np.int64)
                    total = int(ends[-1]) if len(ends) else total
                    ends.tofile(f)
            os.replace(tmp, index)  # concurrent builders write the same bytes
        if index.stat().st_size == 0:
            return np.zeros(0, np.int64)
        return np.memmap(index, np.int64, "r")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> dict[str, np.ndarray]:
        j = int(j)
        doc = int(np.searchsorted(self.ends, j, side="right"))
        piece = j - (int(self.ends[doc - 1]) if doc else 0)
        shard = int(np.searchsorted(self.first_doc, doc, side="right")) - 1
        local = doc - int(self.first_doc[shard])
        start, end = self.docs[shard].bounds(local)
        # the sequence is eos + the document: its position p is token start + p - 1
        lo = start - 1 + piece * self.seq_len
        hi = min(lo + self.seq_len + 1, end)
        seq = np.asarray(self.tokens[shard][max(lo, start):hi], np.int32)
        if lo < start:
            seq = np.concatenate([[self.eos], seq]).astype(np.int32)
        return {"inputs": seq[:-1], "targets": seq[1:]}

    def __getstate__(self):
        return (self.path, self.split, self.seq_len, self.cache_dir)

    def __setstate__(self, state):
        self.__init__(*state)


class DocumentRows:
    """grain random-access source for ``Data.packing='pad'`` (the low-rank papers' rows,
    alvin-zyl/CoLA ``pretraining_utils/dataloader.py``: each document tokenized with
    ``truncation=True, padding="max_length"``): element ``i`` is document ``i`` of the split
    as one row of ``seq_len`` tokens -- its first ``seq_len``, and when it is longer, its
    first ``seq_len - 1`` and its last token, the end-of-text id, as a Hugging Face tokenizer
    truncates a template that appends it (t5's) -- as int32 ``[seq_len]`` arrays: ``inputs``
    the row but its last token, ``targets`` the row but its first (the papers' labels, shifted
    inside their model), then padding: ``segment_ids`` 1 on the row's targets, 0 on padding,
    which the loss skips, and ``positions`` from 0. A row of ``m`` tokens has ``m - 1``
    targets; the papers count ``m`` tokens seen (their non-pad inputs)."""

    def __init__(self, path: str | Path, split: str, seq_len: int):
        self.path, self.split, self.seq_len = Path(path), split, seq_len
        self.eos, self.tokens, self.docs, self.first_doc = _split_documents(
            self.path, split, "pad")

    def __len__(self) -> int:
        return int(self.first_doc[-1])

    def row(self, i: int) -> np.ndarray:
        """Document ``i``'s row: at most ``seq_len`` tokens, the end-of-text id kept last."""
        shard = int(np.searchsorted(self.first_doc, int(i), side="right")) - 1
        start, end = self.docs[shard].bounds(int(i) - int(self.first_doc[shard]))
        if end - start <= self.seq_len:
            return np.asarray(self.tokens[shard][start:end], np.int32)
        head = np.asarray(self.tokens[shard][start:start + self.seq_len - 1], np.int32)
        return np.concatenate([head, [self.eos]]).astype(np.int32)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        row = self.row(i)
        n = len(row) - 1  # targets
        out = {k: np.zeros(self.seq_len, np.int32) for k in PACKED}
        out["inputs"][:n], out["targets"][:n] = row[:-1], row[1:]
        out["segment_ids"][:n], out["positions"][:n] = 1, np.arange(n)
        return out

    def __getstate__(self):
        return (self.path, self.split, self.seq_len)

    def __setstate__(self, state):
        self.__init__(*state)


class _Rows:
    """A packed batch (a group's, or a tuple of groups' side by side) -> rows ``[lo, hi)``,
    under the model's batch keys."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def __call__(self, batch) -> dict[str, np.ndarray]:
        if isinstance(batch, tuple):
            batch = {v: np.concatenate([b[v] for b in batch]) for v in PACKED.values()}
        return {k: np.asarray(batch[v][self.lo:self.hi], np.int32) for k, v in PACKED.items()}


def _group(pieces: DocumentPieces, bins: int, g: int, groups: int, seed: int | None,
           max_segments: int | None = None) -> grain.IterDataset:
    """Packing group ``g`` of ``groups``: every ``groups``-th piece of the stream from the
    ``g``-th, packed first-fit into batches of ``bins`` rows of at most ``max_segments``
    pieces each (``None``: no bound)."""
    ds = grain.MapDataset.source(pieces)
    if seed is not None:
        ds = ds.seed(seed).shuffle().repeat(None)
    if groups > 1:
        ds = ds[g::groups]
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    length = {"inputs": pieces.seq_len, "targets": pieces.seq_len}
    it = grain.experimental.FirstFitPackIterDataset(
        it, length_struct=length, num_packing_bins=bins, seed=(seed or 0) + g,
        shuffle_bins=seed is not None, max_sequences_per_bin=max_segments)
    return it.batch(bins, drop_remainder=True)


def packing_groups(global_batch: int, bins: int) -> tuple[int, int]:
    """``(groups, rows per group)``: the global batch cut into groups of ``bins`` rows (one
    group when it is smaller)."""
    per = min(bins, global_batch)
    return global_batch // per, per


def packed_batches(pieces: DocumentPieces, global_batch: int, rows: tuple[int, int],
                   seed: int | None, bins: int = 64, max_segments: int | None = None
                   ) -> grain.IterDataset:
    """Global batches of ``global_batch`` packed rows, this process's ``rows`` of each.

    The global batch is cut into groups of ``bins`` rows (``Data.packing_bins``); group ``g``
    packs its own share of the piece stream (every ``groups``-th piece) first-fit into its
    rows, so a process packs only the groups that hold its rows and the global batch does not
    depend on the process count. ``seed``: shuffle the pieces each epoch, forever (``None``:
    one pass in order, for eval). ``max_segments``: at most this many pieces per row
    (``Data.max_segments``; ``None``: no bound)."""
    groups, per = packing_groups(global_batch, bins)
    first, last = rows[0] // per, -(-rows[1] // per)
    parents = [_group(pieces, per, g, groups, seed, max_segments) for g in range(first, last)]
    it = parents[0] if len(parents) == 1 else grain.experimental.ZipIterDataset(
        parents=parents)
    return it.map(_Rows(rows[0] - first * per, rows[1] - first * per))
