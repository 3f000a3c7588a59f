"""``python -m boost_jax.data.prepare``: text files or JSONL -> token memmaps + metadata.

Output directory layout::

    meta.json                  tokenizer, vocab size, eos id, token counts, inputs
    tokenizer.json | .model    the tokenizer (trained here for ``bpe:<n>``, else copied)
    train.npy, eval.npy        1-D token arrays (uint16 when the vocab fits, else uint32)

Inputs: ``.txt``-like files (one document per file) and ``.jsonl`` files (one document per line,
``--text_field``), optionally ``.gz``/``.xz``/``.bz2``-compressed, or directories of them; this
covers WikiText's raw files and C4's ``*.json.gz`` shards. Documents are shuffled with
``--seed``, tokenized, joined with the tokenizer's end-of-text id, and the last
``--eval_fraction`` of the token stream is held out as the eval split. The directory is written
under a temporary name and renamed when complete, so a half-written dataset is never used.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.corpus import corpus_path

FORMAT_VERSION = 1
_OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


def _files(paths: Sequence[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist")
    if not out:
        raise FileNotFoundError(f"no input files in {', '.join(map(str, paths))}")
    return out


def read_documents(paths: Sequence[str | Path], text_field: str = "text") -> Iterator[str]:
    """Yield the documents of every input file (see the module docstring)."""
    for path in _files(paths):
        suffixes = path.suffixes
        opener = _OPENERS.get(suffixes[-1] if suffixes else "", open)
        base = suffixes[-2] if opener is not open and len(suffixes) > 1 else path.suffix
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            if base in (".jsonl", ".json"):
                for n, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if text_field not in record:
                            raise KeyError(f"{path}:{n}: no field {text_field!r}")
                        yield record[text_field]
            else:
                yield f.read()


def prepare(inputs: Sequence[str | Path], output: str | Path, tokenizer: str = "bpe:4096",
            eval_fraction: float = 0.02, seed: int = 0, text_field: str = "text") -> dict:
    """Tokenize ``inputs`` into ``output`` (see module docstring); returns the metadata."""
    output = Path(output)
    if (output / "meta.json").exists():
        raise FileExistsError(f"{output} already holds a prepared dataset")
    docs = [d for d in read_documents(inputs, text_field) if d.strip()]
    if not docs:
        raise ValueError(f"no text in {', '.join(map(str, inputs))}")
    order = np.random.default_rng(seed).permutation(len(docs))
    docs = [docs[i] for i in order]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        tok = tokenizers.build(tokenizer, docs, tmp)
        chunks = []
        for start in range(0, len(docs), 256):
            for ids in tok.encode_batch(docs[start:start + 256]):
                chunks.append(np.asarray(ids + [tok.eos_id], np.int64))
        tokens = np.concatenate(chunks)
        dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
        n_eval = max(int(len(tokens) * eval_fraction), 1)
        np.save(tmp / "train.npy", tokens[:-n_eval].astype(dtype))
        np.save(tmp / "eval.npy", tokens[-n_eval:].astype(dtype))
        meta = dict(format=FORMAT_VERSION, tokenizer=tokenizer, tokenizer_kind=tok.kind,
                    vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=np.dtype(dtype).name,
                    train_tokens=len(tokens) - n_eval, eval_tokens=n_eval, documents=len(docs),
                    inputs=[str(p) for p in inputs], seed=seed, eval_fraction=eval_fraction)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if output.exists():
            output.rmdir()  # an empty directory only: a prepared one was refused above
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def default_cache_dir() -> Path:
    return Path(os.environ.get("BOOST_JAX_CACHE", Path.home() / ".cache" / "boost_jax"))


def ensure_bundled(name: str, tokenizer: str, eval_fraction: float,
                   cache_dir: str | Path | None = None) -> Path:
    """Prepare a bundled corpus once into the cache; return its directory."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = tokenizer.replace(":", "").replace("/", "_")
    out = cache / "data" / f"{name}-{tag}-eval{eval_fraction:g}"
    if not (out / "meta.json").exists():
        try:
            prepare([corpus_path(name)], out, tokenizer, eval_fraction)
        except FileExistsError:  # another process finished it first
            pass
    return out


def main(argv: Sequence[str]) -> None:
    from absl import flags, logging

    f = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    meta = prepare(f.input, f.output, f.tokenizer, f.eval_fraction, f.seed, f.text_field)
    logging.info("prepared %s: %d train + %d eval tokens, vocab %d (%s)", f.output,
                 meta["train_tokens"], meta["eval_tokens"], meta["vocab_size"], meta["tokenizer"])
    print(json.dumps(meta, indent=1))


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_multi_string("input", None, "text/JSONL files or directories", required=True)
    flags.DEFINE_string("output", None, "output directory", required=True)
    flags.DEFINE_string("tokenizer", "bpe:4096", "bpe:<vocab> | llama32k | spm:<file> | hf:<json>")
    flags.DEFINE_float("eval_fraction", 0.02, "fraction of tokens held out for eval")
    flags.DEFINE_integer("seed", 0, "document shuffle seed")
    flags.DEFINE_string("text_field", "text", "JSONL field holding the text")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
