"""``python -m boost_jax.data.prepare``: a text corpus -> a sharded, tokenized dataset, streamed in
bounded memory and resumable after a kill.

Output directory (format 2)::

    manifest.json         written last: tokenizer, vocab size, eos id, dtype, the shards, totals
    tokenizer.json|.model the tokenizer (trained here for ``bpe:<n>``, else copied)
    shards/<k>.bin        shard k's tokens (uint16 when the vocab fits, else uint32): its
                          documents, each followed by the end-of-text id; the first
                          ``train_tokens`` are the train split, the rest the eval split
    shards/<k>.docs.npy   int64 ``[documents + 1]``: where each document starts (and the end)

Inputs are ``.txt``-like files (one document per file) and ``.jsonl`` files (one document per
line, ``--text_field``), optionally ``.gz``/``.xz``/``.bz2``-compressed, or directories of them
(C4's ``*.json.gz`` shards as they are), or a Hugging Face dataset directory saved with
``save_to_disk`` (its ``.arrow`` files, column ``--text_field``; needs pyarrow). They are read
as streams. Documents are grouped in chunks of about ``chunk_mb`` MiB of text (shuffled within
the chunk with ``--seed``) and a shard is ``chunks_per_shard`` chunks, so what a shard holds
depends on the inputs alone.

Memory is bounded whatever the corpus size: ``workers`` processes tokenize chunks with at most
``2 workers`` chunks in flight, and tokens go to disk as they arrive. Everything is written
into ``.<output>.partial/`` beside the output; a shard is finished when its ``<k>.json`` record
(sizes and CRC-32 checksums) exists. A killed run, restarted with the same arguments, keeps the
finished shards and redoes only the rest; the directory is renamed to ``output`` when complete,
so a half-written dataset is never used. ``--verify`` checks a dataset's checksums.
"""

from __future__ import annotations

import bz2
import concurrent.futures
import contextlib
import fcntl
import gzip
import json
import lzma
import multiprocessing
import os
import shutil
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.corpus import corpus_path

FORMAT_VERSION = 2
MIB = 2**20
_OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


