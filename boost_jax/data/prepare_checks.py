"""The checks of a ``prepare`` run (data/prepare.py), made before anything is written.

Each refuses a user-caused problem with a one-line :class:`PrepareError` that says what is
wrong and what to do: numbers out of range, two eval splits, an output that is taken or cannot
be written (or an unfinished run of other arguments there), inputs that are missing,
unreadable, without text, inside the output or both train and eval inputs. The tokenizer spec
is checked in data/tokenize_chunks.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from boost_jax import publish
from boost_jax.data.manifest import describe, is_dataset
from boost_jax.data.sources import Inputs, PrepareError, list_inputs, read_documents
from boost_jax.data.unfinished import changed_args, previous_args

DEFAULT_EVAL_FRACTION = 0.02


def check_output(output: Path, args: dict, overwrite: bool) -> None:
    """Refuse an output that is taken or cannot be written, and an unfinished run of other
    arguments unless ``overwrite``."""
    refused = publish.refusal(output, is_dataset, overwrite)
    if refused is not None:
        raise PrepareError(_refused(output, refused))
    work = publish.work_dir(output)
    before = previous_args(work)
    if before is not None and before != args and not overwrite:
        raise PrepareError(f"{work} holds an unfinished run with other arguments "
                           f"({changed_args(before, args)}); rerun with those to finish it, or "
                           "pass --overwrite to discard it and start over")


def _refused(output: Path, refused: publish.Refusal) -> str:
    """The message of an output ``refused``."""
    if refused.reason == publish.FILE:
        return f"output {output} exists and is not a directory; choose another --output"
    if refused.reason == publish.TAKEN:
        return (f"{output} already holds a prepared dataset ({describe(output)}); pass "
                "--overwrite to replace it")
    if refused.reason == publish.FOREIGN:
        return (f"output {output} is a directory that holds other files, not a prepared "
                "dataset; choose another --output (never replaced, even with --overwrite)")
    if refused.reason == publish.PARENT_NOT_DIR:
        return (f"cannot create {output}: {refused.parent} is not a directory; choose another "
                "--output")
    return (f"cannot create {output}: {refused.parent} is not writable; choose an --output in a "
            "directory you can write to")


def check_inputs(inputs: Sequence[str | Path], pattern: str | None, output: Path,
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
                               or publish.work_dir(output).is_relative_to(where)):
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


def check_split(eval_fraction: float | None, eval_inputs: Sequence[str | Path],
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


def check_disjoint(train: Inputs, held: Inputs) -> None:
    """Refuse a file that is both a train and an eval input: its documents would be trained
    on and evaluated."""
    trained = {f.resolve() for f in train.files}
    both = [f for f in held.files if f.resolve() in trained]
    if both:
        raise PrepareError(f"{both[0]} is both a training and an eval input ({len(both)} such "
                           "files); select the training files with --pattern (e.g. "
                           "--pattern='c4-train.*.json.gz') or name them in --input")


def check_numbers(eval_fraction: float, chunk_mb: float, chunks_per_shard: int,
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
