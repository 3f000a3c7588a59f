"""What every command shares (boost_jax/cli.py): bad flags and usage errors are one line on
stderr with exit code 2; ``BOOST_JAX_DEBUG=1`` shows the traceback instead; the process-wide
settings only an entry point makes (CPU collectives, LAPACK threads)."""

import os
import sys
from types import SimpleNamespace

import pytest

from boost_jax import cli
from boost_jax.commands.bench import main as bench_main
from boost_jax.commands.comm_report import main as comm_report_main


def _exit_code(monkeypatch, prog, main, argv):
    monkeypatch.setattr(sys, "argv", [prog, *argv])
    with pytest.raises(SystemExit) as info:
        cli.run_app(prog, main)
    return info.value.code


@pytest.mark.parametrize("prog, main, argv, needle", [
    ("bench", bench_main, ["nosuch"], "bench: error: unknown benchmark 'nosuch'; usage: python "
                                      "-m boost_jax.bench {tp|"),
    ("bench", bench_main, [], "bench: error: no benchmark named; usage:"),
    ("comm_report", comm_report_main, ["--bogus"],
     "comm_report: error: Unknown command line flag 'bogus' (see --help)"),
    ("comm_report", comm_report_main, ["--seq_len=4"], "Unknown command line flag 'seq_len'; "
                                                       "config fields are gin bindings: "
                                                       "--gin_param=Train.seq_len=..."),
    ("comm_report", comm_report_main, ["extra"], "comm_report: error: unexpected arguments: "
                                                 "extra"),
])
def test_flag_and_usage_errors_are_one_line(monkeypatch, capsys, prog, main, argv, needle):
    monkeypatch.delenv("BOOST_JAX_DEBUG", raising=False)
    assert _exit_code(monkeypatch, prog, main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--help"], ["--helpfull"], ["-?"]])
def test_help_exits_0(monkeypatch, capsys, argv):
    """``--help`` is a request, not an error: the help on stdout and exit code 0 (absl exits 1;
    issue 49). Seen failing on the old run_app (1)."""
    assert _exit_code(monkeypatch, "comm_report", comm_report_main, argv) == 0
    assert "--helpfull" in capsys.readouterr().out


def test_logs_are_at_the_users_level():
    """Issue 49: a command's log lines are a user's -- warnings as ``<prog> (warning): ...``,
    no INFO lines, no date, thread id or source line -- unless ``--verbosity`` asks for more.
    Seen failing on the old set-up (INFO lines as ``I1129 03:36:39.763 22768
    attention.py:124] ...``)."""
    import logging as pylogging

    from absl import logging

    handler = logging.get_absl_handler()  # restored after the test (tests/conftest.py)
    logger = pylogging.getLogger("absl")
    cli.setup_logging("boost_jax.train")
    assert not logger.isEnabledFor(pylogging.INFO) and logger.isEnabledFor(pylogging.WARNING)
    record = logger.makeRecord("absl", pylogging.WARNING, "boost_jax/operations/x.py", 1,
                               "took over the lock of a run that ended", (), None)
    assert handler.filter(record)
    assert handler.format(record) == ("boost_jax.train (warning): took over the lock of a run "
                                      "that ended")


def test_the_debug_switch_raises(monkeypatch):
    err = ValueError("Train.steps=0 must be a positive integer")
    monkeypatch.setenv("BOOST_JAX_DEBUG", "1")
    with pytest.raises(ValueError, match="Train.steps=0"):
        cli.user_error("boost_jax.train", err)
    monkeypatch.setenv("BOOST_JAX_DEBUG", "0")
    assert cli.user_error("boost_jax.train", err) == 2


@pytest.mark.parametrize("env, want", [
    ({"JAX_PLATFORMS": "cpu"}, "gloo"),
    ({"JAX_PLATFORMS": "cuda"}, None),
    ({"JAX_PLATFORMS": "cpu,cuda"}, None),
    ({}, None),  # JAX picks the platform: its own collectives setting stays
    ({"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "mpi"}, None),
])
def test_cli_asks_for_gloo_on_cpu_only_runs(env, want):
    assert cli.cpu_collectives(env) == want


def _loro(optimizer="loro"):
    return SimpleNamespace(train=SimpleNamespace(optimizer=optimizer))


def test_the_entry_point_keeps_loros_lapack_to_one_thread(monkeypatch, caplog):
    """``Train.optimizer='loro'`` on CPU: ``OPENBLAS_NUM_THREADS=1`` before scipy's LAPACK
    loads (README, LORO on CPU), unless the user chose; not for other optimizers; a warning
    when the LAPACK was loaded too early for it to apply."""
    from boost_jax.parallel import loro_qr

    monkeypatch.setattr(loro_qr, "LAPACK_MODULE", "boost_jax_no_such_module")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    cli.limit_lapack_threads(_loro("adamw"))
    assert "OPENBLAS_NUM_THREADS" not in os.environ
    cli.limit_lapack_threads(_loro())
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    cli.limit_lapack_threads(_loro())
    assert os.environ["OPENBLAS_NUM_THREADS"] == "3"
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.setattr(loro_qr, "LAPACK_MODULE", "os")  # loaded already
    cli.limit_lapack_threads(_loro())
    assert "OPENBLAS_NUM_THREADS" not in os.environ
    assert "loaded before OPENBLAS_NUM_THREADS could be set" in caplog.text


@pytest.mark.parametrize("simulated", [True, False])
def test_only_a_mesh_run_on_the_host_says_its_devices_are_simulated(capsys, simulated):
    """``no accelerator: simulating N CPU devices`` on stderr when the command runs its mesh
    on the host's CPU devices; not for the commands that compile for mock GPUs
    (``gpu_compile``, ``bench memory --target``: ``simulated=False``), where it was wrong."""
    from boost_jax.config import Config, Data, Parallel, Train
    from boost_jax.testing import tiny

    cli.define_gin_flags()  # the multi-process flags setup_devices reads (unset: one process)
    config = Config(tiny(), Parallel(data=2, tensor=4), Train(batch_size=2), Data())
    cli.setup_devices(config, simulated)
    assert ("no accelerator: simulating 8 CPU devices" in capsys.readouterr().err) == simulated