def _files(paths: Sequence[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir() and (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            # a Hugging Face dataset saved with save_to_disk: its Arrow files, in order
            state = json.loads((p / "state.json").read_text())
            out.extend(p / f["filename"] for f in state["_data_files"])
        elif p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist")
    if not out:
        raise FileNotFoundError(f"no input files in {', '.join(map(str, paths))}")
    return out


def read_documents(paths: Sequence[str | Path], text_field: str = "text") -> Iterator[str]:
    """Yield the documents of every input file, streaming (see the module docstring)."""
    for path in _files(paths):
        suffixes = path.suffixes
        opener = _OPENERS.get(suffixes[-1] if suffixes else "", open)
        base = suffixes[-2] if opener is not open and len(suffixes) > 1 else path.suffix
        if path.suffix == ".arrow":
            yield from _arrow_documents(path, text_field)
            continue
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


def _arrow_documents(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` column of an Arrow IPC stream file (what ``datasets``'
    ``save_to_disk`` writes), a record batch at a time."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportError(f"{path}: reading Arrow files (a Hugging Face dataset saved with "
                          "save_to_disk) needs pyarrow: pip install pyarrow") from None
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        if text_field not in reader.schema.names:
            raise KeyError(f"{path}: no column {text_field!r} (columns: "
                           f"{', '.join(reader.schema.names)})")
        for batch in reader:
            yield from batch.column(text_field).to_pylist()


def chunks(docs: Iterator[str], chunk_bytes: int) -> Iterator[list[str]]:
    """Group non-empty documents into lists of about ``chunk_bytes`` characters."""
    chunk, size = [], 0
    for doc in docs:
        if not doc.strip():
            continue
        chunk.append(doc)
        size += len(doc)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# --- tokenization, in worker processes -----------------------------------------------------
_TOKENIZER = None


def _init_worker(tokenizer_dir: str, worker: bool = True) -> None:
    global _TOKENIZER
    if worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _TOKENIZER = tokenizers.load(tokenizer_dir)


def _tokenize(index: int, docs: list[str], seed: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``index`` -> (tokens, document lengths); documents shuffled, each + eos."""
    tok = _TOKENIZER
    order = np.random.default_rng([seed, index]).permutation(len(docs))
    ids = tok.encode_batch([docs[i] for i in order])
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
               in_flight: int) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """``(index, tokenize(chunk))`` in order, with at most ``in_flight`` chunks submitted."""
    if pool is None:
        for index, docs in work:
            yield index, _tokenize(index, docs, seed, dtype)
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
    """Appends chunks' tokens to ``<k>.bin.tmp`` (CRC as it goes); :meth:`close` splits off the
    eval tail, writes the document offsets and renames everything into place, the record
    last."""

    def __init__(self, directory: Path, index: int, eval_fraction: float):
        self.dir, self.index, self.eval_fraction = directory, index, eval_fraction
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
        n_eval = max(int(self.tokens * self.eval_fraction), 1)
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


def prepare(inputs: Sequence[str | Path], output: str | Path, tokenizer: str = "bpe:4096",
            eval_fraction: float = 0.02, seed: int = 0, text_field: str = "text",
            workers: int = 0, chunk_mb: float = 4.0, chunks_per_shard: int = 64,
            tokenizer_sample_mb: float = 64.0, log=None) -> dict:
    """Tokenize ``inputs`` into ``output`` (see the module docstring); returns the manifest.

    ``workers``: tokenizer processes (0: in this process). ``tokenizer_sample_mb``: how much
    text trains a ``bpe:<n>`` tokenizer (the first documents of the stream).
    """
    output = Path(output)
    if (output / "manifest.json").exists() or (output / "meta.json").exists():
        raise FileExistsError(f"{output} already holds a prepared dataset")
    work = output.parent / f".{output.name}.partial"
    shard_dir = work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    args = dict(inputs=[str(p) for p in inputs], tokenizer=tokenizer,
                eval_fraction=eval_fraction, seed=seed, text_field=text_field,
                chunk_mb=chunk_mb, chunks_per_shard=chunks_per_shard)
    if (work / "args.json").exists() and json.loads((work / "args.json").read_text()) != args:
        raise ValueError(f"{work} holds a partial run with other arguments; remove it to start "
                         "over")
    _write_json(work / "args.json", args)
    if (work / "manifest.json").exists():  # killed between the manifest and the rename
        return _publish(work, output)
    for stale in shard_dir.glob("*.tmp*"):
        stale.unlink()
    tok = _tokenizer(tokenizer, inputs, text_field, work, tokenizer_sample_mb)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)
    done = _finished(shard_dir, dtype.itemsize)
    if done and log:
        log(f"resuming: {len(done)} finished shards kept")
    stream = enumerate(chunks(read_documents(inputs, text_field), int(chunk_mb * MIB)))
    todo = ((i, docs) for i, docs in stream if i // chunks_per_shard not in done)
    records, writer = dict(done), None
    with _pool(workers, work) as pool:
        for index, (tokens, lengths) in _tokenized(pool, todo, seed, dtype.name,
                                                    2 * max(workers, 1)):
            shard = index // chunks_per_shard
            if writer is not None and writer.index != shard:
                records[writer.index] = writer.close()
                if log:
                    log(f"shard {writer.index}: {writer.tokens:,} tokens")
            if writer is None or writer.index != shard:
                writer = _ShardWriter(shard_dir, shard, eval_fraction)
            writer.write(tokens, lengths)
        if writer is not None:
            records[writer.index] = writer.close()
    if not records:
        raise ValueError(f"no text in {', '.join(map(str, inputs))}")
    shards = [records[k] for k in sorted(records)]
    manifest = dict(format=FORMAT_VERSION, tokenizer_kind=tok.kind,
                    vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=dtype.name,
                    train_tokens=sum(s["train_tokens"] for s in shards),
                    eval_tokens=sum(s["tokens"] - s["train_tokens"] for s in shards),
                    documents=sum(s["documents"] for s in shards), shards=shards, **args)
    _write_json(work / "manifest.json", manifest)
    return _publish(work, output)


def _publish(work: Path, output: Path) -> dict:
    """Rename the finished work directory to ``output`` (atomic); returns the manifest."""
    if output.exists():
        output.rmdir()  # an empty directory only: a prepared one was refused above
    os.replace(work, output)
    return json.loads((output / "manifest.json").read_text())


def _tokenizer(spec: str, inputs, text_field: str, work: Path, sample_mb: float):
    """The tokenizer of a run: reused from an interrupted one, else built (a ``bpe:<n>`` is
    trained on the first ``sample_mb`` MiB of documents)."""
    with contextlib.suppress(FileNotFoundError):
        return tokenizers.load(work)

    def sample():
        size = 0
        for doc in read_documents(inputs, text_field):
            if doc.strip():
                yield doc
                size += len(doc)
                if size >= sample_mb * MIB:
                    return
    tmp = work / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tok = tokenizers.build(spec, sample(), tmp)
    os.replace(tmp / tok.filename, work / tok.filename)
    shutil.rmtree(tmp)
    return tokenizers.load(work)


def verify(path: str | Path) -> list[str]:
    """The problems of a prepared dataset (missing files, wrong sizes or checksums); empty
    when it is intact."""
    path = Path(path)
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
    share the cache take turns: the first prepares, the others find it done."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = tokenizer.replace(":", "").replace("/", "_")
    out = cache / "data" / f"{name}-{tag}-eval{eval_fraction:g}-v{FORMAT_VERSION}"
    if not (out / "manifest.json").exists():
        with _exclusive(out.with_name(out.name + ".lock"), timeout):
            if not (out / "manifest.json").exists():
                from absl import logging

                logging.info("preparing the bundled corpus %r into %s", name, out)
                prepare([corpus_path(name)], out, tokenizer, eval_fraction)
    return out


def main(argv: Sequence[str]) -> None:
    from absl import flags, logging

    f = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    if f.verify:
        problems = verify(f.verify)
        print("\n".join(problems) if problems else f"{f.verify}: intact")
        raise SystemExit(1 if problems else 0)
    if not f.input or not f.output:
        raise SystemExit("prepare: --input and --output are required (or --verify=DIR)")
    workers = (os.cpu_count() or 1) if f.workers < 0 else f.workers
    start = time.perf_counter()
    meta = prepare(f.input, f.output, f.tokenizer, f.eval_fraction, f.seed, f.text_field,
                   workers, f.chunk_mb, f.chunks_per_shard, f.tokenizer_sample_mb,
                   log=logging.info)
    import resource

    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    logging.info("prepared %s: %d train + %d eval tokens in %d shards, vocab %d (%s), "
                 "%.0f s, peak RSS of one process %.0f MiB", f.output, meta["train_tokens"],
                 meta["eval_tokens"], len(meta["shards"]), meta["vocab_size"],
                 meta["tokenizer"], time.perf_counter() - start, peak)
    summary = {k: v for k, v in meta.items() if k != "shards"}
    print(json.dumps(dict(summary, shards=len(meta["shards"]), peak_rss_mib=round(peak)),
                     indent=1))


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_multi_string("input", None, "text/JSONL files or directories")
    flags.DEFINE_string("output", None, "output directory")
    flags.DEFINE_string("tokenizer", "bpe:4096", "bpe:<vocab> | llama32k | spm:<file> | hf:<json>")
    flags.DEFINE_float("eval_fraction", 0.02, "fraction of each shard's tokens held out for eval")
    flags.DEFINE_integer("seed", 0, "document shuffle seed (within each chunk)")
    flags.DEFINE_string("text_field", "text", "JSONL field holding the text")
    flags.DEFINE_integer("workers", -1, "tokenizer processes (-1: one per core; 0: in-process)")
    flags.DEFINE_float("chunk_mb", 4.0, "MiB of text per tokenization chunk")
    flags.DEFINE_integer("chunks_per_shard", 64, "chunks per output shard")
    flags.DEFINE_float("tokenizer_sample_mb", 64.0, "MiB of text that train a bpe:<n>")
    flags.DEFINE_string("verify", None, "check the checksums of this prepared dataset and exit")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
