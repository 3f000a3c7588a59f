"""The prepare command: tokenizers, splits (a validation input, or the shards' tails), atomic
output, --overwrite, one-line errors. The readers and patterns: test_sources.py."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from boost_jax.data import prepare as prepare_module
from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.prepare import PrepareError, eval_split_label, prepare, verify
from boost_jax.data.synthetic import write_corpus


def test_prepared_layout(tiny_data):
    meta = json.loads((tiny_data / "manifest.json").read_text())
    (shard,) = meta["shards"]
    tokens = np.fromfile(tiny_data / "shards" / shard["file"], np.uint16)
    offsets = np.load(tiny_data / "shards" / shard["docs"])
    train, ev = tokens[:shard["train_tokens"]], tokens[shard["train_tokens"]:]
    assert meta["vocab_size"] == 512 and meta["dtype"] == "uint16"
    assert (meta["train_tokens"], meta["eval_tokens"]) == (len(train), len(ev))
    assert len(ev) == int(len(tokens) * 0.05)
    assert train.max() < 512 and meta["documents"] == 3
    assert list(offsets) == [0, *np.flatnonzero(tokens == meta["eos_id"]) + 1]  # doc ends
    assert verify(tiny_data) == []
    tok = tokenizers.load(tiny_data)
    text = tok.decode(train[:200])
    assert "the" in text.lower()  # real English, not random ids
    assert meta["eval_split"] == "train_tail"
    label = "tail of the training shards (--eval_fraction=0.05; no validation input)"
    assert eval_split_label(meta) == label
    del meta["eval_split"]  # a manifest written before the field: the tail, as it was
    assert eval_split_label(meta) == label


def test_prepare_refuses_to_overwrite_and_leaves_no_partial(tmp_path, tiny_data):
    with pytest.raises(PrepareError, match="already holds a prepared dataset"):
        prepare([tmp_path], tiny_data)
    (tmp_path / "in.txt").write_text("hello world " * 50)
    with pytest.raises(PrepareError, match="unknown tokenizer 'wordpiece'"):
        prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer="wordpiece")
    assert os.listdir(tmp_path) == ["in.txt"]  # no output, no work directory


def test_bundled_llama32k_tokenizer(tmp_path):
    (tmp_path / "in.txt").write_text("Hello world! " * 20)
    meta = prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer="llama32k",
                   eval_fraction=0.1)
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (32000, 2, "uint16")
    tok = tokenizers.load(tmp_path / "out")
    assert tok.encode_batch(["Hello world!"]) == [[22557, 1526, 28808]]


def test_prepare_cli(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"body": "to be or not to be " * 40}) + "\n")
    out = subprocess.run([sys.executable, "-m", "boost_jax.data.prepare",
                          f"--input={tmp_path / 'in.jsonl'}", f"--output={tmp_path / 'out'}",
                          "--tokenizer=bpe:300", "--text_field=body"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["vocab_size"] <= 300


SMALL_SHARDS = dict(tokenizer="llama32k", eval_fraction=0.05, chunk_mb=0.25, chunks_per_shard=2)


def test_sharded_prepare_and_workers_give_the_same_dataset(tmp_path):
    """A corpus in several shards; 2 worker processes write exactly what 1 process does; the
    loader's windows never span two shards; the eval split is each shard's tail."""
    from boost_jax.config import Data
    from boost_jax.data.loader import open_dataset

    src = write_corpus(tmp_path / "src", 2.5)
    a = prepare([src], tmp_path / "a", workers=0, **SMALL_SHARDS)
    b = prepare([src], tmp_path / "b", workers=2, **SMALL_SHARDS)
    assert len(a["shards"]) >= 4 and a["shards"] == b["shards"]
    assert verify(tmp_path / "b") == []
    ds = open_dataset(Data(path=str(tmp_path / "a")))
    w = ds.windows("train", 128)
    assert len(w) == sum((s["train_tokens"] - 1) // 128 for s in a["shards"])
    assert len(ds.windows("eval", 128)) > 0
    shard0 = np.fromfile(tmp_path / "a" / "shards" / a["shards"][0]["file"], np.uint16)
    last = (a["shards"][0]["train_tokens"] - 1) // 128 - 1  # the last window of shard 0
    np.testing.assert_array_equal(w[last]["inputs"], shard0[last * 128:(last + 1) * 128])
    (tmp_path / "b" / "shards" / b["shards"][1]["file"]).write_bytes(b"\0" * 10)
    assert any("checksum" in p or "bytes" in p for p in verify(tmp_path / "b"))


def test_prepare_resumes_after_kill_without_redoing_finished_shards(tmp_path):
    """kill -9 once a shard is finished; the rerun keeps it (same file, untouched) and ends
    with the dataset an uninterrupted run writes."""
    import os
    import signal
    import time

    src = write_corpus(tmp_path / "src", 6)
    cmd = [sys.executable, "-m", "boost_jax.data.prepare", f"--input={src}",
           f"--output={tmp_path / 'out'}", "--tokenizer=llama32k", "--eval_fraction=0.05",
           "--chunk_mb=0.25", "--chunks_per_shard=2", "--workers=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = tmp_path / ".out.partial" / "shards"
    deadline = time.monotonic() + 120
    while not list(shards.glob("0000[0-9].json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards.glob("*.bin")}
    assert kept and not (tmp_path / "out").exists()
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "finished shards kept" in rerun.stderr
    for name, stat in kept.items():
        f = tmp_path / "out" / "shards" / name
        assert (f.stat().st_ino, f.stat().st_mtime_ns) == stat  # not rewritten
    fresh = prepare([src], tmp_path / "fresh", **SMALL_SHARDS)
    resumed = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert resumed["shards"] == fresh["shards"]


# --- a validation input: C4's layout -------------------------------------------------------
C4_SHARDS = dict(tokenizer="bpe:300", workers=0, chunk_mb=0.001, chunks_per_shard=1)


def _shard_documents(out, shard: dict, tok) -> list[str]:
    """A shard's documents, decoded, by its document offsets (each ends with end-of-text)."""
    tokens = np.fromfile(out / "shards" / shard["file"], np.uint16)
    offsets = np.load(out / "shards" / shard["docs"])
    assert all(tokens[end - 1] == tok.eos_id for end in offsets[1:])
    return [tok.decode(tokens[a:b - 1]) for a, b in zip(offsets[:-1], offsets[1:])]


