"""Which config changes a resume accepts (train/resume.py), where each process's stream resumes
(train/data_state.py), and the optimizer switch a user tries on a healthy run."""

import dataclasses
import json
import logging

import jax
import numpy as np
import pytest

from boost_jax.config import Config, Data, Model, Parallel, Train
from boost_jax.config_fields import FREE, MATCH, NOTE, RESUME_KINDS, config_field
from boost_jax.data.loader import open_dataset, train_iterator
from boost_jax.testing import SINGLE, tiny
from boost_jax.train import data_state
from boost_jax.train.resume import ResumeMismatch, changes, check_resume
from tests.train.test_cli import _train_main
from tests.train.test_trainer import _losses


def test_every_config_field_says_what_a_resume_may_do():
    """A field added without a classification fails here (and config_field requires one)."""
    for group in (Model, Parallel, Train, Data):
        for f in dataclasses.fields(group):
            assert f.metadata.get("resume") in RESUME_KINDS, f"{group.__name__}.{f.name}"
    with pytest.raises(TypeError):
        config_field(1, "a field without a resume classification")
    with pytest.raises(ValueError, match="resume='sometimes'"):
        config_field(1, "help", "sometimes")


def _cfg(data="d", model=None, parallel=SINGLE, **train):
    train = dict(batch_size=8, seq_len=32, **train)
    return Config(model or tiny("svd"), parallel, Train(**train), Data(path=data))


def test_check_resume_follows_the_classification(caplog):
    saved = _cfg(steps=6, schedule_steps=9).to_dict()
    # FREE: silent (the run's length, cadence)
    caplog.set_level(logging.WARNING)
    check_resume(saved, _cfg(steps=9, schedule_steps=9, log_every=1, checkpoint_every=2), "W")
    assert caplog.records == []
    # NOTE: allowed, one warning each (the mesh, the learning rate)
    dp2 = Parallel(data=2, tensor=1, tp_plan="none")
    check_resume(saved, _cfg(parallel=dp2, steps=9, schedule_steps=9, learning_rate=1e-3), "W")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "Parallel.data=2 (the checkpoint used 1)" in warned[0]
    assert "Train.learning_rate=0.001" in warned[1]
    # MATCH: one line naming the field, the checkpoint's value, the fix
    with pytest.raises(ResumeMismatch) as err:
        check_resume(saved, _cfg(steps=9, schedule_steps=9, optimizer="loro",
                                 learning_rate=1e-3), "W")
    assert str(err.value) == (
        "Train.optimizer='loro' but the checkpoints in W were written with 'adamw'; use a new "
        "--workdir, or resume with --gin_param=\"Train.optimizer='adamw'\"")
    # a field the checkpoint does not hold (an older version) is compared at its default
    del saved["Data"]["packing_bins"]
    assert changes(saved, _cfg(steps=6, schedule_steps=9)) == []


def test_the_kinds_are_the_ones_documented():
    """Spot checks of the classification the README describes."""
    kind = {f"{g.__name__}.{f.name}": f.metadata["resume"]
            for g in (Model, Parallel, Train, Data) for f in dataclasses.fields(g)}
    assert {kind[k] for k in ("Model.arch", "Model.d_model", "Train.optimizer",
                              "Data.packing", "Data.tokenizer")} == {MATCH}
    assert {kind[k] for k in ("Parallel.data", "Parallel.zero", "Train.learning_rate",
                              "Train.batch_size")} == {NOTE}
    assert {kind[k] for k in ("Train.steps", "Train.eval_every", "Train.log_every",
                              "Data.cache_dir")} == {FREE}


# --- the optimizer switch on a healthy run ---------------------------------------------------
def _gin(data, steps, *extra):
    # the command takes every device of the process (the suite's 8): data-parallel over them
    return ["Model.arch='svd'", "Model.size='tiny'", f"Data.path='{data}'", "Train.batch_size=8",
            "Train.seq_len=32", "Train.eval_batches=1", "Parallel.data=8", "Parallel.tensor=1",
            "Parallel.tp_plan='none'", f"Train.steps={steps}", "Train.schedule_steps=9",
            "Train.checkpoint_every=3", *extra]


