"""The grain input pipeline over a prepared token memmap.

Training stream: the train split is cut into windows of ``seq_len + 1`` tokens (stride
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
    """grain random-access source: window ``i`` is ``tokens[i*seq_len : (i+1)*seq_len + 1]``."""

    def __init__(self, path: str | Path, seq_len: int):
        self.path, self.seq_len = str(path), seq_len
        self.tokens = np.load(self.path, mmap_mode="r")
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start = int(i) * self.seq_len
        w = np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)
        return {"inputs": w[:-1], "targets": w[1:]}

    def __getstate__(self):
        return {"path": self.path, "seq_len": self.seq_len}

    def __setstate__(self, state):
        self.__init__(state["path"], state["seq_len"])


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
    """A prepared dataset directory and its metadata."""

    path: Path
    meta: dict

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def windows(self, split: str, seq_len: int) -> TokenWindows:
        return TokenWindows(self.path / f"{split}.npy", seq_len)


def open_dataset(data: Data) -> Dataset:
    """Resolve ``Data.path`` (preparing a bundled corpus on first use) and check it."""
    if data.path.startswith("bundled:"):
        try:
            path = ensure_bundled(data.path.split(":", 1)[1], data.tokenizer, data.eval_fraction,
                                  data.cache_dir)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"Data.path={data.path!r}: {err}") from None
    else:
        path = Path(data.path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise ConfigError(f"Data.path={data.path!r}: no prepared dataset there (missing "
                          f"meta.json; run python -m boost_jax.data.prepare)")
    for split in ("train", "eval"):
        if not (path / f"{split}.npy").is_file():
            raise ConfigError(f"Data.path={data.path!r}: missing {split}.npy")
    return Dataset(path, json.loads(meta_file.read_text()))


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
