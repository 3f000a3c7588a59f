"""The inputs of the prepare command (boost_jax/data/sources.py): the readers (text, JSONL,
compressed, Arrow) and the file patterns."""

import gzip
import json

import pytest

from boost_jax.data.sources import PrepareError, list_inputs, read_documents


def test_reads_text_jsonl_and_compressed(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.raw").write_text("fourth")
    docs = list(read_documents([tmp_path / "a.txt", tmp_path / "b.jsonl.gz", tmp_path / "sub"]))
    assert docs == ["first document", "second", "third", "fourth"]
    with pytest.raises(PrepareError, match="b.jsonl.gz:1: no field 'body'"):
        list(read_documents([tmp_path / "b.jsonl.gz"], text_field="body"))
    with pytest.raises(PrepareError, match="does not exist"):
        list(read_documents([tmp_path / "missing.txt"]))


def test_reads_a_hugging_face_save_to_disk_directory(tmp_path):
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow IPC stream files listed in
    ``state.json``, beside ``dataset_info.json`` (which is not read as a document)."""
    pa = pytest.importorskip("pyarrow")
    saved = tmp_path / "saved"
    saved.mkdir()
    names = []
    for k, texts in enumerate([["one", "two"], ["three"]]):
        names.append(f"data-{k:05d}-of-00002.arrow")
        table = pa.table({"text": texts, "url": ["u"] * len(texts)})
        with pa.OSFile(str(saved / names[-1]), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=1)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": n}
                                                                  for n in names]}))
    (saved / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    assert list(read_documents([saved])) == ["one", "two", "three"]
    assert list(read_documents([saved], pattern="*-00001-*")) == ["three"]
    with pytest.raises(PrepareError, match="no column 'body'"):
        list(read_documents([saved], text_field="body"))


def test_a_pattern_selects_the_files_of_directories(c4_like):
    """C4's layout: the training files only, validation, README and stray files ignored and
    counted, in order; a file named explicitly is read whatever the pattern."""
    root = c4_like.root
    train = list_inputs([root], c4_like.PATTERN)
    assert [f.name for f in train.files] == ["c4-train.00000-of-01024.json.gz",
                                             "c4-train.00001-of-01024.json.gz"]
    assert sorted(f.name for f in train.ignored) == ["README.md", "c4-validation.00000-of-00008"
                                                     ".json.gz", "notes.txt"]
    assert list(read_documents([root], pattern=c4_like.PATTERN)) == c4_like.train
    held = list_inputs([root], c4_like.EVAL_PATTERN)
    assert [f.name for f in held.files] == ["c4-validation.00000-of-00008.json.gz"]
    assert len(held.ignored) == 4
    assert list(read_documents([root], pattern=c4_like.EVAL_PATTERN)) == c4_like.validation
    extra = root.parent / "extra.txt"
    extra.write_text("named explicitly")
    both = list_inputs([extra, root], c4_like.EVAL_PATTERN)
    assert both.files == [extra, *held.files] and both.ignored == held.ignored
    everything = list_inputs([root])  # no pattern: every file, as before
    assert len(everything.files) == 5 and everything.ignored == []


@pytest.mark.parametrize("paths, pattern, flags, expected", [
    (["{root}"], "c4-test.*", {}, "--pattern='c4-test.*' matches none of the 5 files under "
     "{root} (e.g. README.md); check --pattern"),
    (["{root}"], "C4-TRAIN.*", {}, "matches none"),  # case-sensitive, as file names are
    (["{root}/notes.txt"], "*.txt", {}, "--pattern='*.txt' selects among the files of --input "
     "directories, and --input names none (a file named explicitly is always read)"),
    (["{root}/gone"], None, dict(input_flag="--eval_input", pattern_flag="--eval_pattern"),
     "eval input {root}/gone does not exist; check --eval_input"),
    (["{root}"], "nothing", dict(input_flag="--eval_input", pattern_flag="--eval_pattern"),
     "--eval_pattern='nothing' matches none of the 5 files under {root}"),
])
def test_a_pattern_that_selects_nothing_is_an_error(c4_like, paths, pattern, flags, expected):
    root = c4_like.root
    with pytest.raises(PrepareError) as err:
        list_inputs([p.format(root=root) for p in paths], pattern, **flags)
    assert expected.format(root=root) in str(err.value) and "\n" not in str(err.value)
