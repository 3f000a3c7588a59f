"""``python -m boost_jax.eval``: held-out perplexity of a trained run, or lm-eval tasks on it.

    python -m boost_jax.eval --workdir=runs/default                    # the run's own data
    python -m boost_jax.eval --workdir=W --data=data/mine --max_batches=100 --json
    python -m boost_jax.eval --workdir=W --gin_param=Parallel.data=1 --gin_param=Parallel.tensor=2
    python -m boost_jax.eval --workdir=W --tasks=lambada_openai,hellaswag --limit=100
    python -m boost_jax.eval --workdir=W --tasks=my_task --include_path=tasks/ --only_include_path
    python -m boost_jax.eval --checkpoint_dir=s3://bucket/run/checkpoints     # no local workdir

The checkpoints are read from ``--checkpoint_dir``, what the trainer was given (a local
directory, ``s3://bucket/prefix`` or ``gs://bucket/prefix``; default:
``<workdir>/checkpoints``); given it, ``--workdir`` may be left out.

Perplexity (no ``--tasks``): the checkpoint ``--step`` of the run (default: the newest)
evaluated on every full global batch of the eval split of ``--data`` (a prepared dataset
directory or ``bundled:<name>``; default: the run's ``Data``), or the first ``--max_batches``,
at ``--seq_len`` / ``--batch_size`` / ``--dtype`` (default: the run's). The mesh is the run's
``Parallel`` config with any ``--gin_param=Parallel.*`` binding applied; when the run's mesh
needs more devices than this host has and no binding was given, one device is used. CPU-only
hosts simulate the devices a mesh needs, as the trainer does. ``Data.*`` bindings apply too
(e.g. ``Data.packing='document'``); the model is always the run's. Prints ``loss``,
``perplexity``, the low-rank papers' figures (their definition, docs/guides/eval.md; with
``--cola_tokens=10000000`` their stopping rule), the tokens evaluated and which eval split was
scored (a held-out validation
input, or the tail of the training shards: data/prepare.py), or with ``--json`` one JSON
object.

lm-eval tasks (``--tasks``, needs ``pip install -e ".[eval]"``): the run as an
lm-evaluation-harness model on one device (boost_jax/evaluation/harness.py), the tasks by name
or glob pattern; ``--include_path`` adds a directory of task YAML files. Prints lm-eval's table,
or with ``--json`` its ``results`` dict.

Exit codes: 0 done, 2 bad input (one line on stderr: a missing workdir or checkpoint, a dataset
without a usable eval split, a mesh that does not fit the devices, an unknown task, lm-eval not
installed; ``BOOST_JAX_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags

from boost_jax import cli
from boost_jax.cli import CONFIGS_DIR, define_gin_flags, user_error
from boost_jax.config import DTYPES, ConfigError, Data, Model, Parallel, Train
from boost_jax.gin_io import bound, parse_gin

PROG = "boost_jax.eval"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (once per process)."""
    define_gin_flags()
    if "workdir" in FLAGS:
        return
    flags.DEFINE_string("workdir", None, "the training run to evaluate (its --workdir)")
    cli.define_checkpoint_dir_flag()
    flags.DEFINE_integer("step", None, "the checkpoint to evaluate (default: the newest)")
    flags.DEFINE_string("data", None, "perplexity: a prepared dataset directory or "
                        "bundled:<name> whose eval split is scored (default: the run's "
                        "Data.path)")
    flags.DEFINE_integer("seq_len", None, "tokens per evaluated sequence; with --tasks, the "
                         "longest scored row (default: the run's Train.seq_len)")
    flags.DEFINE_integer("batch_size", None, "sequences per global batch; with --tasks, rows "
                         "per scoring call (default: the run's Train.batch_size)")
    flags.DEFINE_enum("dtype", None, list(DTYPES), "compute dtype (default: the run's "
                      "Train.dtype)")
    flags.DEFINE_integer("max_batches", None, "perplexity: evaluate only the first N global "
                         "batches (default: every full batch of the eval split)")
    flags.DEFINE_integer("cola_tokens", None, "perplexity: stop as the low-rank papers' "
                         "evaluation does, once more than N tokens were seen (theirs: "
                         "10000000), in batches of the run's Train.loss_group_rows rows")
    flags.DEFINE_bool("json", False, "print the result as one JSON object")
    flags.DEFINE_list("tasks", None, "lm-eval tasks (names or glob patterns) to run instead "
                      "of the perplexity; needs pip install -e \".[eval]\"")
    flags.DEFINE_string("include_path", None, "lm-eval: a directory of task YAML files")
    flags.DEFINE_bool("only_include_path", False, "lm-eval: index only the tasks under "
                      "--include_path, not lm-eval's own (whose index takes seconds to build)")
    flags.DEFINE_float("limit", None, "lm-eval: documents per task (a number < 1: a fraction)")
    flags.DEFINE_integer("num_fewshot", None, "lm-eval: few-shot examples per prompt")
    flags.DEFINE_integer("max_gen_toks", 256, "lm-eval: new tokens of a generation whose task "
                         "does not say")
    flags.DEFINE_integer("seed", 0, "lm-eval: seed of few-shot sampling and sampled "
                         "generations")


