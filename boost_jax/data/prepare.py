"""``python -m boost_jax.data.prepare``: a text corpus -> a sharded, tokenized dataset, streamed in
bounded memory and resumable after a kill::

    python -m boost_jax.data.prepare --input=c4/en --pattern='c4-train.*.json.gz' \
        --eval_input=c4/en --eval_pattern='c4-validation.*.json.gz' --output=data/c4 \
        --tokenizer=llama32k
    python -m boost_jax.data.prepare --input=my.txt --output=data/mine   # eval: shard tails
    python -m boost_jax.data.prepare --verify=data/c4

Output directory (format 2)::

    manifest.json         written last: tokenizer, vocab size, eos id, dtype, the shards, totals,
                          where the eval split came from (``eval_split``, :func:`eval_split_label`)
    tokenizer.json|.model the tokenizer (trained here for ``bpe:<n>``, else copied)
    shards/<k>.bin        shard k's tokens (uint16 when the vocab fits, else uint32): its
                          documents, each followed by the end-of-text id; the first
                          ``train_tokens`` are the train split, the rest the eval split
    shards/<k>.docs.npy   int64 ``[documents + 1]``: where each document starts (and the end)

The eval split. With ``--eval_input`` (a validation set, e.g. C4's ``c4-validation.*``) its
documents are the eval split, whole and each once: they go to eval shards (``train_tokens``
0) after the train shards, whose tokens are all train (``train_tokens == tokens``);
``manifest["eval_split"] == "eval_input"``. Without it (a corpus with no validation set) the
last ``--eval_fraction`` of each shard's tokens is held out, cutting a document there:
``"train_tail"``, also what a manifest without the field means. An explicit nonzero
``--eval_fraction`` with ``--eval_input`` is an error.

Inputs (boost_jax/data/sources.py): ``.txt``-like files (one document per file) and ``.jsonl``
files (one document per line, ``--text_field``), optionally ``.gz``/``.xz``/``.bz2``-compressed,
or directories of them (C4's ``*.json.gz`` shards as they are), or a Hugging Face dataset
directory saved with ``save_to_disk`` (its ``.arrow`` files, column ``--text_field``; needs
pyarrow). ``--pattern`` / ``--eval_pattern`` (a glob on file names) select among the files
found in the directories of ``--input`` / ``--eval_input``; the others are ignored and counted
(a file named explicitly is always read). A file that is both a train and an eval input is an
error. They are read as streams. Documents are grouped in chunks of about ``chunk_mb`` MiB of
text (shuffled within the chunk with ``--seed``) and a shard is ``chunks_per_shard`` chunks, so
what a shard holds depends on the inputs alone.

Memory is bounded whatever the corpus size: ``workers`` processes tokenize chunks with at most
``2 workers`` chunks in flight, and tokens go to disk as they arrive.

Resuming and replacing. Everything is written into ``.<output>.partial/`` beside the output; a
shard is finished when its ``<k>.json`` record (sizes and CRC-32 checksums) exists, and the
directory is renamed to ``output`` only when complete, so a half-written dataset is never used.

* An unfinished run restarted with the same arguments keeps its finished shards and redoes only
  the rest.
* An unfinished run with other arguments (tokenizer, inputs, patterns, eval inputs, seed, ...)
  is refused: its shards belong to another dataset. Rerun with its arguments to finish it, or
  pass ``--overwrite`` to discard it and start over.
* An output that holds a prepared dataset is refused. ``--overwrite`` replaces it: the new
  dataset is built in ``.<output>.partial/`` while the old one stays readable, then swapped in
  (the old one is renamed to ``.<output>.old/`` and deleted; between the two renames the output
  is briefly absent, never half-written). A failed or killed ``--overwrite`` leaves the old
  dataset intact, and rerunning it resumes. A directory that holds anything else is never
  replaced.

Errors. A user-caused failure (a missing, unreadable or malformed input, a corpus without text,
a pattern that matches nothing, a bad tokenizer spec, an output that cannot be written or is
taken, a bad flag) prints one line ``boost_jax.data.prepare: error: <what is wrong and what to
do>`` on stderr and exits with code 2. They are checked before anything is written; one found
only later (a malformed line deep in the corpus) removes the work directory this run created.
``BOOST_JAX_DEBUG=1`` raises it with its traceback instead. A full disk is one line too and,
like Ctrl-C (exit code 130), keeps the finished shards for a rerun.

Progress: when stderr is a terminal and preparing takes more than a second, a bar shows the
input read and the tokens written. A bundled corpus prepared on first use
(:func:`ensure_bundled`) says what it prepares and where in one line, then shows the same bar.

``--verify=DIR`` checks a dataset's checksums (exit code 1 when it finds a problem).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.corpus import corpus_path
from boost_jax.data.sources import Inputs, PrepareError, chunks, list_inputs, read_documents

if TYPE_CHECKING:
    from absl.flags import FlagValues

PROG = "boost_jax.data.prepare"
FORMAT_VERSION = 2
MIB = 2**20
TOKENIZER_SPECS = "bpe:<vocab size>, llama32k, spm:<file.model> or hf:<tokenizer.json>"
DEFAULT_EVAL_FRACTION = 0.02
#: arguments added to ``args.json`` since format 2, with the value an older run had
_ADDED_ARGS = dict(pattern=None, eval_inputs=[], eval_pattern=None)


# --- tokenization, in worker processes -----------------------------------------------------
_TOKENIZER = None


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
def _pool(workers: int, tokenizer_dir: Path):
    """A process pool (``spawn``: safe beside threads), or the calling process for 0."""
    if workers <= 0:
        _init_worker(str(tokenizer_dir), worker=False)
        yield None
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, ctx, _init_worker,
                                                (str(tokenizer_dir),)) as pool:
        yield pool


def _tokenized(pool, work: Iterator[tuple[int, list[str]]], seed: int, dtype: str,
               in_flight: int, on_progress: Callable[[int, float], None] | None = None
               ) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """``(index, tokenize(chunk))`` in order, with at most ``in_flight`` chunks submitted.
    In this process (no pool), ``on_progress(index, fraction)`` follows each chunk."""
    if pool is None:
        for index, docs in work:
            report = functools.partial(on_progress, index) if on_progress else None
            yield index, _tokenize(index, docs, seed, dtype, report)
        return
    pending: list[tuple[int, concurrent.futures.Future]] = []
    for index, docs in work:
        pending.append((index, pool.submit(_tokenize, index, docs, seed, dtype)))
        while len(pending) >= in_flight:
            i, fut = pending.pop(0)
            yield i, fut.result()
    for i, fut in pending:
        yield i, fut.result()


# --- shards ---------------------------------------------------------------------------------
class _ShardWriter:
    """Appends chunks' tokens to ``<k>.bin.tmp`` (CRC as it goes); :meth:`close` splits the
    tokens (``split``: ``"tail"``, the last ``eval_fraction`` of them are eval; ``"train"`` or
    ``"eval"``, all of them are), writes the document offsets and renames everything into
    place, the record last."""

    def __init__(self, directory: Path, index: int, eval_fraction: float, split: str = "tail"):
        self.dir, self.index, self.eval_fraction = directory, index, eval_fraction
        self.split = split
        self.tmp = directory / f"{index:05d}.bin.tmp"
        self.file = open(self.tmp, "wb")
        self.crc, self.tokens, self.lengths = 0, 0, []

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        data = tokens.tobytes()
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.tokens += len(tokens)
        self.lengths.append(lengths)

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
                      crc32=self.crc, docs_crc32=_crc(self.dir / f"{name}.docs.npy"))
        _write_json(self.dir / f"{name}.json", record)
        return record


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 * MIB):
            crc = zlib.crc32(block, crc)
    return crc


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _finished(shard_dir: Path, itemsize: int) -> dict[int, dict]:
    """The shards a previous run completed: record present, files of the recorded sizes."""
    done = {}
    for rec_file in shard_dir.glob("[0-9]*.json"):
        rec = json.loads(rec_file.read_text())
        data, docs = shard_dir / rec["file"], shard_dir / rec["docs"]
        if data.is_file() and docs.is_file() and data.stat().st_size == rec["tokens"] * itemsize:
            done[int(rec_file.stem)] = rec
    return done


# --- checks, before anything is written -------------------------------------------------------
def _work_dir(output: Path) -> Path:
    """Where a run writes until it is complete: ``.<output>.partial`` beside the output."""
    return output.parent / f".{output.name}.partial"


def _check_tokenizer(spec: str) -> None:
    """Refuse a tokenizer spec that :func:`tokenizers.build` would fail on, and a model file
    that does not load."""
    kind, _, arg = spec.partition(":")
    if kind == "bpe":
        if not (arg.isdigit() and int(arg) >= 260):
            raise PrepareError(f"tokenizer {spec!r}: the vocabulary size must be a whole number "
                               ">= 260 (256 bytes, end-of-text and merges), e.g. bpe:4096")
        return
    if kind == "llama32k" and not arg:
        return
    if kind not in ("spm", "hf") or not arg:
        raise PrepareError(f"unknown tokenizer {spec!r}; use {TOKENIZER_SPECS}")
    path = Path(arg)
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


def _describe(path: Path) -> str:
    """``'1,234 train + 25 eval tokens, tokenizer bpe:4096'`` of a prepared dataset."""
    try:
        meta = read_manifest(path)
        parts = [f"{meta['train_tokens']:,} train + {meta['eval_tokens']:,} eval tokens",
                 f"tokenizer {meta['tokenizer']}"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest is unreadable"
    return ", ".join(parts)


def _is_dataset(path: Path) -> bool:
    return (path / "manifest.json").is_file() or (path / "meta.json").is_file()


def _previous_args(work: Path) -> dict | None:
    """The arguments of the unfinished run in ``work`` (``{}`` when unreadable), or None.
    Arguments added since (``--pattern``, ``--eval_input``, ...) take their defaults."""
    if not (work / "args.json").is_file():
        return None
    try:
        return {**_ADDED_ARGS, **json.loads((work / "args.json").read_text())}
    except (OSError, ValueError):
        return {}


def _check_output(output: Path, args: dict, overwrite: bool) -> None:
    """Refuse an output that is taken or cannot be written, and an unfinished run of other
    arguments unless ``overwrite``."""
    if output.exists() and not output.is_dir():
        raise PrepareError(f"output {output} exists and is not a directory; choose another "
                           "--output")
    if output.is_dir() and _is_dataset(output):
        if not overwrite:
            raise PrepareError(f"{output} already holds a prepared dataset ({_describe(output)}); "
                               "pass --overwrite to replace it")
    elif output.is_dir() and any(output.iterdir()):
        raise PrepareError(f"output {output} is a directory that holds other files, not a "
                           "prepared dataset; choose another --output (never replaced, even "
                           "with --overwrite)")
    ancestor = output.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise PrepareError(f"cannot create {output}: {ancestor} is not a directory; choose "
                           "another --output")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PrepareError(f"cannot create {output}: {ancestor} is not writable; choose an "
                           "--output in a directory you can write to")
    work = _work_dir(output)
    before = _previous_args(work)
    if before is not None and before != args and not overwrite:
        changed = [f"{k}={before.get(k)!r} there, {v!r} now" for k, v in args.items()
                   if before.get(k) != v]
        raise PrepareError(f"{work} holds an unfinished run with other arguments "
                           f"({'; '.join(changed) or 'args.json'}); rerun with those to finish "
                           "it, or pass --overwrite to discard it and start over")


def _check_inputs(inputs: Sequence[str | Path], pattern: str | None, output: Path,
                  text_field: str, flag: str = "--input", pattern_flag: str = "--pattern"
                  ) -> Inputs:
    """The input files (:func:`~boost_jax.data.sources.list_inputs`), once each is known to be
    readable, the output not inside an input directory (it would be read as input) and some
    document known to hold text (reading up to the first that does). ``flag`` and
    ``pattern_flag``: the flags the errors name."""
    found = list_inputs(inputs, pattern, input_flag=flag, pattern_flag=pattern_flag)
    for p in map(Path, inputs):
        where = Path(os.path.abspath(p))
        if where.is_dir() and (output.is_relative_to(where)
                               or _work_dir(output).is_relative_to(where)):
            raise PrepareError(f"the output {output} is inside the input directory {p}, which "
                               "would read the output as input; choose an --output outside it")
    for f in found.files:
        if not f.is_file() or not os.access(f, os.R_OK):
            raise PrepareError(f"input file {f} is missing or not readable")
    documents = 0
    with contextlib.closing(read_documents(found.files, text_field)) as docs:
        for doc in docs:
            if doc.strip():
                return found
            documents += 1
    raise PrepareError(f"no text to prepare in {', '.join(map(str, inputs))} (files: "
                       f"{len(found.files)}, documents: {documents}, all empty or blank); "
                       f"check {flag}")


def _check_split(eval_fraction: float | None, eval_inputs: Sequence[str | Path],
                 eval_pattern: str | None) -> float:
    """The eval fraction to apply: ``eval_fraction`` (default 0.02) without ``eval_inputs``,
    0 with them, where an explicit nonzero one is refused (two eval splits)."""
    if eval_pattern is not None and not eval_inputs:
        raise PrepareError(f"--eval_pattern={eval_pattern!r} selects among the files of "
                           "--eval_input, which is not given; add --eval_input=<validation "
                           "files or directory> or drop --eval_pattern")
    if not eval_inputs:
        return DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
    if eval_fraction:
        raise PrepareError(f"--eval_fraction={eval_fraction:g} and --eval_input both define "
                           "the eval split; use --eval_input alone for a held-out validation "
                           "set (the training shards then keep all their tokens), or drop "
                           "--eval_input to hold out the tail of each training shard")
    return 0.0


def _check_disjoint(train: Inputs, held: Inputs) -> None:
    """Refuse a file that is both a train and an eval input: its documents would be trained
    on and evaluated."""
    trained = {f.resolve() for f in train.files}
    both = [f for f in held.files if f.resolve() in trained]
    if both:
        raise PrepareError(f"{both[0]} is both a training and an eval input ({len(both)} such "
                           "files); select the training files with --pattern (e.g. "
                           "--pattern='c4-train.*.json.gz') or name them in --input")


def _check_numbers(eval_fraction: float, chunk_mb: float, chunks_per_shard: int,
                   tokenizer_sample_mb: float) -> None:
    """Refuse numbers outside their ranges (a run would fail, or hold no train split)."""
    for ok, what in ((0 <= eval_fraction < 1, f"--eval_fraction={eval_fraction} must be in "
                      "[0, 1)"),
                     (chunk_mb > 0, f"--chunk_mb={chunk_mb} must be > 0"),
                     (chunks_per_shard >= 1, f"--chunks_per_shard={chunks_per_shard} must be "
                      ">= 1"),
                     (tokenizer_sample_mb > 0, f"--tokenizer_sample_mb={tokenizer_sample_mb} "
                      "must be > 0")):
        if not ok:
            raise PrepareError(what)


# --- the run ----------------------------------------------------------------------------------
def prepare(inputs: Sequence[str | Path], output: str | Path, tokenizer: str = "bpe:4096",
            eval_fraction: float | None = None, seed: int = 0, text_field: str = "text",
            workers: int = 0, chunk_mb: float = 4.0, chunks_per_shard: int = 64,
            tokenizer_sample_mb: float = 64.0, log: Callable[[str], None] | None = None, *,
            pattern: str | None = None, eval_inputs: Sequence[str | Path] = (),
            eval_pattern: str | None = None, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``output`` (see the module docstring); returns the manifest.

    ``pattern``: a glob on file names selecting the files of ``inputs``' directories.
    ``eval_inputs`` (with ``eval_pattern`` for them): the documents of the eval split, whole,
    in eval shards; the train shards then hold no eval tail. ``eval_fraction``: without
    ``eval_inputs``, the share of each shard's tokens held out at its end (default 0.02); with
    them, leave it None (or 0). ``workers``: tokenizer processes (0: in this process).
    ``tokenizer_sample_mb``: how much text trains a ``bpe:<n>`` tokenizer (the first training
    documents). ``overwrite``: replace a prepared dataset at ``output`` (built beside it,
    swapped in when complete), or discard an unfinished run of other arguments.
    ``progress``: a bar on stderr (when it is a terminal and the run takes over a second). A
    user-caused failure raises :class:`PrepareError`, before anything is written when it can
    be known then.
    """
    output = Path(os.path.abspath(output))
    work = _work_dir(output)
    eval_fraction = _check_split(eval_fraction, eval_inputs, eval_pattern)
    args = dict(inputs=[str(p) for p in inputs], pattern=pattern,
                eval_inputs=[str(p) for p in eval_inputs], eval_pattern=eval_pattern,
                tokenizer=tokenizer, eval_fraction=eval_fraction, seed=seed,
                text_field=text_field, chunk_mb=chunk_mb, chunks_per_shard=chunks_per_shard)
    _check_numbers(eval_fraction, chunk_mb, chunks_per_shard, tokenizer_sample_mb)
    _check_tokenizer(tokenizer)
    _check_output(output, args, overwrite)
    train = _check_inputs(inputs, pattern, output, text_field)
    held = None
    if eval_inputs:
        held = _check_inputs(eval_inputs, eval_pattern, output, text_field, "--eval_input",
                             "--eval_pattern")
        _check_disjoint(train, held)
    # everything checked: from here on, the run writes
    if _previous_args(work) not in (None, args):
        shutil.rmtree(work)  # an unfinished run of other arguments, discarded (overwrite)
    created = not work.exists()
    try:
        return _build(train, held, output, work, args, workers, tokenizer_sample_mb, log,
                      progress)
    except PrepareError:  # an input found malformed late: no trace of this run is left
        if created:
            shutil.rmtree(work, ignore_errors=True)
        raise


