"""Synthetic English-like corpora of any size, for tests and ``bench data`` (nothing bundled)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from "
          "at which but have an they you were her she there one all we their been has would "
          "when who will more no if out so said what up its about into than them can only "
          "other new some could time these two may then do first any my now such like our "
          "over man me even most made after also did many before must through back years "
          "where much your way well down should because each just those people mr how too "
          "little state good very make world still own see men work long get here between "
          "both life being under never day same another know while last might us great old "
          "year off come since against go came right used take three").split()


def write_corpus(path: str | Path, megabytes: float, seed: int = 0, files: int = 4,
                 words: tuple[int, int] = (50, 600)) -> Path:
    """``files`` JSONL files (``{"text": ...}`` a line) of ``megabytes`` MiB in all: documents of
    ``words`` (min, max) random common words, written as they are made (bounded memory)."""
    rng = np.random.default_rng(seed)
    vocab = np.array(_WORDS)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    per_file = int(megabytes * 2**20 / files)
    for f in range(files):
        with open(path / f"part-{f}.jsonl", "w") as out:
            written = 0
            while written < per_file:
                doc = " ".join(vocab[rng.integers(0, len(vocab), rng.integers(*words))])
                line = json.dumps({"text": doc}) + "\n"
                out.write(line)
                written += len(line)
    return path
