"""The token shards of a prepared dataset (data/prepare.py): writing one, verifying them.

A shard ``k`` is ``shards/<k>.bin`` (its tokens), ``shards/<k>.docs.npy`` (int64 document
offsets, ``[documents + 1]``) and, written last, ``shards/<k>.json``: its record (sizes, split
and CRC-32 checksums), the mark that it is finished (data/unfinished.py).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from boost_jax.data.sources import PrepareError

_BLOCK = 16 * 2**20  # bytes read at a time for a checksum


class ShardWriter:
    """Appends chunks' tokens to ``<k>.bin.tmp`` (CRC as it goes); :meth:`close` splits the
    tokens (``split``: ``"tail"``, the last ``eval_fraction`` of them are eval; ``"train"`` or
    ``"eval"``, all of them are), writes the document offsets and renames everything into
    place, the record last."""

    def __init__(self, directory: Path, index: int, eval_fraction: float, split: str = "tail"):
        self.dir, self.index, self.eval_fraction = directory, index, eval_fraction
        self.split = split
        self.tmp = directory / f"{index:05d}.bin.tmp"
        self.file = open(self.tmp, "wb")
        self.crc, self.tokens, self.lengths, self.max_id = 0, 0, [], -1

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        data = tokens.tobytes()
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.tokens += len(tokens)
        self.lengths.append(lengths)
        if len(tokens):
            self.max_id = max(self.max_id, int(tokens.max()))

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        name = f"{self.index:05d}"
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(self.lengths))]).astype(np.int64)
        np.save(self.dir / f"{name}.docs.tmp.npy", offsets)
        os.replace(self.dir / f"{name}.docs.tmp.npy", self.dir / f"{name}.docs.npy")
        os.replace(self.tmp, self.dir / f"{name}.bin")
        if self.split == "tail":
            n_eval = max(int(self.tokens * self.eval_fraction), 1)
        else:
            n_eval = self.tokens if self.split == "eval" else 0
        record = dict(file=f"{name}.bin", docs=f"{name}.docs.npy", tokens=self.tokens,
                      train_tokens=self.tokens - n_eval, documents=len(offsets) - 1,
                      max_id=self.max_id, crc32=self.crc,
                      docs_crc32=crc(self.dir / f"{name}.docs.npy"))
        write_json(self.dir / f"{name}.json", record)
        return record


def crc(path: Path) -> int:
    """The CRC-32 of the file ``path``, read in blocks."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return value


def write_json(path: Path, value) -> None:
    """Write ``value`` to ``path`` through a ``.tmp`` file and a rename: whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def verify(path: str | Path) -> list[str]:
    """The problems of a prepared dataset (missing files, wrong sizes or checksums); empty
    when it is intact. A directory without a format-2 manifest raises :class:`PrepareError`."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise PrepareError(f"{path}: no manifest.json, so nothing to verify (not a dataset of "
                           "format 2; prepare it again)")
    manifest = json.loads((path / "manifest.json").read_text())
    itemsize = np.dtype(manifest["dtype"]).itemsize
    problems = []
    for shard in manifest["shards"]:
        for key, crc_key in (("file", "crc32"), ("docs", "docs_crc32")):
            f = path / "shards" / shard[key]
            if not f.is_file():
                problems.append(f"{f}: missing")
            elif crc(f) != shard[crc_key]:
                problems.append(f"{f}: checksum mismatch")
        f = path / "shards" / shard["file"]
        if f.is_file() and f.stat().st_size != shard["tokens"] * itemsize:
            problems.append(f"{f}: {f.stat().st_size} bytes, expected "
                            f"{shard['tokens'] * itemsize}")
    return problems