def _c4(c4_like, out, **kwargs) -> dict:
    return prepare([c4_like.root], out, pattern=c4_like.PATTERN, eval_inputs=[c4_like.root],
                   eval_pattern=c4_like.EVAL_PATTERN, **C4_SHARDS, **kwargs)


def test_a_validation_input_is_the_eval_split_whole(c4_like, tmp_path):
    """C4's recipe: the training files (README and stray files ignored, counted) make the train
    shards, all train; the validation file's documents make the eval shards, whole, each once,
    and appear in no train shard. Both readers (concat windows' regions and document packing)
    give exactly these documents per split."""
    from boost_jax.data.loader import _regions
    from boost_jax.data.packing import DocumentPieces

    out = tmp_path / "out"
    meta = _c4(c4_like, out)
    assert verify(out) == []
    assert (meta["eval_split"], meta["eval_fraction"]) == ("eval_input", 0.0)
    assert (meta["files"], meta["ignored_files"]) == (2, 3)  # README, notes, validation
    assert (meta["eval_files"], meta["eval_ignored_files"]) == (1, 4)
    assert eval_split_label(meta) == "held-out validation input (c4-validation.*.json.gz)"
    tok = tokenizers.load(out)
    splits = ["eval" if s["train_tokens"] == 0 else "train" for s in meta["shards"]]
    assert all(s["train_tokens"] in (0, s["tokens"]) for s in meta["shards"])
    assert splits.count("eval") >= 2 and splits.count("train") >= 2
    assert splits == sorted(splits, key=["train", "eval"].index)  # the eval shards last
    docs = {"train": [], "eval": []}
    for shard, split in zip(meta["shards"], splits):
        docs[split] += _shard_documents(out, shard, tok)
    assert sorted(docs["eval"]) == sorted(c4_like.validation)  # whole, each once
    assert sorted(docs["train"]) == sorted(c4_like.train)
    trained_on = "".join(docs["train"])
    assert "Validation document" not in trained_on and c4_like.STRAY not in trained_on
    assert meta["eval_tokens"] == sum(len(tok.encode_batch([d])[0]) + 1 for d in docs["eval"])
    for split, texts in (("eval", c4_like.validation), ("train", c4_like.train)):
        region = np.concatenate(_regions(out, split))  # what concat packing windows
        ends = np.flatnonzero(region == tok.eos_id)
        assert ends[-1] == len(region) - 1
        got = [tok.decode(region[a + 1:b]) for a, b in zip([-1, *ends[:-1]], ends)]
        assert sorted(got) == sorted(texts)
        pieces = DocumentPieces(out, split, 1024, tmp_path / "cache")  # one piece a document
        assert len(pieces) == len(texts)
        got = [tok.decode(pieces[j]["targets"][:-1]) for j in range(len(pieces))]
        assert sorted(got) == sorted(texts)


