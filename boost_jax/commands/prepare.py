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

Exit codes: 0: done or intact; 1: ``--verify`` found problems; 2: a user error, one line
``boost_jax.data.prepare: error: ...`` on stderr (a full disk or denied write mid-run too);
130: interrupted (Ctrl-C). ``BOOST_JAX_DEBUG=1`` raises instead (boost_jax/cli.py).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from boost_jax.data.manifest import eval_split_label
from boost_jax.data.prepare import DEFAULT_EVAL_FRACTION, prepare
from boost_jax.data.shards import verify
from boost_jax.data.sources import PrepareError

if TYPE_CHECKING:
    from absl.flags import FlagValues

PROG = "boost_jax.data.prepare"
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def main(argv: Sequence[str], flag_values: FlagValues | None = None) -> int:
    """The command, once absl has parsed the flags (into ``flag_values``, by default the global
    ``FLAGS``); returns the exit code: 0, 1 (``--verify`` found problems), 2 (a user error, one
    line on stderr) or 130 (interrupted)."""
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
    import resource


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
                   log=_status, pattern=f.pattern, eval_inputs=f.eval_input or (),
                   eval_pattern=f.eval_pattern, overwrite=f.overwrite)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    ignored = "".join(f"; ignored {meta.get(count, 0)} files not matching --{pattern}"
                      for count, pattern in (("ignored_files", "pattern"),
                                             ("eval_ignored_files", "eval_pattern"))
                      if meta.get(pattern) is not None)
    if f.json:  # the manifest less its shard list, and the peak memory
        summary = {k: v for k, v in meta.items() if k != "shards"}
        print(json.dumps(dict(summary, shards=len(meta["shards"]), peak_rss_mib=round(peak)),
                         indent=1))
        return 0
    print(f"prepared {f.output}: {meta['train_tokens']:,} train + {meta['eval_tokens']:,} eval "
          f"tokens in {len(meta['shards'])} shards, tokenizer {meta['tokenizer']} (vocabulary "
          f"{meta['vocab_size']:,}); eval split: {eval_split_label(meta)}{ignored}")
    print(f"{time.perf_counter() - start:.0f} s, peak memory of one process {peak:.0f} MiB; "
          f"the manifest: {f.output}/manifest.json (or --json)")
    return 0


def _status(message: str) -> None:
    """A status line of the run (inputs read, shards kept), on stderr: stdout is the
    summary's."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


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
    flags.DEFINE_bool("json", False, "print the prepared dataset's manifest (less its shard "
                      "list) and peak memory as JSON instead of the summary", flag_values=fv)
    flags.DEFINE_string("verify", None, "check the checksums of this prepared dataset and exit "
                        "(exit code 1 when it finds a problem)", flag_values=fv)


if __name__ == "__main__":
    from boost_jax.cli import run_app

    define_flags()
    run_app(PROG, main)
