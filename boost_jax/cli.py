"""What every ``python -m boost_jax.*`` command shares: gin flags, quiet library logs, the
compilation cache, simulated CPU devices, and one-line errors.

A command defines its own flags, calls :func:`define_gin_flags`, and wraps its body with
:func:`run_command`, which parses gin, builds the validated :class:`~boost_jax.config.Config`,
asks for as many CPU devices as the mesh needs (before JAX starts its backends) and turns a
:class:`~boost_jax.config.ConfigError` into ``<prog>: error: <one line>`` and exit code 2
(``BOOST_JAX_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations

import dataclasses
import logging as pylogging
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from absl import app, flags, logging

from boost_jax.config import Config, ConfigError
from boost_jax.gin_io import GROUPS, load_config, parse_gin

FLAGS = flags.FLAGS
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def define_gin_flags() -> None:
    """``--gin_file``, ``--gin_param`` and the multi-process flags (once per process)."""
    if "gin_file" in FLAGS:
        return
    flags.DEFINE_multi_string("gin_file", [], "gin config file(s), applied in order; looked up "
                              "as given, then in the repository's configs/")
    flags.DEFINE_multi_string("gin_param", [], "gin binding(s), e.g. --gin_param=Model.rank=64")
    flags.DEFINE_string("coordinator_address", None, "multi-process: host:port of process 0")
    flags.DEFINE_integer("num_processes", None, "multi-process: number of processes")
    flags.DEFINE_integer("process_id", None, "multi-process: this process's rank")
    flags.DEFINE_string("local_device_ids", None, "multi-process: comma-separated local devices "
                        "this process drives (default: all it sees)")
    flags.DEFINE_float("distributed_timeout", 120.0, "seconds to wait for the coordinator")
    flags.DEFINE_integer("heartbeat_timeout", 60, "seconds after which a process whose peer "
                         "stopped answering is terminated")


#: ``--checkpoint_dir``'s help for the commands that read a run's checkpoints
READ_CHECKPOINTS = ("where the run's checkpoints are (its --checkpoint_dir: a directory, "
                    "s3://... or gs://...; default: <workdir>/checkpoints)")


def define_checkpoint_dir_flag(help_text: str = READ_CHECKPOINTS) -> None:
    """``--checkpoint_dir``, one definition for every command: the trainer's (where its
    checkpoints go) and those that read a run's (eval, export, generate; train/trained.py)."""
    flags.DEFINE_string("checkpoint_dir", None, help_text)


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache in ``$JAX_COMPILATION_CACHE_DIR`` (default
    ``~/.cache/boost_jax/jax_cache``), for every command."""
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "boost_jax" / "jax_cache")))


class QuietLibraries(pylogging.Filter):
    """INFO lines from boost_jax only; other libraries (orbax, jax) from WARNING up, each as its
    message line without the traceback it carries (unless ``BOOST_JAX_DEBUG=1``): a save that
    fails on a full disk is one ``error:`` line of boost_jax's, not orbax's tracebacks of
    every thread it went through (about 640 lines)."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        if "boost_jax" in record.pathname:
            return True
        if record.levelno < pylogging.WARNING:
            return False
        if debugging():
            return True
        if record.name == "asyncio" and "exception was never retrieved" in record.getMessage():
            return False  # the futures of an abandoned save (reported by boost_jax), collected
        if record.exc_info:
            record.exc_info, record.exc_text = None, None
        return True


def setup_devices(config: Config, simulated: bool = True) -> None:
    """Start multi-process JAX (or request the simulated CPU devices the mesh needs), turn on
    the compilation cache, quiet processes other than 0. Before JAX starts its backends.
    ``simulated=False``: the command's mesh is not run on the host's devices (it compiles for
    mock GPUs: commands/gpu_compile.py), so no line says they are simulated."""
    from boost_jax.parallel import distributed
    from boost_jax.parallel.mesh import request_host_devices

    cluster = distributed.detect(FLAGS.coordinator_address, FLAGS.num_processes,
                                 FLAGS.process_id, FLAGS.local_device_ids)
    local = config.parallel.num_devices
    if cluster is None:
        request_host_devices(local)  # before JAX starts its backends
    else:
        local = distributed.initialize(cluster, local, FLAGS.distributed_timeout,
                                       FLAGS.heartbeat_timeout,
                                       cpu_collectives=cpu_collectives())
    import jax

    if jax.process_index() > 0:  # logs and metrics come from process 0
        logging.set_verbosity(logging.WARNING)

    enable_compilation_cache()
    if simulated and jax.default_backend() == "cpu" and config.parallel.num_devices > 1:
        from boost_jax.operations.progress import say

        each = f" in each of {jax.process_count()} processes" if jax.process_count() > 1 else ""
        say(f"no accelerator: simulating {local} CPU devices{each} for the (data, pipe, tensor) "
            f"mesh {config.parallel.shape}", file=sys.stderr)  # stdout may be --json