def _tree(workdir):
    """Every file under the workdir with its size and bytes' digest."""
    import hashlib
    return {str(p.relative_to(workdir)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_an_optimizer_switch_is_refused_and_the_old_config_resumes_exactly(tiny_data, tmp_path,
                                                                           capsys):
    """svd/tiny, 6 steps with checkpoints at 3 and 6; the same workdir with
    Train.optimizer='loro': exit code 2, one line naming the field and the checkpoint's value,
    no file moved or written; then the old config resumes to 9, equal to 9 steps in one run."""
    work, ref = tmp_path / "work", tmp_path / "ref"
    code, _, err = _train_main(capsys, ref, _gin(tiny_data, 9))
    assert code == 0, err[-2000:]
    assert _train_main(capsys, work, _gin(tiny_data, 6))[0] == 0
    before = _tree(work)
    code, _, err = _train_main(capsys, work, _gin(tiny_data, 9, "Train.optimizer='loro'"))
    assert code == 2, err[-2000:]
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("boost_jax.train: error: Train.optimizer='loro' but the checkpoints "
                           f"in {work / 'checkpoints'} were written with 'adamw'")
    assert _tree(work) == before and not list(work.glob("checkpoints/corrupt-*"))
    meta = json.loads((work / "checkpoints" / "6" / "meta" / "metadata").read_text())
    (entry,) = meta["data_state"]["processes"]  # every process's position (one here)
    assert entry["process"] == 0 and entry["rows"] == [0, 8] and "next_index" in entry["state"]
    code, out, err = _train_main(capsys, work, _gin(tiny_data, 9))
    assert code == 0 and "at step 6" in out, err[-2000:]
    a, b = _losses(work), _losses(ref)
    assert sorted(a) == list(range(1, 10)) and [a[k] for k in a] == [b[k] for k in a]


# --- each process's data position --------------------------------------------------------------
def _batches(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_each_process_resumes_its_own_packed_stream(packing_data, monkeypatch):
    """Two processes' rows (0-4, 4-8) of document-packed batches, each packing its own group:
    every process resumes its own stream from the gathered states (the old checkpoints held
    process 0's alone, which puts process 1 on another stream); a layout that cannot be carried
    over exactly is refused in one line, and concat's position carries over to any layout."""
    ds = open_dataset(Data(path=str(packing_data), packing="document", packing_bins=4))
    rows = [(0, 4), (4, 8)]
    its = [train_iterator(ds, 32, 8, 0, r) for r in rows]
    for it in its:
        _batches(it, 3)
    entries = [{"process": p, "rows": list(r), "state": it.get_state()}
               for p, (r, it) in enumerate(zip(rows, its))]
    meta = {"data_state": {"processes": entries}, "process_count": 2}
    expected = [_batches(it, 3) for it in its]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for p, r in enumerate(rows):
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        it = train_iterator(ds, 32, 8, 0, r)
        it.set_state(data_state.position(meta, r, "document", "W"))
        assert _same(_batches(it, 3), expected[p])
    old = train_iterator(ds, 32, 8, 0, rows[1])
    old.set_state(entries[0]["state"])  # what process 1 restored before
    assert not _same(_batches(old, 3), expected[1])
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with pytest.raises(ResumeMismatch, match=r"written by 2 process\(es\) reading rows 0-4, "
                                             r"4-8, and this run reads rows 0-8 in process 0 "
                                             r"of 1: with Data.packing='document'"):
        data_state.position(meta, (0, 8), "document", "W")  # (another batch or bins)
    concat = {"data_state": {"processes": [{"process": 0, "rows": [0, 4], "state": {"n": 3}},
                                           {"process": 1, "rows": [4, 8], "state": {"n": 3}}]}}
    assert data_state.position(concat, (0, 8), "concat", "W") == {"n": 3}
    older = {"data_state": {"n": 3}, "process_count": 1}  # before every process's state was kept
    assert data_state.position(older, (0, 8), "document", "W") == {"n": 3}



@pytest.mark.parametrize("processes", [1, 4])
def test_a_packed_stream_resumes_on_another_process_count(packing_data, monkeypatch, processes):
    """Document packing, global batch 8 in 2 groups of 4 rows: a checkpoint of 2 processes
    (rows 0-4, 4-8) resumes on 1 process (both groups) and on 4 (rows 0-2, 2-4, ...: half a
    group each) with every row of every later global batch what the 2 processes would read."""
    ds = open_dataset(Data(path=str(packing_data), packing="document", packing_bins=4))
    its = [train_iterator(ds, 32, 8, 0, r) for r in ((0, 4), (4, 8))]
    for it in its:
        _batches(it, 3)
    meta = {"data_state": {"processes": [
        {"process": p, "rows": [4 * p, 4 * p + 4], "state": it.get_state()}
        for p, it in enumerate(its)]}, "process_count": 2, "worker_count": 0,
        "config": {"Train": {"batch_size": 8}, "Data": {"packing_bins": 4}}}
    after = [_batches(it, 3) for it in its]
    expected = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*after)]
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    per = 8 // processes
    for p in range(processes):
        rows = (p * per, (p + 1) * per)
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        it = train_iterator(ds, 32, 8, 0, rows)
        it.set_state(data_state.position(meta, rows, "document", "W",
                                         data_state.same_groups(meta, 8, 4)))
        assert _same(_batches(it, 3), [{k: v[slice(*rows)] for k, v in b.items()}
                                       for b in expected])
    assert data_state.same_groups(meta, 16, 4) is None  # other groups: refused, as before
    assert data_state.same_groups({**meta, "worker_count": 2}, 8, 4) is None
