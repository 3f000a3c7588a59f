"""``python -m boost_jax.train``: the absl + gin entry point.

    python -m boost_jax.train [--gin_file=F ...] [--gin_param='Model.arch="svd"' ...] [--workdir=W]

With no flags it trains the default small CoLA model on the bundled corpus. A run in a workdir
that already holds checkpoints resumes from the newest intact one. Gin files are looked up as
given, then in the repository's ``configs/`` directory.
"""

from __future__ import annotations

import logging as pylogging
import os
import sys
from pathlib import Path

from absl import app, flags, logging

from boost_jax.config import ConfigError, load_config, parse_gin

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "gin config file(s), applied in order")
flags.DEFINE_multi_string("gin_param", [], "gin binding(s), e.g. --gin_param=Model.rank=64")
flags.DEFINE_string("workdir", "runs/default", "checkpoints, metrics and logs go here")

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def _enable_compilation_cache() -> None:
    import jax

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR",
                           str(Path.home() / ".cache" / "boost_jax" / "jax_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)


class _QuietLibraries(pylogging.Filter):
    """INFO lines from boost_jax only; other libraries (orbax, jax) from WARNING up."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno >= pylogging.WARNING or "boost_jax" in record.pathname


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(_QuietLibraries())
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_param, search_paths=[str(CONFIGS_DIR)])
        config = load_config()
        from boost_jax.parallel.mesh import request_host_devices

        request_host_devices(config.parallel.num_devices)  # before JAX starts its backends
        import jax

        _enable_compilation_cache()
        if jax.default_backend() == "cpu" and config.parallel.num_devices > 1:
            logging.info("no accelerator: simulating %d CPU devices for the (data, pipe, tensor) "
                         "mesh %s", config.parallel.num_devices, config.parallel.shape)
        from boost_jax.train.loop import run

        summary = run(config, FLAGS.workdir)
    except ConfigError as err:
        # gin appends the configurable's name on a second line; the first line says it all
        print(f"boost_jax.train: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if summary.interrupted_by is not None:
        return 128 + summary.interrupted_by
    return 0


def run_app() -> None:
    app.run(main)
