"""``python -m boost_jax.train``: the absl + gin entry point.

    python -m boost_jax.train [--gin_file=F ...] [--gin_param="Model.arch='svd'" ...] [--workdir=W]

With no flags it trains the default small CoLA model on the bundled corpus. ``--print_config``
lists every gin binding (``Model.*``, ``Parallel.*``, ``Train.*``, ``Data.*``) with its type,
default, what a resume may do with it and meaning. A run writes its operative configuration
(every field's value) to ``<workdir>/config.gin``; ``--gin_file`` on that file reproduces the
run. A run in a workdir that already holds checkpoints resumes from the newest intact one
(checkpointing/checkpointer.py: a checkpoint that does not fit the config is refused, one that is
damaged
moved aside); if all are damaged it stops with an error unless ``--fresh_start`` is given.
Gin files are looked up as given, then in the repository's ``configs/`` directory.

Exit codes: 0 done; 1 diverged, or a checkpoint or run file (metrics, TensorBoard) could not
be written or a checkpoint read (a full disk; storage errors that outlasted the retries); 2 bad
input, including checkpoints that do not fit the config or were trained on other data
(``--allow_data_change``), a workdir another run holds (operations/workdir_lock.py) and a step
that does not fit in the device's memory (one line on stderr; ``BOOST_JAX_DEBUG=1`` shows the
traceback); 75 hung: no train step finished within ``Train.hang_timeout_s`` (every thread's
stack in the workdir and the log; operations/watchdog.py); 128 + N stopped by signal N (agreed
across processes, after a checkpoint; or at once, without one, at a second signal).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from boost_jax import cli
from boost_jax.cli import define_gin_flags, run_command

FLAGS = flags.FLAGS
define_gin_flags()
flags.DEFINE_string("workdir", "runs/default", "checkpoints, metrics and logs go here")
cli.define_checkpoint_dir_flag("where checkpoints go (default: <workdir>/checkpoints): a "
                              "local directory, or s3://bucket/prefix or gs://bucket/prefix "
                              "(pip install 'boost_jax[s3]' or '[gcs]')")
flags.DEFINE_bool("print_config", False, "print every gin-configurable field (binding, type, "
                  "default, what a resume may do with it, meaning) and exit")
flags.DEFINE_bool("fresh_start", False, "train from step 0 when every checkpoint of --workdir "
                  "is damaged (they are moved aside, never deleted), or when none is found "
                  "where the workdir's run committed one; without it both are errors")

flags.DEFINE_bool("allow_data_change", False, "resume on a dataset other than the one the "
                  "checkpoints were trained on (Data.path re-prepared from other text, another "
                  "tokenizer or eval split); recorded in metrics.jsonl. Without it that resume "
                  "is refused")

EXIT_STORAGE = 1  # a checkpoint or run file could not be written (disk full, ...) or read
#: how XLA's error for an allocation it cannot make begins (a too-large step on the device)
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory"


def _train(config) -> int:
    from boost_jax.checkpointing.checkpointer import CheckpointReadError, CheckpointWriteError
    from boost_jax.operations.disk_errors import WriteError
    from boost_jax.operations.signals import StopRequest
    from boost_jax.train.loop import run

    try:  # SIGTERM / SIGINT: an agreed stop with a checkpoint (operations/signals.py)
        with StopRequest() as stop:
            summary = run(config, FLAGS.workdir, fresh_start=FLAGS.fresh_start,
                          checkpoint_dir=FLAGS.checkpoint_dir,
                          allow_data_change=FLAGS.allow_data_change, stop=stop,
                          on_hang=os._exit)  # a hung process ends (operations/watchdog.py)
    except (CheckpointWriteError, CheckpointReadError, WriteError) as err:
        print(f"boost_jax.train: error: {err}", file=sys.stderr)
        return EXIT_STORAGE
    except RuntimeError as err:  # XLA's out of memory (jax.errors.JaxRuntimeError)
        if not str(err).startswith(OUT_OF_MEMORY) or cli.debugging():
            raise
        what = str(err).splitlines()[0].removeprefix("RESOURCE_EXHAUSTED:").strip()
        print(f"boost_jax.train: error: the train step does not fit in memory ({what}); lower "
              "Train.batch_size or Train.seq_len, set Parallel.remat='lowrank' or 'full', or "
              "spread the model over more devices (python -m boost_jax.plan)", file=sys.stderr)
        return 2
    if summary.diverged is not None:
        print(f"boost_jax.train: error: {summary.diverged}", file=sys.stderr)
        return 1
    return 0 if summary.interrupted_by is None else 128 + summary.interrupted_by


def print_config() -> None:
    """The table ``--print_config`` prints: every field, from the config dataclasses."""
    from boost_jax.gin_io import describe_fields

    rows = [("binding", "type", "default", "on resume", "meaning"), *describe_fields()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.print_config:
        print_config()
        return 0
    return run_command("boost_jax.train", _train)


def run_app() -> None:
    """The command: on a storage error (exit 1) the process ends at once, without waiting for
    library threads left behind (an abandoned orbax save's threads wait 300 s for signals that
    never come, keeping a failed job on its nodes; cli.py ``exit_now``)."""
    try:
        cli.run_app("boost_jax.train", main)
    except SystemExit as done:
        if done.code == EXIT_STORAGE:
            cli.exit_now(EXIT_STORAGE)
        raise


if __name__ == "__main__":
    flags.adopt_module_key_flags(cli)  # --help lists the shared flags too, not only --helpfull
    run_app()
