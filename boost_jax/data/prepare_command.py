"""The body of ``python -m boost_jax.data.prepare`` (data/prepare.py, which defines its flags
and its ``main``): verify a dataset, or prepare one and print its summary, with the command's
exit codes.

0: done or intact; 1: ``--verify`` found problems; 2: a user error, one line
``boost_jax.data.prepare: error: ...`` on stderr (a full disk or denied write mid-run too);
130: interrupted (Ctrl-C). ``BOOST_JAX_DEBUG=1`` raises instead (boost_jax/cli.py).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from boost_jax.data.manifest import eval_split_label
from boost_jax.data.shards import verify
from boost_jax.data.sources import PrepareError

if TYPE_CHECKING:
    from absl.flags import FlagValues

PROG = "boost_jax.data.prepare"
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def run(argv: Sequence[str], flag_values: FlagValues | None,
        prepare: Callable[..., dict]) -> int:
    """The command, once absl has parsed the flags (into ``flag_values``, by default the global
    ``FLAGS``), preparing with ``prepare`` (data/prepare.py's, passed in: that module imports
    this one); returns the exit code: 0, 1 (``--verify`` found problems), 2 (a user error, one
    line on stderr) or 130 (interrupted)."""
    from absl import flags

    from boost_jax.cli import debugging, user_error

    f = flag_values if flag_values is not None else flags.FLAGS
    try:
        return _command(argv, f, prepare)
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


def _command(argv: Sequence[str], f: FlagValues, prepare: Callable[..., dict]) -> int:
    """:func:`run` without its error handling: verify, or prepare and print the summary."""
    import resource

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
