"""Tokenizers: the bundled LLaMA-style 32k SentencePiece model, any SentencePiece model file,
and byte-level BPE (Hugging Face ``tokenizers``) trained on the corpus for small runs.

A tokenizer is named by a spec string:

* ``llama32k`` -- the bundled 32000-token SentencePiece model (data/assets/README.md);
* ``spm:<path>`` -- a SentencePiece ``.model`` file;
* ``hf:<path>`` -- a Hugging Face ``tokenizer.json``, or a directory holding one (t5's, for the
  low-rank papers' data: :class:`HFTokenizer` says which id ends a document);
* ``bpe:<vocab>`` -- train a byte-level BPE of that size on the corpus being prepared.
"""

from __future__ import annotations

import importlib.resources
import shutil
from collections.abc import Sequence
from pathlib import Path

EOT = "<|endoftext|>"


def bundled_spm_path() -> Path:
    return Path(str(importlib.resources.files("boost_jax.data") / "assets" / "llama32k.model"))


class SentencePieceTokenizer:
    """A SentencePiece model (``.model`` file)."""

    kind = "spm"
    filename = "tokenizer.model"

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = Path(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id, self.bos_id = self.sp.eos_id(), self.sp.bos_id()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (e.g. a byte-level BPE trained by ``prepare``, or
    a model's ``tokenizer.json`` such as t5's).

    The end-of-text id that ends every document is ``<|endoftext|>`` when the vocabulary has
    it, else the one token the tokenizer's template appends to a sequence (t5's ``</s>``:
    ``tokenizer(text)`` in ``transformers`` ends with it), so a document's ids are what the
    tokenizer gives with its special tokens, less any it puts before the text."""

    kind = "hf"
    filename = "tokenizer.json"

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.tok = Tokenizer.from_file(str(self.path))
        self.vocab_size = self.tok.get_vocab_size()
        self.eos_id = self.tok.token_to_id(EOT)
        if self.eos_id is None:
            self.eos_id = _appended_token(self.tok)
        if self.eos_id is None:
            raise ValueError(f"{self.path}: tokenizer has no {EOT!r} token and appends no "
                             "end-of-sequence token to separate documents")
        self.bos_id = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def hf_file(path: str | Path) -> Path:
    """``hf:<path>``'s file: ``path``, or the ``tokenizer.json`` in it when it is a directory."""
    path = Path(path)
    return path / HFTokenizer.filename if path.is_dir() else path


def _appended_token(tok) -> int | None:
    """The single id ``tok``'s post-processor appends after a sequence's ids, or ``None``."""
    probe = "a b"
    plain, full = tok.encode(probe, add_special_tokens=False).ids, tok.encode(probe).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            tail = full[start + len(plain):]
            return tail[0] if len(tail) == 1 else None
    return None


Tokenizer = SentencePieceTokenizer | HFTokenizer


def train_bpe(texts: Sequence[str], vocab_size: int, out_path: Path) -> HFTokenizer:
    """Train a byte-level BPE with ``vocab_size`` tokens (including ``<|endoftext|>``)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_path))
    return HFTokenizer(out_path)


def build(spec: str, texts: Sequence[str], out_dir: Path) -> Tokenizer:
    """Materialise the tokenizer named by ``spec`` into ``out_dir`` (copy or train)."""
    kind, _, arg = spec.partition(":")
    if kind == "bpe":
        if not arg.isdigit() or int(arg) < 260:
            raise ValueError(f"tokenizer spec {spec!r}: expected bpe:<vocab size >= 260>")
        return train_bpe(texts, int(arg), out_dir / HFTokenizer.filename)
    if kind == "llama32k" and not arg:
        src, cls = bundled_spm_path(), SentencePieceTokenizer
    elif kind == "spm" and arg:
        src, cls = Path(arg), SentencePieceTokenizer
    elif kind == "hf" and arg:
        src, cls = hf_file(arg), HFTokenizer
    else:
        raise ValueError(f"unknown tokenizer spec {spec!r} (use bpe:<n>, llama32k, spm:<file> "
                         "or hf:<tokenizer.json or its directory>)")
    if not src.is_file():
        raise FileNotFoundError(f"tokenizer file {src} does not exist")
    dst = out_dir / cls.filename
    shutil.copyfile(src, dst)
    return cls(dst)


def load(data_dir: str | Path) -> Tokenizer:
    """The tokenizer saved in a prepared data directory."""
    data_dir = Path(data_dir)
    for cls in (SentencePieceTokenizer, HFTokenizer):
        if (data_dir / cls.filename).is_file():
            return cls(data_dir / cls.filename)
    raise FileNotFoundError(f"{data_dir}: no tokenizer.model or tokenizer.json")
