"""The manifest of a prepared dataset (data/prepare.py): ``manifest.json``, written last.

It holds the format, the tokenizer (kind, vocab size, eos id), the token dtype, the totals,
where the eval split came from (``eval_split``, :func:`eval_split_label`), the input counts,
the shards' records (data/shards.py) and the arguments of the run. An older dataset (format 1)
has a single-array ``meta.json`` instead; :func:`read_manifest` reads either.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from boost_jax.data.sources import Inputs

FORMAT_VERSION = 2
#: what a dataset's tokens are, in its manifest (its paths, counts of files and arguments aside)
_IDENTITY = ("format", "tokenizer_kind", "tokenizer", "vocab_size", "eos_id", "dtype",
             "train_tokens", "eval_tokens", "eval_split")
_SHARD_IDENTITY = ("tokens", "train_tokens", "crc32", "docs_crc32")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def make_manifest(tok, dtype: str, records: dict[int, dict], train: Inputs, held: Inputs | None,
                  args: dict) -> dict:
    """The manifest of a run with tokenizer ``tok``, shards ``records`` (by index) of tokens
    of ``dtype``, the ``train`` inputs, the eval inputs ``held`` (None: the eval split is the
    tail of each shard) and the arguments ``args``."""
    shards = [records[k] for k in sorted(records)]
    return dict(format=FORMAT_VERSION, tokenizer_kind=tok.kind,
                vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=dtype,
                train_tokens=sum(s["train_tokens"] for s in shards),
                eval_tokens=sum(s["tokens"] - s["train_tokens"] for s in shards),
                documents=sum(s["documents"] for s in shards),
                # the largest token id written (a shard record of an older version: the
                # tokenizer's largest): a model needs this + 1 rows, which can be fewer than
                # the tokenizer's vocabulary (t5's 100 sentinel ids appear in no text)
                max_id=max((s.get("max_id", tok.vocab_size - 1) for s in shards), default=-1),
                eval_split="eval_input" if held else "train_tail", files=len(train.files),
                ignored_files=len(train.ignored), eval_files=len(held.files) if held else 0,
                eval_ignored_files=len(held.ignored) if held else 0, shards=shards, **args)


def read_manifest(path: str | Path) -> dict:
    """A prepared dataset's manifest (format 2) or older single-array ``meta.json``
    (format 1)."""
    for name in ("manifest.json", "meta.json"):
        if (Path(path) / name).is_file():
            return json.loads((Path(path) / name).read_text())
    raise FileNotFoundError(Path(path) / "manifest.json")


def is_dataset(path: Path) -> bool:
    """Whether the directory ``path`` holds a prepared dataset (of any format)."""
    return (path / "manifest.json").is_file() or (path / "meta.json").is_file()


def describe(path: Path) -> str:
    """``'1,234 train + 25 eval tokens, tokenizer bpe:4096'`` of a prepared dataset."""
    try:
        meta = read_manifest(path)
        parts = [f"{meta['train_tokens']:,} train + {meta['eval_tokens']:,} eval tokens",
                 f"tokenizer {meta['tokenizer']}"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest is unreadable"
    return ", ".join(parts)


def eval_split_label(meta: dict) -> str:
    """What a prepared dataset's eval split is, for people: ``'held-out validation input
    (c4-validation.*.json.gz)'`` or ``'tail of the training shards (--eval_fraction=0.02; no
    validation input)'``, also for a manifest older than its ``eval_split`` field."""
    if meta.get("eval_split") == "eval_input":
        source = meta.get("eval_pattern") or ", ".join(meta.get("eval_inputs", []))
        return f"held-out validation input ({source})"
    fraction = meta.get("eval_fraction")
    share = "" if fraction is None else f"--eval_fraction={fraction:g}; "
    return f"tail of the training shards ({share}no validation input)"


def larger_eval_split(meta: dict) -> str:
    """How to prepare a larger eval split of the dataset of manifest ``meta``: more validation
    documents when they came from ``--eval_input`` (where ``--eval_fraction`` is an error),
    else a larger ``--eval_fraction``."""
    if meta.get("eval_split") == "eval_input":
        return "prepare the data with more --eval_input documents"
    return "prepare the data with a larger --eval_fraction"


def fingerprint(path: Path, meta: dict) -> str:
    """What a prepared dataset's tokens are, in 16 hex digits: a SHA-256 over its manifest's
    tokenizer and totals, every shard's token counts and CRC-32s (of the tokens and the
    document offsets; data/shards.py) and the bytes of its tokenizer file. The same for a copy
    of the dataset in another directory; another for a dataset prepared from other text, with
    another tokenizer or another eval split. (A format-1 dataset: its arrays' sizes.)"""
    h = hashlib.sha256()
    ident = {k: meta.get(k) for k in _IDENTITY}
    ident["shards"] = [[s.get(k) for k in _SHARD_IDENTITY] for s in meta.get("shards", [])]
    if "shards" not in meta:
        ident["sizes"] = [(path / f"{split}.npy").stat().st_size for split in ("train", "eval")]
    h.update(json.dumps(ident, sort_keys=True).encode())
    for name in _TOKENIZER_FILES:
        if (path / name).is_file():
            h.update((path / name).read_bytes())
    return h.hexdigest()[:16]
