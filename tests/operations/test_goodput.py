"""Goodput: the pure account (buckets in, shares out; what a resume inherits), then a tiny run
and a resume from an earlier checkpoint."""

import json
import math
import shutil
import time

import jax
import pytest

from boost_jax.operations.goodput import BUCKETS, carried, fractions, summary, zeros
from boost_jax.train.loop import run
from tests.train.test_trainer import _config

WALL = "goodput/wall_s"


def test_fractions_are_shares_of_the_buckets_sum():
    seconds = {**zeros(), "step": 6.0, "compile": 2.0, "data": 0.5, "checkpoint": 0.5,
               "eval": 0.25, "lost": 0.5, "other": 0.25}
    shares = fractions(seconds)
    assert set(shares) == set(BUCKETS)
    assert shares["step"] == 0.6 and shares["compile"] == 0.2 and shares["other"] == 0.025
    assert math.isclose(sum(shares.values()), 1.0)
    assert fractions(zeros()) == dict.fromkeys(BUCKETS, 0.0)


def _record(at, **seconds):
    return {"step": at, WALL: sum(seconds.values()),
            **{f"goodput/{b}_s": seconds.get(b, 0.0) for b in BUCKETS}}


def _step(step, time, data=0.0):
    return {"step": step, "loss": 1.0, "step_time": time, "data_time": data}


def test_a_resume_moves_the_recomputed_steps_to_lost():
    """Resuming at 2: steps 3 and 4 were counted by the last record (at 4): their time moves
    from step/data to lost; step 5 came after it: its time is added to lost."""
    history = [_step(1, 1.0), _step(2, 1.0, 0.25), _record(2, step=1.75, data=0.25, compile=3.0),
               _step(3, 2.0, 0.5), _step(4, 4.0), {"step": 4, "eval_loss": 1.0},
               _record(4, step=7.25, data=0.75, compile=3.0, eval=1.0, other=2.0),
               _step(5, 8.0)]
    got = carried(history, 2)
    assert got == {**zeros(), "step": 7.25 - 1.5 - 4.0, "data": 0.75 - 0.5, "compile": 3.0,
                   "eval": 1.0, "other": 2.0, "lost": 2.0 + 4.0 + 8.0}
    assert carried(history, 5) == {**zeros(), "step": 7.25, "data": 0.75, "compile": 3.0,
                                   "eval": 1.0, "other": 2.0}
    # a history without goodput records (an older run): only the lost steps are known
    assert carried([_step(1, 1.0), _step(2, 3.0)], 1) == {**zeros(), "lost": 3.0}
    assert carried([], 0) == zeros()


def test_the_summary_line():
    record = {WALL: 125.0, **{f"goodput/{b}": 0.0 for b in BUCKETS}, "goodput/step": 0.8,
              "goodput/compile": 0.15, "goodput/other": 0.05}
    assert summary(record) == ("goodput 80.0% of 2m05s in train steps; compiling 15.0% | "
                               "waiting for data 0.0% | checkpoints 0.0% | evals and samples "
                               "0.0% | lost to restarts 0.0% | start-up and the rest 5.0%")


def _records(workdir, name="metrics.jsonl"):
    rows = [json.loads(line) for line in (workdir / name).read_text().splitlines()]
    return [r for r in rows if WALL in r]


def _check_sums(record):
    """The buckets are the wall time; the shares theirs."""
    seconds = [record[f"goodput/{b}_s"] for b in BUCKETS]
    assert min(seconds) >= 0, record
    assert math.isclose(sum(seconds), record[WALL], rel_tol=1e-9)
    assert math.isclose(sum(record[f"goodput/{b}"] for b in BUCKETS), 1.0, rel_tol=1e-9)


def test_a_run_accounts_for_its_wall_time(tiny_data, tmp_path, capsys):
    """A record every log_every steps (the compilation in the first) and at the end; each
    one's buckets sum to its wall time, the last one's to at most the run's."""
    start = time.perf_counter()
    run(_config(tiny_data, 4, log_every=2, eval_every=2, checkpoint_every=2), tmp_path,
        jax.devices()[:1])
    elapsed = time.perf_counter() - start
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [2, 4, 4]
    first, last = records[0], records[-1]
    assert first["goodput/compile_s"] > 0 and first["goodput/step_s"] > 0
    for r in records:
        _check_sums(r)
    assert [r[WALL] for r in records] == sorted(r[WALL] for r in records)
    assert last[WALL] <= elapsed
    assert last["goodput/step_s"] > 0 and last["goodput/compile_s"] == first["goodput/compile_s"]
    assert last["goodput/checkpoint_s"] > 0 and last["goodput/eval_s"] > 0
    assert last["goodput/lost_s"] == 0 and last["goodput/step"] > 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert all(0 <= r["data_time"] <= r["step_time"] for r in steps)
    assert math.isclose(last["goodput/step_s"] + last["goodput/data_s"],
                        sum(r["step_time"] for r in steps), rel_tol=1e-9)
    printed = capsys.readouterr().out
    assert summary(last) in printed.splitlines()
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    assert b"goodput/step_s" in events.read_bytes()
    assert not (tmp_path / "profile").exists()  # no profile by default


def test_a_resume_from_an_earlier_checkpoint_counts_the_lost_steps(tiny_data, tmp_path):
    """8 steps with checkpoints at 4 and 8; checkpoint 8 lost; the rerun resumes at 4 and
    trains 5..8 again: their recorded time is lost, and the first run's time carried."""
    cfg = _config(tiny_data, 8, log_every=4, checkpoint_every=4)
    run(cfg, tmp_path, jax.devices()[:1])
    before = _records(tmp_path)[-1]
    shutil.rmtree(tmp_path / "checkpoints" / "8")
    resumed = run(cfg, tmp_path, jax.devices()[:1])
    assert (resumed.start_step, resumed.step) == (4, 8)
    redone = [json.loads(line) for line in
              (tmp_path / "metrics.rewound-4.jsonl").read_text().splitlines()]
    lost = sum(r["step_time"] for r in redone if "loss" in r)
    assert sorted(r["step"] for r in redone if "loss" in r) == [5, 6, 7, 8]
    records = _records(tmp_path)
    at_resume = [r for r in records if r["step"] == 4][-1]  # written when training resumes
    assert at_resume["goodput/lost_s"] == pytest.approx(lost, rel=1e-9)
    assert at_resume["goodput/compile_s"] > before["goodput/compile_s"]  # both compilations
    last = records[-1]
    _check_sums(last)
    assert last["goodput/lost_s"] == pytest.approx(lost, rel=1e-9) and lost > 0
    assert last[WALL] > before[WALL]
    assert last["goodput/step_s"] > 0
