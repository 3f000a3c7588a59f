"""Several processes (launch/local.sh, gloo between 4-device CPU processes) behave like one:
same losses, interchangeable checkpoints, no hang when a process dies, clear errors."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boost_jax.testing import rel_err
from tests.train.test_cli import train_in_process

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "local.sh"
FAULTS = str(REPO / "tests" / "faults")  # test-only fault injection (its sitecustomize.py)


def _env(**extra):
    env = dict(os.environ, PYTHON=sys.executable, **extra)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    return env


def _flags(data, workdir, steps):
    return [f"--workdir={workdir}", "--gin_param=Model.size='tiny'",
            f"--gin_param=Data.path='{data}'", "--gin_param=Train.batch_size=8",
            "--gin_param=Train.seq_len=32", f"--gin_param=Train.steps={steps}",
            "--gin_param=Train.schedule_steps=9", "--gin_param=Train.checkpoint_every=3",
            "--gin_param=Train.eval_batches=1", "--gin_param=Parallel.data=2",
            "--gin_param=Parallel.tensor=4"]


def _run(processes, flags, timeout=300, **env):
    if processes == 1:
        cmd = [sys.executable, "-m", "boost_jax.train", *flags]
    else:
        cmd = ["bash", str(LAUNCH), str(processes), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(**env),
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _same(a, b, steps):
    """Equal up to the summation order of gloo vs in-process all-reduces (fp32 rounding)."""
    return rel_err([a[k] for k in steps], [b[k] for k in steps]) <= 1e-6


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The workdir of 30 steps in one process (the schedule of ``_flags``), every checkpoint
    kept (3, 6, ..., 30)."""
    workdir = tmp_path_factory.mktemp("reference")  # the command's main, in this process
    bindings = [f.removeprefix("--gin_param=") for f in _flags(tiny_data, workdir, 30)[1:]]
    assert train_in_process(workdir, [*bindings, "Train.keep_checkpoints=10"]) == 0
    return workdir


@pytest.fixture(scope="module")
def two_processes(tiny_data, tmp_path_factory):
    """The workdir of 6 steps in two processes (checkpoints 3 and 6); tests copy it."""
    workdir = tmp_path_factory.mktemp("two")
    _run(2, _flags(tiny_data, workdir, 6))
    return workdir


def _copy(workdir, to, newest=None):
    """A copy of ``workdir`` at ``to``, without the checkpoints after step ``newest``."""
    shutil.copytree(workdir, to)
    for step in _steps(to):
        if newest is not None and step > newest:
            shutil.rmtree(to / "checkpoints" / str(step))
    return to


def test_two_processes_equal_one_checkpoints_cross_over_and_read_errors_are_retried_by_all(
        tiny_data, tmp_path, reference, two_processes):
    """2 processes x 4 devices give the losses of 1 process x 8; checkpoints written by 2
    resume in 1 and the other way round. The resume in 2 processes reads checkpoint 6 with an
    injected I/O error on process 1 only: both processes retry together, and the error, gone
    after two tries, leaves the run as if uninterrupted. An error that persists (checkpoint 9)
    ends both with one line and exit code 1, the checkpoint left in place."""
    ref = _losses(reference)
    two = _copy(two_processes, tmp_path / "two")          # 2 processes x 4 devices
    assert _same(_losses(two), ref, range(1, 7))          # = 1 process x 8 devices
    out = _run(1, _flags(tiny_data, two, 9))              # written by 2, resumed by 1
    assert "resumed from" in out.stdout and "at step 6" in out.stdout
    assert _same(_losses(two), ref, range(7, 10))
    back = _copy(reference, tmp_path / "back", newest=6)  # written by 1, resumed by 2
    out = _run(2, _flags(tiny_data, back, 9), PYTHONPATH=FAULTS,
               BOOST_JAX_FAULT_UNREADABLE="1:6:2")      # process 1 fails twice to read 6
    retried = [line for line in out.stderr.splitlines() if "reading checkpoint 6's" in line]
    assert sorted(line[:4] for line in retried) == ["[p0]"] * 2 + ["[p1]"] * 2, out.stderr[-3000:]
    assert any("another process" in line for line in retried)
    assert any("Input/output error (injected)" in line for line in retried)
    assert "resumed from" in out.stdout and "at step 6" in out.stdout
    assert _steps(back)[-1] == 9 and not list((back / "checkpoints").glob("corrupt-*"))
    assert _same(_losses(back), ref, range(7, 10))
    out = subprocess.run(["bash", str(LAUNCH), "2", *_flags(tiny_data, back, 12)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=_env(PYTHONPATH=FAULTS, BOOST_JAX_FAULT_UNREADABLE="1:9"))
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error: could not read" in line]
    assert errors and all("checkpoint 9's arrays" in line for line in errors)
    assert _steps(back)[-1] == 9 and not list((back / "checkpoints").glob("corrupt-*"))


def test_a_dead_process_stops_the_run_and_a_fresh_cache_is_prepared_once(tmp_path):
    """``launch/local.sh 2`` with a bundled corpus and an empty cache: process 0 prepares it,
    process 1 waits for it, both train on it. Then process 1 is killed (SIGKILL): the launcher
    stops process 0 within a minute, exits non-zero and leaves no process behind."""
    flags = _flags("bundled:shakespeare", tmp_path / "run", 100000)
    flags += [f"--gin_param=Data.cache_dir='{tmp_path / 'cache'}'",
              "--gin_param=Data.tokenizer='bpe:512'", "--gin_param=Model.vocab_size=512"]
    launcher = subprocess.Popen(["bash", str(LAUNCH), "2", *flags], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
                                start_new_session=True)
    try:
        metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count(
                "\n") >= 2):
            time.sleep(0.2)
        assert metrics.exists(), "the run did not start"
        os.kill(_pid(tmp_path, 1), signal.SIGKILL)
        start = time.time()
        code = launcher.wait(timeout=120)
        stderr = launcher.stderr.read()
        assert code != 0 and time.time() - start < 60
        assert "stopping the others" in stderr
        assert not subprocess.run(["pgrep", "-f", f"workdir={tmp_path}"],
                                  capture_output=True).stdout  # nothing left behind
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    prepared = [line for line in stderr.splitlines() if "preparing the bundled" in line]
    assert len(prepared) == 1 and prepared[0].startswith("[p0]"), prepared
    (data,) = (tmp_path / "cache" / "data").glob("shakespeare-*[0-9]")
    assert (data / "manifest.json").is_file()
    assert {1, 2} <= _losses(tmp_path / "run").keys()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flags, needle", [
    (["--num_processes=2", "--process_id=1", "--distributed_timeout=3"],
     "could not reach the coordinator at 127.0.0.1:{port} within 3 s"),
    (["--num_processes=2", "--process_id=0", "--distributed_timeout=3"],
     "1 of 2 processes joined within 3 s (missing: process 1)"),
    (["--num_processes=3", "--process_id=1"],
     "the mesh needs 8 devices, which 3 processes cannot share evenly"),
    (["--num_processes=2", "--process_id=2"], "--process_id=2 is not in [0, 2)"),
])
def test_bad_multiprocess_setups(tmp_path, flags, needle):
    port = _free_port()
    start = time.time()
    out = subprocess.run([sys.executable, "-m", "boost_jax.train", f"--workdir={tmp_path}",
                          f"--coordinator_address=127.0.0.1:{port}", *flags],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert out.returncode == 2 and time.time() - start < 60
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"boost_jax.train: error: {needle.format(port=port)}")


