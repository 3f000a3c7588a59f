"""The run's workdir (operations/workdir.py)."""

import pytest


def test_what_a_failed_run_made_goes_and_nothing_else(tmp_path):
    """A new workdir (and the parent made for it) of a run that failed before recording
    anything -- only its config files, empty logs, lock -- is removed; an existing workdir, a
    new one holding a metrics line or anything else (a custom checkpoint directory inside
    it) are kept: only the by-products of a run's start are ever removed."""
    from boost_jax.operations.workdir import prepared, run_recorded

    def fail(where, write=None):
        with pytest.raises(RuntimeError), prepared(where, run_recorded) as workdir:
            (workdir / "config.gin").write_text("Model.arch = 'cola'\n")
            (workdir / "metrics.jsonl").write_text(write or "")
            (workdir / "checkpoints").mkdir()
            raise RuntimeError

    fail(tmp_path / "runs" / "new")
    assert not (tmp_path / "runs").exists()
    (tmp_path / "old").mkdir()
    fail(tmp_path / "old")
    fail(tmp_path / "logged", write='{"step": 1, "loss": 5.0}\n')
    assert (tmp_path / "old" / "config.gin").is_file()
    assert (tmp_path / "logged" / "metrics.jsonl").is_file()
    with pytest.raises(RuntimeError), prepared(tmp_path / "own", run_recorded) as workdir:
        (workdir / "ckpt" / "4").mkdir(parents=True)  # a custom --checkpoint_dir inside it
        raise RuntimeError
    assert (tmp_path / "own" / "ckpt" / "4").is_dir()
