"""The prepare command: inputs, tokenizers, splits, atomic output."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.prepare import prepare, read_documents, verify
from boost_jax.data.synthetic import write_corpus


def test_reads_text_jsonl_and_compressed(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.raw").write_text("fourth")
    docs = list(read_documents([tmp_path / "a.txt", tmp_path / "b.jsonl.gz", tmp_path / "sub"]))
    assert docs == ["first document", "second", "third", "fourth"]
    with pytest.raises(KeyError, match="no field 'body'"):
        list(read_documents([tmp_path / "b.jsonl.gz"], text_field="body"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
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
    with pytest.raises(KeyError, match="no column 'body'"):
        list(read_documents([saved], text_field="body"))


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


def test_prepare_refuses_to_overwrite_and_leaves_no_partial(tmp_path, tiny_data):
    with pytest.raises(FileExistsError):
        prepare([tmp_path], tiny_data)
    (tmp_path / "in.txt").write_text("hello world " * 50)
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer="wordpiece")
    assert not (tmp_path / "out").exists()  # only the resumable work directory


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
    from boost_jax.data.pipeline import open_dataset

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
                          "--workers=2"], preexec_fn=limit, capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:]
    assert verify(tmp_path / "out") == []
    summary = json.loads(out.stdout)
    assert summary["train_tokens"] > 50_000_000 and summary["peak_rss_mib"] < 512