def _steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _pid(workdir, rank):
    found = subprocess.run(["pgrep", "-f", f"process_id={rank}.*{workdir}"],
                           capture_output=True, text=True).stdout.split()
    assert found, f"process {rank} not found"
    return int(found[0])


@pytest.mark.parametrize("who", ["one", pytest.param("both", marks=pytest.mark.slow)])
def test_sigterm_stops_every_process_at_the_same_step(tiny_data, tmp_path, reference, who):
    """SIGTERM to process 1 only (or to process 1, then to process 0 a second later): both
    processes stop after the same step, save that one checkpoint and exit with 143; a resume
    (in 1 process, or in 2) continues as if uninterrupted."""
    work = tmp_path / "run"
    launcher = subprocess.Popen(["bash", str(LAUNCH), "2", *_flags(tiny_data, work, 100000)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=_env(), cwd=REPO, start_new_session=True)
    try:
        metrics, deadline = work / "metrics.jsonl", time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count(
                "\n") >= 3):
            time.sleep(0.1)
        os.kill(_pid(work, 1), signal.SIGTERM)
        if who == "both":
            time.sleep(1.0)
            try:
                os.kill(_pid(work, 0), signal.SIGTERM)
            except (AssertionError, ProcessLookupError):
                pass  # already gone: it stopped with process 1
        start = time.time()
        code = launcher.wait(timeout=120)
        stderr = launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM and time.time() - start < 60, stderr[-3000:]
    stopped = dict(re.findall(r"\[p(\d)\].*stopped by signal 15 after step (\d+)", stderr))
    assert set(stopped) == {"0", "1"} and len(set(stopped.values())) == 1, stderr[-3000:]
    n = int(stopped["0"])
    assert n < 28 and _steps(work)[-1] == n and max(_losses(work)) == n
    _run(1 if who == "one" else 2, _flags(tiny_data, work, n + 2))
    losses = _losses(work)
    assert sorted(losses) == list(range(1, n + 3))
    assert _same(losses, _losses(reference), range(1, n + 3))


@pytest.mark.slow
def test_two_processes_resume_their_packed_streams_exactly(packing_data, tmp_path):
    """Data.packing='document' in 2 processes, each packing its own rows' group: 3 steps,
    then a resume to 6, equal to 6 steps in one run bit for bit (each process restored its own
    position; before, process 1 took process 0's and read other documents). A resume in one
    process is refused in one line."""
    flags = ["--gin_param=Data.packing='document'", "--gin_param=Data.packing_bins=4"]
    full, split = tmp_path / "full", tmp_path / "split"
    _run(2, _flags(packing_data, full, 6) + flags)
    _run(2, _flags(packing_data, split, 3) + flags)
    _run(2, _flags(packing_data, split, 6) + flags)
    a, b = _losses(full), _losses(split)
    assert sorted(b) == list(range(1, 7)) and [a[k] for k in a] == [b[k] for k in a]
    out = subprocess.run([sys.executable, "-m", "boost_jax.train",
                          *_flags(packing_data, split, 9), *flags],
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    assert "written by 2 process(es) reading rows 0-4, 4-8" in line
