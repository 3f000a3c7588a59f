"""A text corpus -> a sharded, tokenized dataset, streamed in bounded memory and resumable after
a kill: :func:`prepare` (the checks, then the run in ``.<output>.partial``, published when
complete) and :func:`ensure_bundled` (a bundled corpus prepared into the cache on first use).
The command ``python -m boost_jax.data.prepare`` (boost_jax/commands/prepare.py) documents the
inputs, the output directory and the eval split.
"""

# The parts: sources.py (the inputs), chunking.py (their numbered chunks), tokenize_chunks.py (the
# tokenizer, the worker processes), shards.py (shard files, --verify), manifest.py, unfinished.py
# (what an unfinished run left), prepare_checks.py (the checks before writing), cache.py (the
# cache of bundled corpora) and boost_jax/publish.py (the output checks and the renames into
# place, shared with the export); the command: boost_jax/commands/prepare.py.

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from boost_jax import publish
from boost_jax.data import tokenize_chunks, unfinished
from boost_jax.data.cache import default_cache_dir, exclusive
from boost_jax.data.chunking import Chunks
from boost_jax.data.corpus import corpus_path
from boost_jax.data.manifest import (
    FORMAT_VERSION,
    eval_split_label,
    is_dataset,
    make_manifest,
    read_manifest,
)
from boost_jax.data.prepare_checks import (
    DEFAULT_EVAL_FRACTION,
    check_disjoint,
    check_inputs,
    check_numbers,
    check_output,
    check_split,
)
from boost_jax.data.shards import ShardWriter as _ShardWriter  # the name tests reach it by
from boost_jax.data.shards import verify, write_json
from boost_jax.data.sources import Inputs, PrepareError
from boost_jax.data.tokenize_chunks import MIB, TOKENIZER_SPECS

__all__ = ["DEFAULT_EVAL_FRACTION", "FORMAT_VERSION", "MIB", "TOKENIZER_SPECS", "PrepareError",
           "default_cache_dir", "ensure_bundled", "eval_split_label", "prepare", "read_manifest",
           "verify"]


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
    work = publish.work_dir(output)
    eval_fraction = check_split(eval_fraction, eval_inputs, eval_pattern)
    args = dict(inputs=[str(p) for p in inputs], pattern=pattern,
                eval_inputs=[str(p) for p in eval_inputs], eval_pattern=eval_pattern,
                tokenizer=tokenizer, eval_fraction=eval_fraction, seed=seed,
                text_field=text_field, chunk_mb=chunk_mb, chunks_per_shard=chunks_per_shard)
    check_numbers(eval_fraction, chunk_mb, chunks_per_shard, tokenizer_sample_mb)
    tokenize_chunks.check_spec(tokenizer)
    check_output(output, args, overwrite)
    train = check_inputs(inputs, pattern, output, text_field)
    held = None
    if eval_inputs:
        held = check_inputs(eval_inputs, eval_pattern, output, text_field, "--eval_input",
                            "--eval_pattern")
        check_disjoint(train, held)
    # everything checked: from here on, the run writes
    if unfinished.previous_args(work) not in (None, args):
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
    shard_dir = unfinished.open_work_dir(work, args)
    if (work / "manifest.json").exists():  # killed between the manifest and the rename
        return _publish(work, output)
    unfinished.remove_stale(shard_dir)
    files, eval_files = train.files, held.files if held else []
    for flag, found, pattern in (("input", train, "pattern"), ("eval_input", held, "eval_pattern")):
        if log and found is not None and args[pattern] is not None:
            n = len(found.files)
            log(f"--{flag}: reading {n} file{'s' * (n != 1)}, ignoring {len(found.ignored)} not "
                f"matching --{pattern}={args[pattern]!r}")
    text_field, seed = args["text_field"], args["seed"]
    chunk_bytes, per_shard = int(args["chunk_mb"] * MIB), args["chunks_per_shard"]
    tok = tokenize_chunks.run_tokenizer(args["tokenizer"], files, text_field, work, sample_mb, log)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)
    done = unfinished.finished_shards(shard_dir, dtype.itemsize)
    if done and log:
        log(f"resuming: {len(done)} finished shards kept")
    # the progress bar counts input bytes: chunk i spans input bytes todo.positions[i]
    todo = Chunks(files, eval_files, text_field, chunk_bytes, per_shard, done)

    def within(index: int, fraction: float) -> None:  # in-process: a part of chunk index done
        begin, end = todo.positions[index]
        bar.update(int(begin + fraction * (end - begin)) - bar.n)

    total = sum(f.stat().st_size for f in files + eval_files)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing",
               delay=1, file=sys.stderr, disable=None if progress else True, dynamic_ncols=True)

    def say(message: str) -> None:
        if log:
            with tqdm.external_write_mode(file=sys.stderr):
                log(message)

    records, writer, tokens = dict(done), None, 0
    in_flight = 2 * max(workers, 1)
    with bar, tokenize_chunks.pool(workers, work) as executor:
        for index, (ids, lengths) in tokenize_chunks.tokenized(executor, iter(todo), seed,
                                                               dtype.name, in_flight, within):
            shard = index // per_shard
            if writer is not None and writer.index != shard:
                records[writer.index] = writer.close()
                say(f"shard {writer.index}: {writer.tokens:,} tokens")
            if writer is None or writer.index != shard:
                writer = _ShardWriter(shard_dir, shard, args["eval_fraction"], todo.split(shard))
            writer.write(ids, lengths)
            tokens += len(ids)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
            bar.update(todo.positions.pop(index)[1] - bar.n)
        if writer is not None:
            records[writer.index] = writer.close()
        bar.update(todo.read - bar.n)
    if not records:
        raise PrepareError(f"no text to prepare in {', '.join(args['inputs'])}")
    write_json(work / "manifest.json", make_manifest(tok, dtype.name, records, train, held, args))
    return _publish(work, output)


def _publish(work: Path, output: Path) -> dict:
    """Move the finished work directory to ``output`` (a dataset there replaced,
    :func:`boost_jax.publish.publish`); returns the manifest."""
    publish.publish(work, output, is_dataset)
    return read_manifest(output)


def ensure_bundled(name: str, tokenizer: str, eval_fraction: float,
                   cache_dir: str | Path | None = None, timeout: float = 1800.0) -> Path:
    """Prepare a bundled corpus once into the cache; return its directory. Processes that
    share the cache take turns: the first prepares (saying so in one line on stderr, with a
    progress bar), the others find it done."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = tokenizer.replace(":", "").replace("/", "_")
    out = cache / "data" / f"{name}-{tag}-eval{eval_fraction:g}-v{FORMAT_VERSION}"
    if not (out / "manifest.json").exists():
        with exclusive(out.with_name(out.name + ".lock"), timeout):
            if not (out / "manifest.json").exists():
                source = corpus_path(name)
                print(f"preparing the bundled corpus {name!r} with tokenizer {tokenizer} into "
                      f"{out} (first use only)", file=sys.stderr, flush=True)
                # overwrite: an unfinished run of other arguments (the package moved) restarts
                prepare([source], out, tokenizer, eval_fraction, overwrite=True)
    return out


if __name__ == "__main__":  # the command's documented name; the command: commands/prepare.py
    import runpy

    runpy.run_module("boost_jax.commands.prepare", run_name="__main__", alter_sys=True)
