"""The run's workdir (operations/workdir.py)."""

import pytest


def test_an_existing_workdir_and_written_files_are_kept(tmp_path):
    """What the removal never touches: a workdir that existed before, and one the run wrote a
    file into (its metrics) before it failed."""
    from boost_jax.operations.workdir import prepared

    old = tmp_path / "old"
    old.mkdir()
    for where, write in ((old, False), (tmp_path / "new", True)):
        with pytest.raises(RuntimeError), prepared(where, {"run.lock"}) as workdir:
            if write:
                (workdir / "metrics.jsonl").write_text("{}\n")
            raise RuntimeError
        assert where.is_dir()
