"""The tokenizer of a ``prepare`` run (data/prepare.py) and the tokenizing of its chunks.

:func:`check_spec` refuses a bad tokenizer spec before anything is written;
:func:`run_tokenizer` reuses an interrupted run's tokenizer or builds one (training a
``bpe:<n>``); :func:`pool` and :func:`tokenized` tokenize chunks of documents in worker
processes (``spawn``), in order, with a bounded number in flight, or in the calling process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.sources import PrepareError, read_documents

MIB = 2**20
TOKENIZER_SPECS = ("bpe:<vocab size>, llama32k, spm:<file.model> or hf:<tokenizer.json or its "
                   "directory>")
#: the smallest byte-level BPE: 256 bytes, end-of-text and merges
MIN_BPE_VOCAB = 260


def check_spec(spec: str) -> None:
    """Refuse a tokenizer spec that :func:`tokenizers.build` would fail on, and a model file
    that does not load."""
    kind, _, arg = spec.partition(":")
    if kind == "bpe":
        if not (arg.isdigit() and int(arg) >= MIN_BPE_VOCAB):
            raise PrepareError(f"tokenizer {spec!r}: the vocabulary size must be a whole number "
                               ">= 260 (256 bytes, end-of-text and merges), e.g. bpe:4096")
        return
    if kind == "llama32k" and not arg:
        return
    if kind not in ("spm", "hf") or not arg:
        raise PrepareError(f"unknown tokenizer {spec!r}; use {TOKENIZER_SPECS}")
    path = tokenizers.hf_file(arg) if kind == "hf" else Path(arg)
    if not path.is_file():
        raise PrepareError(f"tokenizer {spec!r}: no file {path}; use {TOKENIZER_SPECS}")
    cls, what = ((tokenizers.SentencePieceTokenizer, "a SentencePiece .model") if kind == "spm"
                 else (tokenizers.HFTokenizer, "a Hugging Face tokenizer.json"))
    try:
        cls(path)
    except Exception as err:  # noqa: BLE001 -- the libraries raise many kinds for a bad file
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PrepareError(f"tokenizer {spec!r}: {path} is not {what} file that loads "
                           f"({reason})") from err


def run_tokenizer(spec: str, files: list[Path], text_field: str, work: Path, sample_mb: float,
                  log: Callable[[str], None] | None):
    """The tokenizer of a run: reused from an interrupted one, else built (a ``bpe:<n>`` is
    trained on the first ``sample_mb`` MiB of documents)."""
    with contextlib.suppress(FileNotFoundError):
        return tokenizers.load(work)

    def sample():
        size = 0
        for doc in read_documents(files, text_field):
            if doc.strip():
                yield doc
                size += len(doc)
                if size >= sample_mb * MIB:
                    return
    if log and spec.startswith("bpe:"):
        log(f"training the {spec} tokenizer on the first {sample_mb:g} MiB of text")
    tmp = work / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tok = tokenizers.build(spec, sample(), tmp)
    os.replace(tmp / tok.filename, work / tok.filename)
    shutil.rmtree(tmp)
    return tokenizers.load(work)


# --- tokenization, in worker processes -----------------------------------------------------
_TOKENIZER = None  # the tokenizer of this process, set by _init_worker


def _init_worker(tokenizer_dir: str, worker: bool = True) -> None:
    global _TOKENIZER
    if worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the main process alone
    _TOKENIZER = tokenizers.load(tokenizer_dir)


def _tokenize(index: int, docs: list[str], seed: int, dtype: str,
              on_progress: Callable[[float], None] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``index`` -> (tokens, document lengths); documents shuffled, each + eos.

    ``on_progress(fraction)``: told the share of the chunk's documents done, up to 16 times
    (the progress bar of an in-process run; a worker tokenizes its chunk in one call). A slice
    keeps at least one document per core: the tokenizers' batches run in parallel.
    """
    tok = _TOKENIZER
    order = np.random.default_rng([seed, index]).permutation(len(docs))
    step = len(docs) if on_progress is None else max(-(-len(docs) // 16), os.cpu_count() or 1)
    ids = []
    for start in range(0, len(docs), step):
        ids += tok.encode_batch([docs[i] for i in order[start:start + step]])
        if on_progress is not None:
            on_progress(len(ids) / len(docs))
    lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
    tokens = np.empty(int(lengths.sum()), dtype)
    pos = 0
    for x in ids:
        tokens[pos:pos + len(x)] = x
        tokens[pos + len(x)] = tok.eos_id
        pos += len(x) + 1
    return tokens, lengths


@contextlib.contextmanager
def pool(workers: int, tokenizer_dir: Path):
    """A process pool (``spawn``: safe beside threads), or the calling process for 0."""
    if workers <= 0:
        _init_worker(str(tokenizer_dir), worker=False)
        yield None
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, ctx, _init_worker,
                                                (str(tokenizer_dir),)) as executor:
        yield executor


def tokenized(executor, work: Iterator[tuple[int, list[str]]], seed: int, dtype: str,
              in_flight: int, on_progress: Callable[[int, float], None] | None = None
              ) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """``(index, tokenize(chunk))`` in order, with at most ``in_flight`` chunks submitted to
    ``executor`` (a :func:`pool`). In this process (no executor), ``on_progress(index,
    fraction)`` follows each chunk."""
    if executor is None:
        for index, docs in work:
            report = functools.partial(on_progress, index) if on_progress else None
            yield index, _tokenize(index, docs, seed, dtype, report)
        return
    pending: list[tuple[int, concurrent.futures.Future]] = []
    for index, docs in work:
        pending.append((index, executor.submit(_tokenize, index, docs, seed, dtype)))
        while len(pending) >= in_flight:
            i, fut = pending.pop(0)
            yield i, fut.result()
    for i, fut in pending:
        yield i, fut.result()
