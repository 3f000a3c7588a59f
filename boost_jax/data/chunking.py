"""The chunks a ``prepare`` run (data/prepare.py) tokenizes, numbered: the documents of the
train files in chunks of about ``chunk_bytes``, then those of the eval files from the next
shard on; a shard is ``per_shard`` chunks, so what it holds depends on the inputs alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from boost_jax.data.sources import chunks, read_documents


class Chunks:
    """The numbered chunks of a run's ``files`` then ``eval_files`` (the documents of their
    field ``text_field``), those of the finished shards ``done`` skipped.

    Iterating reads the inputs as a stream; :attr:`read` counts the input bytes read so far
    and :attr:`positions` holds the input bytes ``(begin, end)`` each chunk yielded and not yet
    popped spans (the progress bar counts input bytes). :meth:`split` says which split a
    shard's tokens are, once the train chunks are read.
    """

    def __init__(self, files: list[Path], eval_files: list[Path], text_field: str,
                 chunk_bytes: int, per_shard: int, done: dict[int, dict]):
        self.files, self.eval_files, self.text_field = files, eval_files, text_field
        self.chunk_bytes, self.per_shard, self.done = chunk_bytes, per_shard, done
        self.read = 0
        self.positions: dict[int, tuple[int, int]] = {}
        self.eval_shard: int | None = None  # the first eval shard, known once train is read

    def _count(self, n: int) -> None:
        self.read += n

    def _numbered(self) -> Iterator[tuple[int, list[str]]]:
        """(index, documents) of the train chunks, then of the eval chunks from the next
        shard on."""
        i = -1
        train = read_documents(self.files, self.text_field, self._count)
        for i, docs in enumerate(chunks(train, self.chunk_bytes)):
            yield i, docs
        if self.eval_files:
            self.eval_shard = i // self.per_shard + 1
            held_out = read_documents(self.eval_files, self.text_field, self._count)
            yield from enumerate(chunks(held_out, self.chunk_bytes),
                                 self.eval_shard * self.per_shard)

    def __iter__(self) -> Iterator[tuple[int, list[str]]]:
        begin = 0
        for i, docs in self._numbered():
            if i // self.per_shard not in self.done:
                self.positions[i] = (begin, self.read)
                yield i, docs
            begin = self.read

    def split(self, shard: int) -> str:
        """The split of shard ``shard``'s tokens (data/shards.py: ``ShardWriter``): ``"eval"``
        (an eval shard), ``"train"`` (a train shard beside eval files) or ``"tail"``."""
        if self.eval_shard is not None and shard >= self.eval_shard:
            return "eval"
        return "train" if self.eval_files else "tail"