def _build(train: Inputs, held: Inputs | None, output: Path, work: Path, args: dict,
           workers: int, sample_mb: float, log: Callable[[str], None] | None,
           progress: bool) -> dict:
    """The run itself, in ``work``, published to ``output`` when complete: the train shards
    from ``train``'s files, then the eval shards from ``held``'s (when given)."""
    shard_dir = work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    _write_json(work / "args.json", args)
    if (work / "manifest.json").exists():  # killed between the manifest and the rename
        return _publish(work, output)
    for stale in shard_dir.glob("*.tmp*"):
        stale.unlink()
    files, eval_files = train.files, held.files if held else []
    for flag, found, pattern in (("input", train, "pattern"), ("eval_input", held, "eval_pattern")):
        if log and found is not None and args[pattern] is not None:
            n = len(found.files)
            log(f"--{flag}: reading {n} file{'s' * (n != 1)}, ignoring {len(found.ignored)} not "
                f"matching --{pattern}={args[pattern]!r}")
    text_field, seed = args["text_field"], args["seed"]
    chunk_bytes, per_shard = int(args["chunk_mb"] * MIB), args["chunks_per_shard"]
    tok = _tokenizer(args["tokenizer"], files, text_field, work, sample_mb, log)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)
    done = _finished(shard_dir, dtype.itemsize)
    if done and log:
        log(f"resuming: {len(done)} finished shards kept")

    # the progress bar counts input bytes: chunk i spans input bytes positions[i] = (begin, end)
    read, positions = 0, {}

    def count(n: int) -> None:
        nonlocal read
        read += n

    eval_shard = None  # the first eval shard, known once the train chunks are read

    def numbered() -> Iterator[tuple[int, list[str]]]:
        """(index, documents) of the train chunks, then of the eval chunks from the next
        shard on."""
        nonlocal eval_shard
        i = -1
        for i, docs in enumerate(chunks(read_documents(files, text_field, count), chunk_bytes)):
            yield i, docs
        if eval_files:
            eval_shard = i // per_shard + 1
            held_out = chunks(read_documents(eval_files, text_field, count), chunk_bytes)
            yield from enumerate(held_out, eval_shard * per_shard)

    def todo() -> Iterator[tuple[int, list[str]]]:
        begin = 0
        for i, docs in numbered():
            if i // per_shard not in done:
                positions[i] = (begin, read)
                yield i, docs
            begin = read

    def within(index: int, fraction: float) -> None:  # in-process: a part of chunk index done
        begin, end = positions[index]
        bar.update(int(begin + fraction * (end - begin)) - bar.n)

    total = sum(f.stat().st_size for f in files + eval_files)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing",
               delay=1, file=sys.stderr, disable=None if progress else True, dynamic_ncols=True)

    def say(message: str) -> None:
        if log:
            with tqdm.external_write_mode(file=sys.stderr):
                log(message)

    records, writer, tokens = dict(done), None, 0
    with bar, _pool(workers, work) as pool:
        for index, (ids, lengths) in _tokenized(pool, todo(), seed, dtype.name,
                                                 2 * max(workers, 1), within):
            shard = index // per_shard
            if writer is not None and writer.index != shard:
                records[writer.index] = writer.close()
                say(f"shard {writer.index}: {writer.tokens:,} tokens")
            if writer is None or writer.index != shard:
                split = "eval" if eval_shard is not None and shard >= eval_shard else \
                    "train" if eval_files else "tail"
                writer = _ShardWriter(shard_dir, shard, args["eval_fraction"], split)
            writer.write(ids, lengths)
            tokens += len(ids)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
            bar.update(positions.pop(index)[1] - bar.n)
        if writer is not None:
            records[writer.index] = writer.close()
        bar.update(read - bar.n)
    if not records:
        raise PrepareError(f"no text to prepare in {', '.join(args['inputs'])}")
    shards = [records[k] for k in sorted(records)]
    manifest = dict(format=FORMAT_VERSION, tokenizer_kind=tok.kind,
                    vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=dtype.name,
                    train_tokens=sum(s["train_tokens"] for s in shards),
                    eval_tokens=sum(s["tokens"] - s["train_tokens"] for s in shards),
                    documents=sum(s["documents"] for s in shards),
                    eval_split="eval_input" if held else "train_tail", files=len(files),
                    ignored_files=len(train.ignored), eval_files=len(eval_files),
                    eval_ignored_files=len(held.ignored) if held else 0, shards=shards, **args)
    _write_json(work / "manifest.json", manifest)
    return _publish(work, output)