def test_a_small_validation_split_gets_advice_that_applies_to_it(c4_like, tmp_path, caplog):
    """An eval split from --eval_input too small for a batch: the notice advises more
    validation documents, not a larger --eval_fraction (an error with --eval_input; issue 49);
    a split cut from the shards' tails still gets --eval_fraction. Seen failing on the old
    notice (``larger --eval_fraction`` for both)."""
    from boost_jax.config import Data
    from boost_jax.data.loader import eval_batches, open_dataset

    _c4(c4_like, tmp_path / "validation")
    assert eval_batches(open_dataset(Data(path=str(tmp_path / "validation"))), 32, 100_000,
                        1) == []
    assert "prepare the data with more --eval_input documents" in caplog.text
    assert "--eval_fraction" not in caplog.text
    caplog.clear()
    tail = tmp_path / "tail"
    prepare([c4_like.root], tail, pattern=c4_like.PATTERN, **C4_SHARDS)
    assert eval_batches(open_dataset(Data(path=str(tail))), 32, 100_000, 1) == []
    assert "prepare the data with a larger --eval_fraction" in caplog.text


def test_the_c4_recipe_through_the_command(c4_like, tmp_path, capsys):
    """The README's command line: one summary line counts the ignored files and says where the
    eval split came from; the arguments are recorded, so a rerun with another --eval_pattern
    of an unfinished run is refused."""
    out = tmp_path / "out"
    args = [f"--input={c4_like.root}", f"--pattern={c4_like.PATTERN}",
            f"--eval_input={c4_like.root}", f"--eval_pattern={c4_like.EVAL_PATTERN}",
            f"--output={out}", "--tokenizer=bpe:300", "--workers=0"]
    code, printed, err = _command(capsys, *args)
    assert code == 0, err
    summary = printed.splitlines()[0]  # the command's summary on stdout (issue 49)
    assert summary.endswith("eval split: held-out validation input (c4-validation.*.json.gz); "
                            "ignored 3 files not matching --pattern; ignored 4 files not "
                            "matching --eval_pattern")
    meta = json.loads((out / "manifest.json").read_text())
    assert (meta["pattern"], meta["eval_pattern"]) == (c4_like.PATTERN, c4_like.EVAL_PATTERN)
    assert meta["eval_inputs"] == [str(c4_like.root)] and meta["eval_split"] == "eval_input"