def cpu_collectives(environ: Mapping[str, str] | None = None) -> str | None:
    """The cross-process collectives this command asks of JAX's CPU backend in a multi-process
    run (:func:`boost_jax.parallel.distributed.initialize`): ``"gloo"`` for a CPU-only run
    (``JAX_PLATFORMS=cpu``: simulated devices talk to the other processes' through it), unless
    ``JAX_CPU_COLLECTIVES_IMPLEMENTATION`` chooses; None otherwise, which leaves JAX's setting
    alone (JAX's default is gloo in jax 0.10.2; a GPU run's collectives go
    through NCCL). A process-wide JAX setting, so the entry point's decision."""
    env = os.environ if environ is None else environ
    platforms = {p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platforms != {"cpu"} or "JAX_CPU_COLLECTIVES_IMPLEMENTATION" in env:
        return None
    return "gloo"


def limit_lapack_threads(config: Config) -> None:
    """``OPENBLAS_NUM_THREADS=1`` for ``Train.optimizer='loro'`` on CPU unless the user set it
    (why: :func:`boost_jax.parallel.loro_qr.lapack_threads_limited`). OpenBLAS reads it once,
    when scipy's LAPACK loads; a warning says when that happened too early for it to apply.
    A process-wide setting, so the entry point's (after :func:`setup_devices`)."""
    import jax

    from boost_jax.parallel.loro_qr import LAPACK_MODULE

    if config.train.optimizer != "loro" or jax.default_backend() != "cpu":
        return
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return
    if LAPACK_MODULE in sys.modules:
        logging.warning("Train.optimizer='loro' on CPU: scipy's LAPACK was loaded before "
                        "OPENBLAS_NUM_THREADS could be set; the exact step may run slowly "
                        "(start with OPENBLAS_NUM_THREADS=1)")
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


class UserLines(pylogging.Formatter):
    """A log record as a line a user reads: ``<prog> (warning): <message>`` -- no date, thread
    id or source line (absl's format, kept with ``--verbosity``). Not ``<prog>: error:``: that
    is the one line a command ends with when it fails (:func:`user_error`)."""

    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: pylogging.LogRecord) -> str:
        return f"{self.prog} ({record.levelname.lower()}): {record.getMessage()}"


def setup_logging(prog: str) -> None:
    """The command's logs at the user's level: warnings and errors as :class:`UserLines`
    (what a run says it needs, it prints: operations/progress.py ``say``); ``--verbosity=0``
    (absl's flag, or ``-v 0``) shows the INFO lines too, ``--verbosity=1`` more, in absl's
    own format. Other libraries' lines pass :class:`QuietLibraries`."""
    handler = logging.get_absl_handler()
    handler.addFilter(QuietLibraries())
    if FLAGS["verbosity"].present:
        return  # absl applied the user's level
    logging.set_verbosity(logging.WARNING)
    handler.setFormatter(UserLines(prog))


def run_command(prog: str, body: Callable[[Config], int | None], simulated: bool = True) -> int:
    """Parse gin, validate, set up devices and run ``body(config)``; returns the exit code.
    ``simulated``: :func:`setup_devices`'."""
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_param, search_paths=[str(CONFIGS_DIR)])
        config = load_config()
        setup_devices(config, simulated)
        limit_lapack_threads(config)
        return body(config) or 0
    except ConfigError as err:
        return user_error(prog, err)


def debugging() -> bool:
    """``BOOST_JAX_DEBUG=1``: user errors raise with their traceback instead of one line."""
    return os.environ.get("BOOST_JAX_DEBUG", "") not in ("", "0")


def user_error(prog: str, err: Exception) -> int:
    """Report a user-caused failure as ``<prog>: error: <first line>``; the exit code 2."""
    if debugging():
        raise err
    # gin appends the configurable's name on a second line; the first line says it all
    print(f"{prog}: error: {str(err).splitlines()[0]}", file=sys.stderr)
    return 2


def _gin_hint(err: flags.Error) -> str:
    """``; config fields are gin bindings: --gin_param=Train.steps=...`` for a flag that is a
    config field."""
    name = re.search(r"Unknown command line flag '([\w-]+)'", str(err))
    fields = [f"{cls.__name__}.{f.name}" for cls in GROUPS.values()
              for f in dataclasses.fields(cls) if name and f.name == name.group(1)]
    return f"; config fields are gin bindings: --gin_param={fields[0]}=..." if fields else ""


def exit_now(code: int) -> None:
    """End the process with ``code`` now if threads that would keep it alive are left (not
    daemons: Python waits for them at exit), after flushing what it printed and logged; else
    return. For command-line entry points only, after their work has unwound."""
    left = [t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not left:
        return
    logging.info("leaving %d thread(s) of libraries behind: %s", len(left),
                 ", ".join(t.name for t in left))
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: absl's help flags: the command prints its help and exits 0 (absl exits 1)
HELP_FLAGS = frozenset({"--help", "-?", "--helpshort", "--helpfull", "--helpxml"})


def run_app(prog: str, main: Callable[[list[str]], int | None]) -> None:
    """``absl.app.run(main)`` with one-line errors: an unknown or malformed flag and a usage
    error (``app.UsageError``) print ``<prog>: error: ...`` and exit with code 2; ``--help``
    prints the help and exits 0; logs at the user's level (:func:`setup_logging`)."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return FLAGS(argv)
        except SystemExit as done:  # absl's --help (and --helpfull, ...) exits 1 after the text
            if done.code == 1 and HELP_FLAGS.intersection(a.split("=")[0] for a in argv[1:]):
                sys.exit(0)
            raise
        except flags.Error as err:
            sys.exit(user_error(prog, ConfigError(f"{err}{_gin_hint(err)} (see --help)")))

    def guarded(argv: list[str]) -> int | None:
        setup_logging(prog)
        try:
            return main(argv)
        except app.UsageError as err:
            return user_error(prog, err)

    app.run(guarded, flags_parser=parse)
