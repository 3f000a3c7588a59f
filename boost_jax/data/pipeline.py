"""The grain input pipeline over a prepared dataset's token shards (data/prepare.py).

Training stream: each shard's train split is cut into windows of ``seq_len + 1`` tokens (stride
``seq_len``, so every token is a target once per epoch), shuffled per epoch with the seed,
repeated forever and batched into *global* batches of ``batch_size`` windows. A process reads
only its rows ``[start, stop)`` of every global batch (those of the data shards its devices
hold, parallel/mesh.py), so the global batch is the same whatever the process count. Elements
are ``{"inputs", "targets"}`` int32 ``[stop - start, seq_len]``.

The iterator state (``get_state``/``set_state``, a small dict) is saved in every checkpoint, so a
resumed run continues the exact stream.

Eval: the first ``n_batches`` global batches of the eval split, in order (no shuffle).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from boost_jax.config import ConfigError, Data
from boost_jax.data.prepare import ensure_bundled

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


def _read_meta(path: Path) -> dict:
    """The manifest (format 2) or the older single-array ``meta.json`` (format 1)."""
    for name in ("manifest.json", "meta.json"):
        if (path / name).is_file():
            return json.loads((path / name).read_text())
    raise FileNotFoundError(path / "manifest.json")


def _regions(path: Path, split: str) -> list[np.ndarray]:
    """The split's tokens as 1-D memory maps, one per shard (format 1: one array)."""
    meta = _read_meta(path)
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
    """A prepared dataset directory and its manifest (data/prepare.py)."""

    path: Path
    meta: dict

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def windows(self, split: str, seq_len: int) -> TokenWindows:
        return TokenWindows(self.path, split, seq_len)


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
    try:
        meta = _read_meta(path)
    except FileNotFoundError:
        raise ConfigError(f"Data.path={data.path!r}: no prepared dataset there (missing "
                          f"manifest.json; run python -m boost_jax.data.prepare)") from None
    if meta.get("format", 1) < 2:
        files = [path / f"{split}.npy" for split in ("train", "eval")]
    else:
        files = [path / "shards" / s["file"] for s in meta["shards"]]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"Data.path={data.path!r}: missing {f.relative_to(path)}")
    return Dataset(path, meta)


def train_iterator(ds: Dataset, seq_len: int, global_batch: int, seed: int,
                   rows: tuple[int, int] | None = None, worker_count: int = 0):
    """A checkpointable grain iterator over this process's ``rows`` (default: all) of the
    training stream."""
    rows = rows or (0, global_batch)
    windows = ds.windows("train", seq_len)
    if len(windows) < global_batch:
        raise ConfigError(f"Data.path={str(ds.path)!r}: the train split has {len(windows)} "
                          f"windows of {seq_len + 1} tokens, fewer than Train.batch_size="
                          f"{global_batch}")
    stream = grain.MapDataset.source(windows).seed(seed).shuffle().repeat(None)
    local = grain.MapDataset.range(0, _ENDLESS).map(_ProcessRows(stream, global_batch, rows))
    local = local.batch(rows[1] - rows[0], drop_remainder=True)
    it = local.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    if worker_count > 0:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return iter(it)


def eval_batches(ds: Dataset, seq_len: int, global_batch: int, n_batches: int,
                 rows: tuple[int, int] | None = None) -> list[dict[str, np.ndarray]]:
    """This process's ``rows`` (default: all) of the first ``n_batches`` global eval batches
    (fewer if the split is short; an error if it cannot fill one)."""
    rows = rows or (0, global_batch)
    windows = ds.windows("eval", seq_len)
    n = min(n_batches, len(windows) // global_batch)
    if n_batches > 0 and n == 0:
        raise ConfigError(f"Data.path={str(ds.path)!r}: the eval split ({len(windows)} windows) "
                          f"cannot fill one batch of {global_batch}; lower Train.eval_batches or "
                          "raise the eval fraction")
    pick = _ProcessRows(windows, global_batch, rows)
    out = []
    for b in range(n):
        items = [pick(b * pick.local + j) for j in range(pick.local)]
        out.append({k: np.stack([it[k] for it in items]) for k in ("inputs", "targets")})
    return out