def _reject_bindings() -> None:
    """Model and Train bindings do not apply to an evaluation: one line saying what does."""
    for name in bound(Model):
        raise ConfigError(f"Model.{name} is bound, but evaluation runs the run's own model; "
                          "drop the binding")
    for name in bound(Train):
        raise ConfigError(f"Train.{name} is bound, but evaluation takes only --seq_len, "
                          "--batch_size and --dtype (and Parallel.*, Data.* bindings)")


def _run_fields(trained) -> dict:
    """The run in the JSON output: its workdir (None when only --checkpoint_dir was given),
    the checkpoint directory when given, the step."""
    out = {"workdir": None if trained.workdir is None else str(trained.workdir)}
    if FLAGS.checkpoint_dir:
        out["checkpoint_dir"] = trained.checkpoint_dir
    return {**out, "step": trained.step}


def _print_perplexity(trained, result) -> None:
    from boost_jax.operations.progress import duration, say

    if FLAGS.json:
        say(json.dumps({**_run_fields(trained), **result.to_dict()}))
        return
    m = trained.model
    left = f"; {result.left_out} eval windows left out" if result.left_out else ""
    mesh = " x ".join(f"{k} {v}" for k, v in result.mesh.items())
    say(f"{trained.source} at step {trained.step} ({m.arch} {m.size}) on the eval split of "
        f"{result.data}")
    say(f"eval split  {result.eval_split}")
    say(f"loss        {result.loss:.4f}")
    say(f"perplexity  {result.perplexity:.2f}")
    say(f"            (the mean over every token evaluated; by the low-rank papers' definition, "
        f"the {result.cola_batches} batches' mean losses summed over "
        f"{result.cola_batches + 1}: loss {result.cola_loss:.4f}, perplexity "
        f"{result.cola_perplexity:.2f})")
    say(f"tokens      {result.tokens:,} in {result.batches} batches of {result.batch_size} x "
        f"{result.seq_len}{left}")
    say(f"mesh        {mesh}, {result.dtype}, {duration(result.seconds)}")


def _run_tasks(trained, config) -> int:
    import jax
    from lm_eval.utils import make_table

    from boost_jax.evaluation.harness import BoostLM, run_tasks
    from boost_jax.operations.progress import say

    if jax.process_count() > 1:
        raise ConfigError("--tasks runs in one process (on one device); start it without the "
                          "multi-process flags")
    t = config.train
    lm = BoostLM(trained=trained, max_length=t.seq_len, batch_size=t.batch_size,
                 dtype=t.dtype, max_gen_toks=FLAGS.max_gen_toks, seed=FLAGS.seed)
    limit = FLAGS.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    results = run_tasks(lm, FLAGS.tasks, FLAGS.include_path, limit, FLAGS.num_fewshot,
                        not FLAGS.only_include_path, seed=FLAGS.seed)
    if FLAGS.json:
        say(json.dumps({**_run_fields(trained), "results": results["results"]},
                       default=float))
    else:
        say(make_table(results))
    return 0


def evaluate() -> int:
    """The command's body (flags parsed); raises ConfigError on a user mistake."""
    parse_gin(FLAGS.gin_file, FLAGS.gin_param, search_paths=[str(CONFIGS_DIR)])
    _reject_bindings()
    if not FLAGS.workdir and not FLAGS.checkpoint_dir:
        raise ConfigError("give the run to evaluate: --workdir=W (a training run's workdir) or "
                          "--checkpoint_dir=D (its checkpoints)")
    if FLAGS.tasks:
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ConfigError("--tasks needs lm-eval: pip install -e \".[eval]\"") from None
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from boost_jax.evaluation.perplexity import (
        ONE_DEVICE,
        eval_config,
        evaluate_perplexity,
        fit_devices,
    )
    from boost_jax.train.trained import load_trained, trained_config

    run, step = trained_config(FLAGS.workdir, FLAGS.step, FLAGS.checkpoint_dir)
    parallel = bound(Parallel)
    config = eval_config(run, parallel, bound(Data), FLAGS.data, FLAGS.seq_len,
                         FLAGS.batch_size, FLAGS.dtype)
    if FLAGS.tasks:  # one device: no mesh to set up
        config = dataclasses.replace(config, parallel=ONE_DEVICE)
    cli.setup_devices(config)  # devices (simulated on CPU), multi-process, compilation cache
    config, devices = fit_devices(config, bool(parallel))
    trained = load_trained(FLAGS.workdir, step, FLAGS.checkpoint_dir)
    if FLAGS.tasks:
        return _run_tasks(trained, config)
    _print_perplexity(trained, evaluate_perplexity(trained.params, config, devices,
                                                   FLAGS.max_batches,
                                                   cola_tokens=FLAGS.cola_tokens))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        return evaluate()
    except ConfigError as err:
        return user_error(PROG, err)


if __name__ == "__main__":
    define_flags()
    cli.run_app(PROG, main)