def test_an_unfinished_run_with_another_eval_pattern_is_refused(c4_like, tmp_path, capsys,
                                                                 monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(prepare_module._ShardWriter, "close", _fail)
    with pytest.raises(RuntimeError, match="injected"):
        _c4(c4_like, out)
    monkeypatch.undo()
    args = json.loads((tmp_path / ".out.partial" / "args.json").read_text())
    assert args["eval_pattern"] == c4_like.EVAL_PATTERN and args["eval_inputs"]
    code, err = _main(capsys, f"--input={c4_like.root}", f"--pattern={c4_like.PATTERN}",
                      f"--eval_input={c4_like.root}", "--eval_pattern=c4-validation.*",
                      f"--output={out}", "--tokenizer=bpe:300", "--chunk_mb=0.001",
                      "--chunks_per_shard=1")
    assert code == 2 and err.count("\n") == 1
    assert (f"other arguments (eval_pattern={c4_like.EVAL_PATTERN!r} there, 'c4-validation.*' "
            "now)") in err


@pytest.mark.slow
def test_prepare_runs_under_a_memory_cap_smaller_than_the_corpus(tmp_path):
    """A 640 MiB corpus prepared by processes each capped at 512 MiB of address space
    (``RLIMIT_AS``, inherited by the tokenizer workers): memory does not grow with the
    corpus."""
    import resource

    cap = 512 * 2**20
    src = write_corpus(tmp_path / "src", 640, files=2)
    assert sum(f.stat().st_size for f in src.iterdir()) > cap

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    out = subprocess.run([sys.executable, "-m", "boost_jax.data.prepare", f"--input={src}",
                          f"--output={tmp_path / 'out'}", "--tokenizer=llama32k",
                          "--workers=2", "--json"], preexec_fn=limit, capture_output=True,
                         text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:]
    assert verify(tmp_path / "out") == []
    summary = json.loads(out.stdout)
    assert summary["train_tokens"] > 50_000_000 and summary["peak_rss_mib"] < 512


# --- the command: --overwrite, one-line errors, the progress bar ----------------------------
TEXT = "To be, or not to be, that is the question. " * 40


def _command(capsys, *args: str) -> tuple[int, str, str]:
    """The command run in this process with ``args``: (exit code, stdout, stderr)."""
    from absl import flags

    from boost_jax.commands import prepare as prepare_command

    fv = flags.FlagValues()
    prepare_command.define_flags(fv)
    code = prepare_command.main(fv(["prepare", *args]), fv)
    out, err = capsys.readouterr()
    return code, out, err


def _main(capsys, *args: str) -> tuple[int, str]:
    """The command run in this process with ``args``: (exit code, what it wrote on stderr)."""
    code, _, err = _command(capsys, *args)
    return code, err


def test_the_command_ends_with_a_short_summary_and_the_manifest_one_flag_away(tmp_path,
                                                                              capsys):
    """Issue 49: stdout is two lines (what was prepared, its time and where the manifest is),
    status lines go to stderr, and ``--json`` prints the manifest as before. Seen failing on
    the old command (about 40 lines of JSON by default)."""
    (tmp_path / "in.txt").write_text(TEXT)
    for name, extra in (("short", []), ("manifest", ["--json"])):
        code, out, _ = _command(capsys, f"--input={tmp_path / 'in.txt'}",
                                f"--output={tmp_path / name}", "--tokenizer=bpe:300",
                                "--workers=0", *extra)
        assert code == 0
        if name == "short":
            first, second = out.splitlines()
            assert first.startswith(f"prepared {tmp_path / name}: ")
            assert "tokenizer bpe:300" in first
            assert second.endswith(f"the manifest: {tmp_path / name}/manifest.json (or --json)")
        else:
            assert json.loads(out)["tokenizer"] == "bpe:300"


def _snapshot(root, directories: bool = True) -> dict:
    """Every path under ``root`` with its inode, size and mtime: equal when nothing changed
    (``directories=False``: when nothing is left changed, a directory's mtime aside)."""
    return {p: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            if directories or p.is_file() else None for p in root.rglob("*")}


def _fail(self):
    raise RuntimeError("injected failure")


def test_an_existing_dataset_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    out = tmp_path / "out"
    prepare([tmp_path / "in.txt"], out, tokenizer="llama32k")
    before = _snapshot(tmp_path)
    code, err = _main(capsys, f"--input={tmp_path / 'in.txt'}", f"--output={out}",
                      "--tokenizer=llama32k")
    assert code == 2
    assert err.startswith(f"boost_jax.data.prepare: error: {out} already holds a prepared "
                          "dataset (")
    assert err.endswith("tokenizer llama32k); pass --overwrite to replace it\n")
    assert err.count("\n") == 1 and _snapshot(tmp_path) == before


def test_overwrite_builds_beside_and_swaps_in_only_when_complete(tmp_path, capsys, monkeypatch):
    """A failure while the replacement is built leaves the old dataset intact (and readable
    all along); a rerun of --overwrite then replaces it and leaves nothing else behind."""
    src, out = tmp_path / "in.txt", tmp_path / "out"
    src.write_text(TEXT)
    old = prepare([src], out, tokenizer="llama32k")

    def fail(self):
        assert json.loads((out / "manifest.json").read_text()) == old  # still the old one
        raise RuntimeError("injected failure")

    monkeypatch.setattr(prepare_module._ShardWriter, "close", fail)
    with pytest.raises(RuntimeError, match="injected"):
        prepare([src], out, tokenizer="bpe:300", overwrite=True)
    assert json.loads((out / "manifest.json").read_text()) == old and verify(out) == []
    assert (tmp_path / ".out.partial").is_dir()  # kept: a rerun resumes it
    monkeypatch.undo()
    code, err = _main(capsys, f"--input={src}", f"--output={out}", "--tokenizer=bpe:300",
                      "--workers=0", "--overwrite")
    assert code == 0, err
    new = json.loads((out / "manifest.json").read_text())
    assert new["tokenizer"] == "bpe:300" and new["vocab_size"] <= 300 and verify(out) == []
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out"]  # no work or old directory left


def test_an_unfinished_run_of_other_arguments_is_refused_then_discarded(tmp_path, capsys,
                                                                         monkeypatch):
    src, out = tmp_path / "in.txt", tmp_path / "out"
    src.write_text(TEXT)
    monkeypatch.setattr(prepare_module._ShardWriter, "close", _fail)
    with pytest.raises(RuntimeError, match="injected"):
        prepare([src], out, tokenizer="llama32k")
    monkeypatch.undo()
    before = _snapshot(tmp_path)
    args = [f"--input={src}", f"--output={out}", "--tokenizer=bpe:300", "--workers=0"]
    code, err = _main(capsys, *args)
    assert code == 2 and err.count("\n") == 1
    assert ("holds an unfinished run with other arguments (tokenizer='llama32k' there, "
            "'bpe:300' now); rerun with those") in err
    assert _snapshot(tmp_path) == before
    code, err = _main(capsys, *args, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["tokenizer"] == "bpe:300"
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out"]


# (flags over the defaults --input=in.txt --output=out --tokenizer=llama32k; None drops one,
# {t} is the test's directory) -> what the one-line error says
BAD = {
    "missing input": ({"input": "{t}/missing.txt"}, "input {t}/missing.txt does not exist"),
    "empty directory": ({"input": "{t}/empty"}, "no input files in {t}/empty"),
    "blank corpus": ({"input": "{t}/blank.txt"}, "no text to prepare in {t}/blank.txt"),
    "unknown tokenizer": ({"tokenizer": "wordpiece"}, "unknown tokenizer 'wordpiece'; use"),
    "bpe vocab too small": ({"tokenizer": "bpe:100"}, "the vocabulary size must be"),
    "bpe vocab not a number": ({"tokenizer": "bpe:lots"}, "the vocabulary size must be"),
    "missing spm file": ({"tokenizer": "spm:{t}/no.model"}, "no file {t}/no.model"),
    "spm file not a model": ({"tokenizer": "spm:{t}/in.txt"}, "is not a SentencePiece .model"),
    "output parent is a file": ({"output": "{t}/in.txt/out"}, "{t}/in.txt is not a directory"),
    "output holds other files": ({"output": "{t}/taken"}, "holds other files, not a prepared"),
    "output inside the input": ({"input": "{t}", "output": "{t}/out"},
                                "is inside the input directory"),
    "jsonl without the field": ({"input": "{t}/body.jsonl"}, "body.jsonl:1: no field 'text' "
                                "(fields: body)"),
    "malformed jsonl line late": ({"input": "{t}/late.jsonl", "chunk_mb": "0.0001"},
                                  "late.jsonl:3: not valid JSON"),
    "latin-1 text": ({"input": "{t}/latin1.txt"}, "{t}/latin1.txt: 2 byte(s) that are not "
                     "UTF-8 (the first, 0xe9, in the text); prepare reads UTF-8 text: convert "
                     "the file first, e.g. iconv -f latin1 -t utf-8"),
    "latin-1 jsonl line late": ({"input": "{t}/latin1.jsonl", "chunk_mb": "0.0001"},
                                "latin1.jsonl: 1 byte(s) that are not UTF-8 (the first, 0xe9, "
                                "in line 3)"),
    "eval fraction": ({"eval_fraction": "1.5"}, "--eval_fraction=1.5 must be in [0, 1)"),
    "pattern matches nothing": ({"input": "{t}/c4", "pattern": "c4-train.*.json.gz"},
                                "--pattern='c4-train.*.json.gz' matches none of the 1 files "
                                "under {t}/c4 (e.g. notes.txt); check --pattern"),
    "pattern without a directory": ({"pattern": "*.txt"}, "--input names none (a file named "
                                    "explicitly is always read); drop --pattern"),
    "eval pattern matches nothing": ({"eval_input": "{t}/c4", "eval_pattern": "c4-valid*"},
                                     "--eval_pattern='c4-valid*' matches none of the 1 files"),
    "eval pattern without eval input": ({"eval_pattern": "c4-valid*"}, "--eval_pattern="
                                        "'c4-valid*' selects among the files of --eval_input, "
                                        "which is not given"),
    "eval input and eval fraction": ({"eval_input": "{t}/c4", "eval_fraction": "0.05"},
                                     "--eval_fraction=0.05 and --eval_input both define the "
                                     "eval split; use --eval_input alone"),
    "missing eval input": ({"eval_input": "{t}/gone"}, "eval input {t}/gone does not exist; "
                           "check --eval_input"),
    "blank eval input": ({"eval_input": "{t}/blank.txt"}, "no text to prepare in {t}/blank.txt "
                         "(files: 1, documents: 1, all empty or blank); check --eval_input"),
    "train file as eval input": ({"eval_input": "{t}/in.txt"}, "{t}/in.txt is both a training "
                                 "and an eval input"),
    "no output": ({"output": None}, "--input and --output are required"),
    "verify a non-dataset": ({"verify": "{t}"}, "no manifest.json"),
    "positional argument": ({"": "extra"}, "unexpected arguments 'extra'"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_user_error_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    t = tmp_path / "t"
    t.mkdir()
    (t / "in.txt").write_text(TEXT)
    (t / "blank.txt").write_text(" \n\t\n")
    (t / "empty").mkdir()
    (t / "taken").mkdir()
    (t / "taken" / "notes.md").write_text("mine")
    (t / "body.jsonl").write_text(json.dumps({"body": TEXT}) + "\n")
    (t / "late.jsonl").write_text(2 * (json.dumps({"text": TEXT}) + "\n") + "{oops\n")
    (t / "latin1.txt").write_bytes(f"{TEXT} café, naïve".encode("latin-1"))
    (t / "latin1.jsonl").write_bytes((2 * (json.dumps({"text": TEXT}) + "\n") +
                                      '{"text": "café"}\n').encode("latin-1"))
    (t / "c4").mkdir()
    (t / "c4" / "notes.txt").write_text(TEXT)
    overrides, expected = BAD[case]
    flags = {"input": "{t}/in.txt", "output": "{t}/out", "tokenizer": "llama32k",
             "workers": "0", **overrides}
    args = [f"--{k}={v}" if k else v for k, v in flags.items() if v is not None]
    # found while writing: what was written goes
    late = case in ("malformed jsonl line late", "latin-1 jsonl line late")
    before = _snapshot(tmp_path, directories=not late)
    code, err = _main(capsys, *(a.format(t=t) for a in args))
    assert code == 2
    assert err.startswith("boost_jax.data.prepare: error: ") and err.count("\n") == 1, err
    assert expected.format(t=t) in err and "Traceback" not in err
    assert _snapshot(tmp_path, directories=not late) == before


def test_an_output_in_a_read_only_directory_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "in.txt").write_text(TEXT)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: answer as for anyone else
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: p != ro and access(p, mode))
    code, err = _main(capsys, f"--input={tmp_path / 'in.txt'}", f"--output={ro}/new/out",
                      "--tokenizer=llama32k")
    assert code == 2 and err.count("\n") == 1
    assert f"cannot create {ro}/new/out: {ro} is not writable; choose an --output" in err
    assert not os.listdir(ro)


@pytest.mark.parametrize("flag, expected", [
    ("--input=/nonexistent/in.txt", "input /nonexistent/in.txt does not exist"),
    ("--eval_fraction=lots", "could not convert string to float: 'lots'"),
])
def test_the_command_reports_user_errors_without_traceback(tmp_path, flag, expected):
    """The real command line (absl flag parsing included), in a subprocess."""
    out = subprocess.run([sys.executable, "-m", "boost_jax.data.prepare",
                          f"--output={tmp_path / 'out'}", flag], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "BOOST_JAX_DEBUG": "0"})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("boost_jax.data.prepare: error: ") and expected in out.stderr
    assert "Traceback" not in out.stderr and not os.listdir(tmp_path)


def test_debug_switch_raises_instead(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BOOST_JAX_DEBUG", "1")
    with pytest.raises(PrepareError, match="does not exist"):
        _main(capsys, f"--input={tmp_path / 'missing.txt'}", f"--output={tmp_path / 'out'}")


def test_progress_bar_follows_the_compressed_input_to_its_end(tmp_path, monkeypatch):
    """The bar (forced on: stderr is no terminal under pytest) counts the bytes of the input
    files as they are, here gzip, and ends at their total."""
    import io

    from tqdm import tqdm

    shown, bars = io.StringIO(), []

    class Shown(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **dict(kwargs, disable=False, delay=0, file=shown))
            bars.append(self)

    monkeypatch.setattr(prepare_module, "tqdm", Shown)
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"{k}: {TEXT}"}) + "\n" for k in range(40))
    meta = prepare([tmp_path / "in.jsonl.gz"], tmp_path / "out", tokenizer="llama32k",
                   chunk_mb=0.005)
    (bar,) = bars
    assert bar.n == bar.total == (tmp_path / "in.jsonl.gz").stat().st_size
    assert "tokenizing: 100%" in shown.getvalue()
    assert f"{meta['train_tokens'] + meta['eval_tokens']:,} tokens" in shown.getvalue()


