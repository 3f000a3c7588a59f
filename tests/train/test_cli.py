"""``python -m boost_jax.train`` as a user runs it: errors, SIGTERM, the 40 -> 80 resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    (["Model.depth=3"], "gin: Configurable 'Model' doesn't have a parameter named 'depth'"),
    (["Model.arch='moe'"], "Model.arch='moe' is not one of dense, svd, cola, lax"),
    (["Train.batch_size=7", "Parallel.data=2"], "Train.batch_size=7 is not divisible by "
                                                 "Parallel.data=2"),
    (["Data.path='/nonexistent/data'"], "Data.path='/nonexistent/data': no prepared dataset"),
])
def test_bad_input_is_one_line_before_compiling(tmp_path, gin, needle):
    out = subprocess.run(_cmd(tmp_path, *gin), capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert errors == [f"boost_jax.train: error: {errors[0].split('error: ', 1)[1]}"]
    assert needle in errors[0]
    assert "compiled the train step" not in out.stderr


def test_sigterm_leaves_a_usable_checkpoint(tiny_data, tmp_path):
    """Also: on a CPU host the trainer arranges the 8 devices its (default) mesh needs and says
    so, and the checkpoint of that btp data=2 x tensor=4 run resumes on one device."""
    gin = [*_tiny_gin(tiny_data), "Train.steps=100000", "Train.checkpoint_every=100000"]
    proc = subprocess.Popen(_cmd(tmp_path, *gin), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env())
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert rc == 128 + signal.SIGTERM, stderr[-2000:]
    assert "simulating 8 CPU devices" in stderr and "stopped by signal 15" in stderr
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and steps[0] >= 3
    logged = _losses(tmp_path)
    assert max(logged) == steps[0]  # every logged step is in the checkpoint
    s = run(_config(tiny_data, steps[0] + 2, schedule_steps=100000), tmp_path, jax.devices()[:1])
    assert (s.start_step, s.step) == (steps[0], steps[0] + 2)


@pytest.mark.slow
def test_cli_resume_40_then_80_equals_fresh_80(tiny_data, tmp_path):
    """The acceptance check, literally: 40 steps, then the same command with 80."""
    gin = [*_tiny_gin(tiny_data), "Train.schedule_steps=80", "Train.checkpoint_every=20"]
    logs = []
    for steps, workdir in ((40, "w"), (80, "w"), (80, "fresh")):
        out = subprocess.run(_cmd(tmp_path / workdir, *gin, f"Train.steps={steps}"),
                             capture_output=True, text=True, timeout=600, env=_env())
        assert out.returncode == 0, out.stderr[-2000:]
        logs.append(out.stderr)
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
    assert "eval perplexity" in out.stderr
    assert json.loads((tmp_path / "config.json").read_text())["Model"]["arch"] == "cola"


FAULTS = str(REPO / "tests" / "faults")


def test_kill_9_while_saving_then_resume_is_exact(tiny_data, tmp_path):
    """SIGKILL while checkpoint 4's metadata is written (arrays already on disk), then while
    checkpoint 6 is being committed (all written, not renamed), then a plain resume: the same
    losses as an uninterrupted run, each step once in metrics.jsonl, the lost tails of the
    killed runs in the side files, no temporary directory left."""
    gin = [*_tiny_gin(tiny_data), "Train.steps=10", "Train.schedule_steps=10",
           "Train.checkpoint_every=2", "Train.eval_every=1000"]
    ref = tmp_path / "ref"
    assert subprocess.run(_cmd(ref, *gin), capture_output=True, env=_env(),
                          timeout=300).returncode == 0
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
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, 11))
    assert [r["loss"] for r in rows if "loss" in r] == list(_losses(ref).values())
    assert sorted(p.name for p in work.glob("metrics.rewound-*")) == [
        "metrics.rewound-2.jsonl", "metrics.rewound-4.jsonl"]
    assert not list((work / "checkpoints").glob("*tmp*"))
