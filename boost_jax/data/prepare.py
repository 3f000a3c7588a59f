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

# (Not in the docstring above, which is the command's --help.) This module holds prepare(): the
# checks, then the run in .<output>.partial, published when complete; ensure_bundled(); and the
# command's flags and main() (absl's --help lists the flags of the module run as __main__). The
# parts: sources.py (the inputs), chunking.py (their numbered chunks), tokenizing.py (the
# tokenizer, the worker processes), shards.py (shard files, --verify), manifest.py, unfinished.py
# (what an unfinished run left), prepare_checks.py (the checks before writing),
# prepare_command.py (the command's body: summary, exit codes), cache.py (the cache of bundled
# corpora) and boost_jax/publish.py (the output checks and the renames into place, shared with
# the export).

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from boost_jax import publish
from boost_jax.data import prepare_command, tokenizing, unfinished
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
from boost_jax.data.prepare_command import PROG
from boost_jax.data.shards import ShardWriter as _ShardWriter  # the name tests reach it by
from boost_jax.data.shards import verify, write_json
from boost_jax.data.sources import Inputs, PrepareError
from boost_jax.data.tokenizing import MIB, TOKENIZER_SPECS

if TYPE_CHECKING:
    from absl.flags import FlagValues

__all__ = ["DEFAULT_EVAL_FRACTION", "FORMAT_VERSION", "MIB", "PROG", "TOKENIZER_SPECS",
           "PrepareError", "default_cache_dir", "define_flags", "ensure_bundled",
           "eval_split_label", "main", "prepare", "read_manifest", "verify"]


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
    tokenizing.check_spec(tokenizer)
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
    tok = tokenizing.run_tokenizer(args["tokenizer"], files, text_field, work, sample_mb, log)
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
    with bar, tokenizing.pool(workers, work) as executor:
        for index, (ids, lengths) in tokenizing.tokenized(executor, iter(todo), seed, dtype.name,
                                                          in_flight, within):
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


def main(argv: Sequence[str], flag_values: FlagValues | None = None) -> int:
    """The command, once absl has parsed the flags (into ``flag_values``, by default the global
    ``FLAGS``); returns the exit code: 0, 1 (``--verify`` found problems), 2 (a user error,
    one line on stderr) or 130 (interrupted). Its body: data/prepare_command.py."""
    return prepare_command.run(argv, flag_values, prepare)


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
                        "hf:<tokenizer.json or its directory>", flag_values=fv)
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
