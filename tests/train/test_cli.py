"""``python -m boost_jax.train`` as a user runs it: errors, SIGTERM, the 40 -> 80 resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gin
import jax
import pytest

from boost_jax.train.loop import run
from tests.train.test_trainer import _config, _losses

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)  # the trainer picks its devices
    return env


def _cmd(workdir, *gin):
    return [sys.executable, "-m", "boost_jax.train", f"--workdir={workdir}",
            *[f"--gin_param={g}" for g in gin]]


def _tiny_gin(data):
    return ["Model.size='tiny'", f"Data.path='{data}'", "Train.batch_size=8",
            "Train.seq_len=32", "Train.eval_batches=1", "Train.log_every=1"]


@pytest.mark.parametrize("gin, needle", [
    (["Model.depth=3"], "--gin_param=Model.depth=3: Configurable 'Model' doesn't have a "
                        "parameter named 'depth'"),
    (["Model.arch='moe'"], "Model.arch='moe' is not one of dense, svd, cola, lax"),
    (["Train.batch_size=7", "Parallel.data=2"], "Train.batch_size=7 is not divisible by "
                                                 "Parallel.data=2"),
    (["Data.path='/nonexistent/data'"], "Data.path='/nonexistent/data': no prepared dataset"),
    (["Train.learning_rate='abc'"], "Train.learning_rate='abc' must be a number"),
    (["Model.tie_embeddings=1"], "Model.tie_embeddings=1 must be a boolean (True or False) "
                                 "or None"),
    (["Train.steps=(3"], "--gin_param=Train.steps=(3: unbalanced brackets or quotes"),
    (["Data.path=mine"], "--gin_param=Data.path=mine: not a value: quote strings"),
    (["Train.batch_size=1048576", "Model.size='tiny'", "DATA"],
     "windows of 33 tokens, fewer than Train.batch_size=1048576; lower Train.batch_size to at "
     "most "),
])
def test_bad_input_is_one_line_before_compiling(tmp_path, tiny_data, capsys, gin, needle):
    """In process (the command's main, as absl calls it): exit code 2, one line naming the
    binding, nothing compiled and nothing written."""
    if "DATA" in gin:  # a corpus too small for the batch
        gin = [g for g in gin if g != "DATA"] + [f"Data.path='{tiny_data}'", "Train.seq_len=32"]
    workdir = tmp_path / "run"
    code, _, err = _train_main(capsys, workdir, gin)
    assert code == 2
    (error,) = [line for line in err.splitlines() if "error" in line]  # one line, no traceback
    assert error.startswith("boost_jax.train: error: ") and "Traceback" not in err
    assert needle in error
    assert not (workdir / "checkpoints").exists()


def train_in_process(workdir, bindings, **values) -> int:
    """``python -m boost_jax.train --workdir=WORKDIR --gin_param=B...`` in this process (a
    reference run costs no new process): its exit code. The run uses all the suite's 8
    devices, so its mesh must have 8 (a smaller one is refused once JAX has started)."""
    from absl import logging as absl_logging
    from absl.testing import flagsaver

    from boost_jax.commands import train as train_main

    # the command sets absl's verbosity and filters absl's handler; restoring the flags sets
    # the absl logger's level to the default verbosity's WARNING, which would hide later tests'
    # INFO lines from caplog: both are put back as they were
    logger, handler = absl_logging.get_absl_logger(), absl_logging.get_absl_handler()
    level, filters = logger.level, list(handler.filters)
    gin.clear_config()  # parsing finalises (locks) the config
    try:
        with flagsaver.flagsaver(workdir=str(workdir), gin_param=list(bindings), **values):
            return train_main.main(["boost_jax.train"])
    finally:
        gin.clear_config()
        logger.setLevel(level)
        handler.filters[:] = filters


def _train_main(capsys, workdir, bindings, **values):
    """:func:`train_in_process`: ``(exit code, stdout, stderr)``."""
    capsys.readouterr()
    code = train_in_process(workdir, bindings, **values)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_workdir_that_cannot_be_written_is_refused_first(tmp_path, monkeypatch, capsys):
    taken = tmp_path / "a_file"
    taken.write_text("")
    code, _, err = _train_main(capsys, taken / "run", ["Model.size='tiny'"])
    assert code == 2 and "is not writable" in err and "choose another --workdir" in err

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    # a bucket URL (buckets take checkpoints, --checkpoint_dir): refused, no local "s3:" made
    monkeypatch.chdir(tmp_path)
    code, _, err = _train_main(capsys, "s3://bucket/run", ["Model.size='tiny'"])
    (error,) = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    assert error.startswith("boost_jax.train: error: --workdir=s3://bucket/run: the workdir is a "
                            "local directory")
    assert "--checkpoint_dir=s3://bucket/run/checkpoints" in error

    monkeypatch.setattr("tempfile.NamedTemporaryFile", denied)  # read-only, even for root
    code, _, err = _train_main(capsys, tmp_path / "ro", ["Model.size='tiny'"])
    assert code == 2 and f"--workdir={tmp_path / 'ro'} is not writable (Permission denied)" in err


def test_flags_and_usage_errors_are_one_line_with_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "boost_jax.train", "--steps=3"],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == ("boost_jax.train: error: Unknown command line flag 'steps'; config "
                          "fields are gin bindings: --gin_param=Train.steps=... (see --help)\n")


def test_print_config_lists_every_field(capsys):
    from boost_jax.gin_io import describe_fields

    code, out, _ = _train_main(capsys, "unused", [], print_config=True)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["binding", "type", "default", "on", "resume",
                                              "meaning"]
    assert len(lines) == 1 + len(describe_fields())
    (row,) = [line for line in lines if line.startswith("Train.eval_batches ")]
    assert row.split()[1:5] == ["int", "4", "may", "change"] and "0: no evaluation" in row
    (row,) = [line for line in lines if line.startswith("Train.optimizer ")]
    assert row.split()[3:5] == ["must", "match"]


def test_a_step_out_of_memory_is_one_line_and_exit_2(monkeypatch, capsys):
    """Issue 49: XLA's out of memory (a sequence of 100,000 tokens on the bundled corpus) is
    the command's one error line with what to lower, exit code 2 -- not a traceback and exit
    code 1. Seen failing on the old command (the JaxRuntimeError raised)."""
    from boost_jax.commands import train as train_command
    from boost_jax.train import loop

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating "
                                         "3960541466768 bytes.")
    monkeypatch.setattr(loop, "run", oom)
    monkeypatch.delenv("BOOST_JAX_DEBUG", raising=False)
    assert train_command._train(None) == 2
    assert capsys.readouterr().err == (
        "boost_jax.train: error: the train step does not fit in memory (Out of memory allocating "
        "3960541466768 bytes.); lower Train.batch_size or Train.seq_len, set "
        "Parallel.remat='lowrank' or 'full', or spread the model over more devices (python -m "
        "boost_jax.plan)\n")


def test_sigterm_leaves_a_usable_checkpoint(tiny_data, tmp_path):
    """Also: on a CPU host the trainer arranges the 8 devices its (default) mesh needs and says
    so, and the checkpoint of that btp data=2 x tensor=4 run resumes on one device; and while
    it trains, a second real process on its workdir (a job submitted twice) is refused in one
    line naming the first (issue 46, case 1), which trains on untouched."""
    gin = [*_tiny_gin(tiny_data), "Train.steps=100000", "Train.checkpoint_every=100000"]
    proc = subprocess.Popen(_cmd(tmp_path, *gin), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        second = subprocess.run(_cmd(tmp_path, *gin), capture_output=True, text=True,
                                timeout=120, env=_env())
        (error,) = [line for line in second.stderr.splitlines() if "error" in line]
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert error.startswith(f"boost_jax.train: error: --workdir={tmp_path} is in use by "
                                f"another run: pid {proc.pid} on host ")
        assert proc.poll() is None  # the first one trains on
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        stderr = proc.stderr.read()
    finally:
        proc.kill()  # (a no-op once it has ended)
    assert rc == 128 + signal.SIGTERM, stderr[-2000:]
    assert "simulating 8 CPU devices" in stderr and "stopped by signal 15" in stderr
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and steps[0] >= 3
    logged = _losses(tmp_path)
    assert max(logged) == steps[0]  # every logged step is in the checkpoint
    s = run(_config(tiny_data, steps[0] + 2, schedule_steps=100000), tmp_path, jax.devices()[:1])
    assert (s.start_step, s.step) == (steps[0], steps[0] + 2)


def test_a_storage_error_ends_the_process_at_once(tiny_data, tmp_path, read_only_disk):
    """Guards issue 46 case 7: checkpoints to a (real) read-only disk: the save of step 2 fails
    in the background, and the command ends with one error line and exit code 1 at once --
    orbax's threads of the abandoned save kept the process alive for 300 s (commands/train.py
    ``run_app``)."""
    gin = [*_tiny_gin(tiny_data), "Train.steps=4", "Train.checkpoint_every=2",
           "Parallel.data=1", "Parallel.tensor=1", "Parallel.tp_plan='none'"]
    cmd = [*_cmd(tmp_path / "run", *gin), f"--checkpoint_dir={read_only_disk / 'ckpt'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=200)
    assert out.returncode == 1, out.stderr[-2000:]
    (error,) = [line for line in out.stderr.splitlines() if "error:" in line]
    assert error.startswith("boost_jax.train: error: could not write a checkpoint to "
                            f"{read_only_disk / 'ckpt'}") and "Read-only file system" in error
    assert "Traceback" not in out.stderr


def test_a_second_signal_ends_a_stuck_stop(tiny_data, tmp_path):
    """SIGINT, then -- while the stop's checkpoint save hangs (injected) -- a second SIGINT: one
    line, exit code 130, no promise of a checkpoint; the first SIGINT said what a second does."""
    hung = tmp_path / "hung"
    env = dict(_env(), PYTHONPATH=FAULTS, BOOST_JAX_FAULT_HANG=str(hung))
    gin = [*_tiny_gin(tiny_data), "Train.steps=100000", "Train.checkpoint_every=100000",
           "Parallel.data=1", "Parallel.tensor=1", "Parallel.tp_plan='none'"]
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(_cmd(tmp_path / "run", *gin), stdout=subprocess.DEVNULL,
                                stderr=err, text=True, env=env)
        try:
            metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 180
            while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            while time.time() < deadline and not hung.exists():
                time.sleep(0.1)
            assert hung.exists(), "the stop did not reach its checkpoint"
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=30)
        finally:
            proc.kill()
        err.seek(0)
        stderr = err.read()
    assert rc == 128 + signal.SIGINT, stderr[-2000:]
    assert "SIGINT: stopping after the next step, with a checkpoint; a second one ends" in stderr
    (line,) = [x for x in stderr.splitlines() if "error:" in x]
    assert line == ("boost_jax.train: error: second SIGINT while stopping: ending now, without a "
                    "checkpoint (the last one saved stays)")
    assert "checkpoint saved" not in stderr


@pytest.mark.slow
def test_cli_resume_40_then_80_equals_fresh_80(tiny_data, tmp_path):
    """The acceptance check, literally: 40 steps, then the same command with 80."""
    gin = [*_tiny_gin(tiny_data), "Train.schedule_steps=80", "Train.checkpoint_every=20"]
    logs = []
    for steps, workdir in ((40, "w"), (80, "w"), (80, "fresh")):
        out = subprocess.run(_cmd(tmp_path / workdir, *gin, f"Train.steps={steps}"),
                             capture_output=True, text=True, timeout=600, env=_env())
        assert out.returncode == 0, out.stderr[-2000:]
        logs.append(out.stdout)
    assert "at step 40" in logs[1] and "resumed from" in logs[1]
    assert "resumed from" not in logs[2]
    a, b = _losses(tmp_path / "w"), _losses(tmp_path / "fresh")
    assert sorted(a) == list(range(1, 81))
    assert [a[k] for k in range(41, 81)] == [b[k] for k in range(41, 81)]


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """``python -m boost_jax.train`` with no flags: the loss falls clearly (minutes on CPU)."""
    out = subprocess.run([sys.executable, "-m", "boost_jax.train", f"--workdir={tmp_path}"],
                         capture_output=True, text=True, timeout=1200, env=_env(),
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = _losses(tmp_path)
    assert len(losses) == 300
    first, last = (sum(losses[k] for k in range(a, a + 10)) / 10 for a in (1, 291))
    assert last < first - 2
    assert "eval perplexity" in out.stdout
    assert json.loads((tmp_path / "config.json").read_text())["Model"]["arch"] == "cola"


FAULTS = str(REPO / "tests" / "faults")


def test_kill_9_while_saving_then_resume_is_exact(tiny_data, tmp_path, capsys):
    """SIGKILL while checkpoint 4's metadata is written (arrays already on disk), then while
    checkpoint 6 is being committed (all written, not renamed), then a plain resume: the same
    losses as an uninterrupted run (the command's main in this process, on the same 8 devices),
    each step's train and eval entries once in metrics.jsonl, the lost tails of the killed runs
    in the side files, no temporary directory left; each restart takes over the workdir lock
    the killed run left, with a warning."""
    gin = [*_tiny_gin(tiny_data), "Train.steps=10", "Train.schedule_steps=10",
           "Train.checkpoint_every=2", "Train.eval_every=3"]
    ref = tmp_path / "ref"
    assert _train_main(capsys, ref, gin)[0] == 0
    work = tmp_path / "run"
    for kill, committed in (("4:meta", [2]), ("6:commit", [2, 4])):
        env = dict(_env(), PYTHONPATH=FAULTS, BOOST_JAX_FAULT_KILL=kill)
        out = subprocess.run(_cmd(work, *gin), capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
        ckpt = work / "checkpoints"
        assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == committed
    out = subprocess.run(_cmd(work, *gin), capture_output=True, text=True, env=_env(),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "removed 1 unfinished checkpoint save(s)" in out.stderr
    assert "took over the lock of a run that ended without releasing it" in out.stderr
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, 11))
    assert [r["loss"] for r in rows if "loss" in r] == list(_losses(ref).values())
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6, 9, 10]  # each eval once
    assert sorted(p.name for p in work.glob("metrics.rewound-*")) == [
        "metrics.rewound-2.jsonl", "metrics.rewound-4.jsonl"]
    assert not list((work / "checkpoints").glob("*tmp*"))