def test_a_bundled_corpus_says_what_it_prepares_and_where(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(prepare_module, "prepare", lambda *a, **k: calls.append((a, k)))
    out = prepare_module.ensure_bundled("shakespeare", "bpe:512", 0.02, tmp_path)
    assert out.parent == tmp_path / "data" and len(calls) == 1
    assert calls[0][1] == {"overwrite": True}  # a stale unfinished run restarts
    assert capsys.readouterr().err == (f"preparing the bundled corpus 'shakespeare' with "
                                       f"tokenizer bpe:512 into {out} (first use only)\n")


def test_a_tokenizer_that_appends_its_end_of_sequence_token(tmp_path):
    """``hf:<directory>`` with a t5-like tokenizer.json (no ``<|endoftext|>``; its template
    appends ``</s>``, as t5-base's does): each prepared document is exactly what the tokenizer
    gives with its special tokens -- ``transformers``' ``tokenizer(text)`` -- the appended
    ``</s>`` the end-of-text id; the manifest's ``max_id`` is the largest id written, below
    ids the text never produces (t5's 100 sentinels, 32000-32099), so a model of the
    papers' 32000 rows takes t5's 32100-token data."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "the king queen of a to be or not".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)},
             "<extra_id_0>": 12, "<extra_id_1>": 13}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    (tmp_path / "t5like").mkdir()
    tok.save(str(tmp_path / "t5like" / "tokenizer.json"))
    docs = ["the king of a", "to be or not to be", "the queen"] * 4
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare([tmp_path / "in.jsonl"], tmp_path / "out",
                   tokenizer=f"hf:{tmp_path / 't5like'}", eval_fraction=0.2, workers=0)
    assert (meta["eos_id"], meta["vocab_size"]) == (1, len(vocab))
    (shard,) = meta["shards"]
    tokens = np.fromfile(tmp_path / "out" / "shards" / shard["file"], np.dtype(meta["dtype"]))
    offsets = np.load(tmp_path / "out" / "shards" / shard["docs"])
    written = sorted(tuple(tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:]))
    assert written == sorted(tuple(tok.encode(d).ids) for d in docs)
    assert meta["max_id"] == tokens.max() == 11
    from boost_jax.config import Data
    from boost_jax.data.loader import open_dataset

    assert open_dataset(Data(path=str(tmp_path / "out"))).ids_used == 12  # of 14
    no_eos = tmp_path / "plain.json"
    tok.post_processor = None
    tok.save(str(no_eos))
    with pytest.raises(PrepareError, match="appends no end-of-sequence token"):
        prepare([tmp_path / "in.jsonl"], tmp_path / "out2", tokenizer=f"hf:{no_eos}")
