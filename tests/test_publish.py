"""boost_jax/publish.py, the atomic publish shared by data/prepare.py and interop/formats.py:
what an output is refused for, and the renames into place."""

import os
import shutil

import pytest

from boost_jax import publish


def _ours(path) -> bool:
    return (path / "MINE").is_file()


def test_work_dir_is_a_hidden_sibling(tmp_path):
    assert publish.work_dir(tmp_path / "out") == tmp_path / ".out.partial"


def test_refusal_reasons(tmp_path):
    out = tmp_path / "out"
    assert publish.refusal(out, _ours, False) is None  # absent
    out.mkdir()
    assert publish.refusal(out, _ours, False) is None  # empty
    (out / "MINE").write_text("")
    assert publish.refusal(out, _ours, False) == publish.Refusal(publish.TAKEN, tmp_path)
    assert publish.refusal(out, _ours, True) is None
    (out / "MINE").unlink()
    (out / "other").write_text("")
    assert publish.refusal(out, _ours, True) == publish.Refusal(publish.FOREIGN, tmp_path)
    (tmp_path / "file").write_text("")
    assert publish.refusal(tmp_path / "file", _ours, True).reason == publish.FILE
    refused = publish.refusal(tmp_path / "file" / "a" / "b", _ours, True)
    assert refused == publish.Refusal(publish.PARENT_NOT_DIR, tmp_path / "file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_refusal_of_an_unwritable_parent(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        refused = publish.refusal(locked / "new" / "out", _ours, False)
        assert refused == publish.Refusal(publish.PARENT_NOT_WRITABLE, locked)
    finally:
        locked.chmod(0o700)


def _built(out, text: str):
    """A finished work directory of ``out`` holding ours (``MINE`` = ``text``)."""
    work = publish.work_dir(out)
    work.mkdir()
    (work / "MINE").write_text(text)
    return work


def test_publish_into_an_absent_an_empty_and_our_output(tmp_path):
    out = tmp_path / "out"
    publish.publish(_built(out, "1"), out, _ours)  # absent
    assert (out / "MINE").read_text() == "1"
    publish.publish(_built(out, "2"), out, _ours)  # ours: replaced (through .out.old)
    assert (out / "MINE").read_text() == "2"
    shutil.rmtree(out)
    out.mkdir()
    publish.publish(_built(out, "3"), out, _ours)  # an empty directory
    assert (out / "MINE").read_text() == "3"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no .partial or .old left


def test_publish_never_replaces_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "other").write_text("")  # e.g. appeared after the checks
    with pytest.raises(OSError):
        publish.publish(_built(out, "1"), out, _ours)
    assert os.listdir(out) == ["other"]