def _publish(work: Path, output: Path) -> dict:
    """Move the finished work directory to ``output``; returns the manifest. Renames only, so
    a reader finds the old dataset, then (after an instant without one) the new one, never a
    part of either. A dataset being replaced (``overwrite``) goes to ``.<output>.old`` first
    and is deleted last."""
    if output.is_dir() and _is_dataset(output):
        old = output.parent / f".{output.name}.old"
        shutil.rmtree(old, ignore_errors=True)  # left by a run killed right here
        os.replace(output, old)
        os.replace(work, output)
        shutil.rmtree(old)
    else:
        if output.exists():
            output.rmdir()  # an empty directory only: others were refused
        os.replace(work, output)
    return json.loads((output / "manifest.json").read_text())


def _tokenizer(spec: str, files: list[Path], text_field: str, work: Path, sample_mb: float,
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
            elif _crc(f) != shard[crc_key]:
                problems.append(f"{f}: checksum mismatch")
        f = path / "shards" / shard["file"]
        if f.is_file() and f.stat().st_size != shard["tokens"] * itemsize:
            problems.append(f"{f}: {f.stat().st_size} bytes, expected "
                            f"{shard['tokens'] * itemsize}")
    return problems


def read_manifest(path: str | Path) -> dict:
    """A prepared dataset's manifest (format 2) or older single-array ``meta.json``
    (format 1)."""
    for name in ("manifest.json", "meta.json"):
        if (Path(path) / name).is_file():
            return json.loads((Path(path) / name).read_text())
    raise FileNotFoundError(Path(path) / "manifest.json")


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


def default_cache_dir() -> Path:
    return Path(os.environ.get("BOOST_JAX_CACHE", Path.home() / ".cache" / "boost_jax"))


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``lock_path`` (waiting up to ``timeout`` seconds): the
    processes of one host never prepare the same dataset at once. The OS drops the lock
    when its holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been preparing {lock_path.stem} "
                                       f"for over {timeout:.0f} s (lock {lock_path})") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_bundled(name: str, tokenizer: str, eval_fraction: float,
                   cache_dir: str | Path | None = None, timeout: float = 1800.0) -> Path:
    """Prepare a bundled corpus once into the cache; return its directory. Processes that
    share the cache take turns: the first prepares (saying so in one line on stderr, with a
    progress bar), the others find it done."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = tokenizer.replace(":", "").replace("/", "_")
    out = cache / "data" / f"{name}-{tag}-eval{eval_fraction:g}-v{FORMAT_VERSION}"
    if not (out / "manifest.json").exists():
        with _exclusive(out.with_name(out.name + ".lock"), timeout):
            if not (out / "manifest.json").exists():
                source = corpus_path(name)
                print(f"preparing the bundled corpus {name!r} with tokenizer {tokenizer} into "
                      f"{out} (first use only)", file=sys.stderr, flush=True)
                # overwrite: an unfinished run of other arguments (the package moved) restarts
                prepare([source], out, tokenizer, eval_fraction, overwrite=True)
    return out


# --- the command ------------------------------------------------------------------------------
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def main(argv: Sequence[str], flag_values: FlagValues | None = None) -> int:
    """The command, once absl has parsed the flags (into ``flag_values``, by default the global
    ``FLAGS``); returns the exit code: 0, 1 (``--verify`` found problems), 2 (a user error,
    one line on stderr) or 130 (interrupted)."""
    from absl import flags

    from boost_jax.cli import debugging, user_error

    f = flag_values if flag_values is not None else flags.FLAGS
    try:
        return _command(argv, f)
    except PrepareError as err:
        return user_error(PROG, err)
    except OSError as err:  # the disk, mid-run: the finished shards stay for a rerun
        if err.errno not in _WRITE_ERRORS or debugging():
            raise
        where = f" {err.filename}" if err.filename else ""
        return user_error(PROG, PrepareError(
            f"cannot write{where}: {err.strerror}; free space or fix permissions, then rerun the "
            "same command (finished shards are kept)"))
    except KeyboardInterrupt:
        if debugging():
            raise
        print(f"{PROG}: interrupted; rerun the same command to resume (finished shards are "
              "kept)", file=sys.stderr)
        return 130


def _command(argv: Sequence[str], f: FlagValues) -> int:
    """:func:`main` without its error handling: verify, or prepare and print the summary."""
    from absl import logging

    if len(argv) > 1:
        raise PrepareError(f"unexpected arguments {' '.join(argv[1:])!r}: flags take the form "
                           "--name=value; see --help")
    if f.verify:
        problems = verify(f.verify)
        print("\n".join(problems) if problems else f"{f.verify}: intact")
        return 1 if problems else 0
    if not f.input or not f.output:
        raise PrepareError("--input and --output are required (or --verify=DIR); see --help")
    if f.workers < -1:
        raise PrepareError(f"--workers={f.workers} must be -1 (one per core), 0 (in this "
                           "process) or more")
    workers = (os.cpu_count() or 1) if f.workers < 0 else f.workers
    start = time.perf_counter()
    eval_fraction = f.eval_fraction if f["eval_fraction"].present else None
    meta = prepare(f.input, f.output, f.tokenizer, eval_fraction, f.seed, f.text_field,
                   workers, f.chunk_mb, f.chunks_per_shard, f.tokenizer_sample_mb,
                   log=logging.info, pattern=f.pattern, eval_inputs=f.eval_input or (),
                   eval_pattern=f.eval_pattern, overwrite=f.overwrite)
    import resource

    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    ignored = "".join(f"; ignored {meta.get(count, 0)} files not matching --{pattern}"
                      for count, pattern in (("ignored_files", "pattern"),
                                             ("eval_ignored_files", "eval_pattern"))
                      if meta.get(pattern) is not None)
    logging.info("prepared %s: %d train + %d eval tokens in %d shards, vocab %d (%s), "
                 "%.0f s, peak RSS of one process %.0f MiB; eval split: %s%s", f.output,
                 meta["train_tokens"], meta["eval_tokens"], len(meta["shards"]),
                 meta["vocab_size"], meta["tokenizer"], time.perf_counter() - start, peak,
                 eval_split_label(meta), ignored)
    summary = {k: v for k, v in meta.items() if k != "shards"}
    print(json.dumps(dict(summary, shards=len(meta["shards"]), peak_rss_mib=round(peak)),
                     indent=1))
    return 0


def define_flags(flag_values: FlagValues | None = None) -> None:
    """The command's flags, in ``flag_values`` (default: the global ``FLAGS``)."""
    from absl import flags

    fv = flag_values if flag_values is not None else flags.FLAGS
    flags.DEFINE_multi_string("input", None, "text/JSONL files or directories of them, or a "
                              "Hugging Face save_to_disk directory", flag_values=fv)
    flags.DEFINE_string("pattern", None, "glob on file names: only the matching files of "
                        "--input directories are read (e.g. 'c4-train.*.json.gz'); files named "
                        "explicitly are always read", flag_values=fv)
    flags.DEFINE_multi_string("eval_input", None, "the eval split's documents, whole (e.g. C4's "
                              "validation files), as --input; instead of --eval_fraction",
                              flag_values=fv)
    flags.DEFINE_string("eval_pattern", None, "--pattern for the --eval_input directories "
                        "(e.g. 'c4-validation.*.json.gz')", flag_values=fv)
    flags.DEFINE_string("output", None, "output directory (built in .<output>.partial beside "
                        "it, renamed when complete)", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace the prepared dataset at --output (the new one "
                      "is built beside it and swapped in when complete; a failure leaves the "
                      "old one intact), or discard an unfinished run of other arguments",
                      flag_values=fv)
    flags.DEFINE_string("tokenizer", "bpe:4096", "bpe:<vocab> | llama32k | spm:<file> | "
                        "hf:<json>", flag_values=fv)
    flags.DEFINE_float("eval_fraction", DEFAULT_EVAL_FRACTION, "without --eval_input: the "
                       "fraction of each shard's tokens held out for eval, at its end",
                       flag_values=fv)
    flags.DEFINE_integer("seed", 0, "document shuffle seed (within each chunk)", flag_values=fv)
    flags.DEFINE_string("text_field", "text", "JSONL field (Arrow column) holding the text",
                        flag_values=fv)
    flags.DEFINE_integer("workers", -1, "tokenizer processes (-1: one per core; 0: in-process)",
                         flag_values=fv)
    flags.DEFINE_float("chunk_mb", 4.0, "MiB of text per tokenization chunk", flag_values=fv)
    flags.DEFINE_integer("chunks_per_shard", 64, "chunks per output shard", flag_values=fv)
    flags.DEFINE_float("tokenizer_sample_mb", 64.0, "MiB of text that train a bpe:<n>",
                       flag_values=fv)
    flags.DEFINE_string("verify", None, "check the checksums of this prepared dataset and exit "
                        "(exit code 1 when it finds a problem)", flag_values=fv)


if __name__ == "__main__":
    from boost_jax.cli import run_app

    define_flags()
    run_app(PROG, main)
