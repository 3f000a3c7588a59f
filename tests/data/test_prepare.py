"""The prepare command: inputs, tokenizers, splits, atomic output."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from boost_jax.data import tokenizer as tokenizers
from boost_jax.data.prepare import prepare, read_documents


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


def test_prepared_layout(tiny_data):
    meta = json.loads((tiny_data / "meta.json").read_text())
    train, ev = np.load(tiny_data / "train.npy"), np.load(tiny_data / "eval.npy")
    assert meta["vocab_size"] == 512 and train.dtype == np.uint16
    assert (meta["train_tokens"], meta["eval_tokens"]) == (len(train), len(ev))
    assert len(ev) == int((len(train) + len(ev)) * 0.05)
    assert train.max() < 512 and meta["documents"] == 3
    assert (train == meta["eos_id"]).sum() + (ev == meta["eos_id"]).sum() == 3
    tok = tokenizers.load(tiny_data)
    text = tok.decode(train[:200])
    assert "the" in text.lower()  # real English, not random ids


def test_prepare_refuses_to_overwrite_and_leaves_no_partial(tmp_path, tiny_data):
    with pytest.raises(FileExistsError):
        prepare([tmp_path], tiny_data)
    (tmp_path / "in.txt").write_text("hello world " * 50)
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer="wordpiece")
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir())


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
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["vocab_size"] <= 300
