"""Several processes (launch/local.sh, gloo between 4-device CPU processes) behave like one:
same losses, interchangeable checkpoints, no hang when a process dies, clear errors."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boost_jax.testing import rel_err

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "local.sh"


def _env():
    env = dict(os.environ, PYTHON=sys.executable)
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


def _run(processes, flags, timeout=300):
    if processes == 1:
        cmd = [sys.executable, "-m", "boost_jax.train", *flags]
    else:
        cmd = ["bash", str(LAUNCH), str(processes), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _same(a, b, steps):
    """Equal up to the summation order of gloo vs in-process all-reduces (fp32 rounding)."""
    return rel_err([a[k] for k in steps], [b[k] for k in steps]) <= 1e-6


def test_two_processes_equal_one_and_checkpoints_cross_over(tiny_data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _run(2, _flags(tiny_data, two, 6))                    # 2 processes x 4 devices
    _run(1, _flags(tiny_data, one, 9))                    # 1 process x 8 devices
    ref = _losses(one)
    assert _same(_losses(two), ref, range(1, 7))
    out = _run(1, _flags(tiny_data, two, 9))              # written by 2, resumed by 1
    assert "resumed from" in out.stderr and "at step 6" in out.stderr
    assert _same(_losses(two), ref, range(7, 10))
    back = tmp_path / "back"                              # written by 1, resumed by 2
    shutil.copytree(one, back)
    shutil.rmtree(back / "checkpoints" / "9")
    _run(2, _flags(tiny_data, back, 9))
    assert _same(_losses(back), ref, range(7, 10))


def test_a_dead_process_stops_the_run(tiny_data, tmp_path):
    flags = _flags(tiny_data, tmp_path, 100000)
    launcher = subprocess.Popen(["bash", str(LAUNCH), "2", *flags], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
                                start_new_session=True)
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count(
                "\n") >= 2):
            time.sleep(0.2)
        assert metrics.exists(), "the run did not start"
        worker = subprocess.run(["pgrep", "-f", f"process_id=1.*{tmp_path}"],
                                capture_output=True, text=True).stdout.split()
        assert worker, "process 1 not found"
        os.kill(int(worker[0]), signal.SIGKILL)
        start = time.time()
        code = launcher.wait(timeout=120)
        assert code != 0 and time.time() - start < 60
        assert "stopping the others" in launcher.stderr.read()
        assert not subprocess.run(["pgrep", "-f", f"workdir={tmp_path}"],
                                  capture_output=True).stdout  # nothing left behind
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


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


def test_two_processes_on_a_fresh_cache_prepare_the_bundled_corpus_once(tmp_path):
    """``launch/local.sh 2`` with a bundled corpus and an empty cache: process 0 prepares,
    process 1 waits for it; both train on the same dataset."""
    flags = _flags("bundled:shakespeare", tmp_path / "run", 2)
    flags += [f"--gin_param=Data.cache_dir='{tmp_path / 'cache'}'",
              "--gin_param=Data.tokenizer='bpe:512'", "--gin_param=Model.vocab_size=512"]
    out = _run(2, flags)
    prepared = [line for line in out.stderr.splitlines() if "preparing the bundled" in line]
    assert len(prepared) == 1 and prepared[0].startswith("[p0]"), prepared
    (data,) = (tmp_path / "cache" / "data").glob("shakespeare-*[0-9]")
    assert (data / "manifest.json").is_file()
    assert _losses(tmp_path / "run").keys() == {1, 2}
