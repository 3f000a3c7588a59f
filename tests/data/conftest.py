"""A C4-like corpus directory shared by the reader and prepare tests."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from pathlib import Path

import pytest

WORDS = ("the river runs past old stone walls while children count boats and gulls over the "
         "harbour where a baker sells bread to sailors who sing of rain wind and distant "
         "islands").split()


@dataclasses.dataclass(frozen=True)
class C4Like:
    """``root`` holds what C4's ``en/`` does, in small: ``c4-train.0000{0,1}-of-01024.json.gz``
    (``train``, their documents in file order), ``c4-validation.00000-of-00008.json.gz``
    (``validation``), and two files that are no corpus: ``README.md`` and ``notes.txt``."""

    root: Path
    train: list[str]
    validation: list[str]

    PATTERN = "c4-train.*.json.gz"
    EVAL_PATTERN = "c4-validation.*.json.gz"
    STRAY = "never a document"  # in README.md and notes.txt


def _write(path: Path, texts: list[str]) -> None:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"text": t, "url": "https://example.org"}) + "\n" for t in texts)


@pytest.fixture
def c4_like(tmp_path) -> C4Like:
    rng = random.Random(0)

    def doc(name: str) -> str:
        return f"{name}: " + " ".join(rng.choices(WORDS, k=rng.randint(20, 60))) + "."

    root = tmp_path / "c4" / "en"
    root.mkdir(parents=True)
    train = []
    for k in range(2):
        texts = [doc(f"Train document {k}.{i}") for i in range(12)]
        _write(root / f"c4-train.{k:05d}-of-01024.json.gz", texts)
        train += texts
    validation = [doc(f"Validation document {i}") for i in range(10)]
    _write(root / "c4-validation.00000-of-00008.json.gz", validation)
    (root / "README.md").write_text(f"# C4, en\n\nThis README is {C4Like.STRAY}.\n")
    (root / "notes.txt").write_text(f"stray notes, {C4Like.STRAY}\n")
    return C4Like(root, train, validation)
