"""Corpora shipped with the package (see ATTRIBUTION.md)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

CORPORA = {"shakespeare": "shakespeare.jsonl.xz"}


def corpus_path(name: str) -> Path:
    """Path of a bundled corpus file (JSONL, ``text`` field, xz-compressed)."""
    if name not in CORPORA:
        raise FileNotFoundError(f"no bundled corpus {name!r}; available: {', '.join(CORPORA)}")
    return Path(str(importlib.resources.files(__name__) / CORPORA[name]))
