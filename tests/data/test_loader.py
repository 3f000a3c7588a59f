"""The grain pipeline: determinism, resume, per-process rows, eval batches, errors."""

import numpy as np
import pytest

from boost_jax.config import ConfigError, Data
from boost_jax.data.loader import _regions, eval_batches, open_dataset, train_iterator


def _take(it, n):
    return [next(it) for _ in range(n)]


def _tokens(path, split):
    (region,) = _regions(path, split)  # the tiny corpus is one shard
    return np.asarray(region)


def test_windows_are_shifted_token_pairs(tiny_data):
    ds = open_dataset(Data(path=str(tiny_data)))
    tokens = _tokens(tiny_data, "train")
    w = ds.windows("train", 16)
    assert len(w) == (len(tokens) - 1) // 16
    item = w[3]
    np.testing.assert_array_equal(item["inputs"], tokens[48:64])
    np.testing.assert_array_equal(item["targets"], tokens[49:65])


def test_same_seed_same_stream_other_seed_other_stream(tiny_data):
    ds = open_dataset(Data(path=str(tiny_data)))
    a = _take(train_iterator(ds, 32, 8, seed=1), 5)
    b = _take(train_iterator(ds, 32, 8, seed=1), 5)
    c = _take(train_iterator(ds, 32, 8, seed=2), 5)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))
    assert a[0]["inputs"].shape == (8, 32) and a[0]["inputs"].dtype == np.int32


def test_epochs_are_permutations(tiny_data):
    ds = open_dataset(Data(path=str(tiny_data)))
    n = len(ds.windows("train", 64))
    rows = np.concatenate([b["inputs"] for b in _take(train_iterator(ds, 64, 1, 0), 2 * n)])
    first, second = rows[:n], rows[n:]
    key = lambda r: r.tobytes()  # noqa: E731
    assert sorted(map(key, first)) == sorted(map(key, second))  # every window once per epoch
    assert any(not np.array_equal(x, y) for x, y in zip(first, second))  # reshuffled


def test_resume_continues_the_stream(tiny_data):
    ds = open_dataset(Data(path=str(tiny_data)))
    it = train_iterator(ds, 32, 4, seed=0)
    _take(it, 7)
    state = it.get_state()
    expected = _take(it, 5)
    it2 = train_iterator(ds, 32, 4, seed=0)
    it2.set_state(state)
    for x, y in zip(expected, _take(it2, 5)):
        np.testing.assert_array_equal(x["targets"], y["targets"])


@pytest.mark.parametrize("packing", ["concat", "document"])
def test_prefetch_runs_ahead_in_a_thread_and_resumes_at_the_next_batch_taken(
        tiny_data, packing_data, packing):
    """``put`` (the trainer's: onto the devices) runs 2 batches ahead in a background thread;
    the iterator's state is that of the batches handed out, so a new iterator set to it (with
    or without prefetch) continues with the batch a step would take next."""
    import threading
    import time

    ds = open_dataset(Data(path=str(packing_data if packing == "document" else tiny_data),
                           packing=packing))
    threads = []

    def put(batch):
        threads.append(threading.current_thread())
        return {k: v + 0 for k, v in batch.items()}

    plain = _take(train_iterator(ds, 32, 8, seed=0), 6)
    it = train_iterator(ds, 32, 8, seed=0, put=put, prefetch=2)
    got = _take(it, 3)
    deadline = time.monotonic() + 30
    while len(threads) < 5 and time.monotonic() < deadline:  # 3 taken + 2 waiting
        time.sleep(0.01)
    assert len(threads) >= 5 and threading.main_thread() not in threads
    state = it.get_state()
    it.close()
    for again in (train_iterator(ds, 32, 8, seed=0),
                  train_iterator(ds, 32, 8, seed=0, put=put, prefetch=2)):
        again.set_state(state)
        stream = got + _take(again, 3)
        again.close()
        assert all(np.array_equal(x[k], y[k]) for x, y in zip(stream, plain) for k in x)


def test_processes_read_their_rows_of_the_global_batch(tiny_data):
    ds = open_dataset(Data(path=str(tiny_data)))
    whole = _take(train_iterator(ds, 32, 8, seed=0), 3)
    parts = [_take(train_iterator(ds, 32, 8, seed=0, rows=(4 * p, 4 * p + 4)), 3)
             for p in range(2)]
    for b, (p0, p1) in enumerate(zip(*parts)):
        np.testing.assert_array_equal(np.concatenate([p0["inputs"], p1["inputs"]]),
                                      whole[b]["inputs"])
    ev = eval_batches(ds, 32, 8, 2)
    ev_parts = [eval_batches(ds, 32, 8, 2, (4 * p, 4 * p + 4)) for p in range(2)]
    assert len(ev) == 2
    for b in range(2):
        np.testing.assert_array_equal(
            np.concatenate([ev_parts[0][b]["inputs"], ev_parts[1][b]["inputs"]]), ev[b]["inputs"])


def test_eval_is_fixed_and_in_order(tiny_data, caplog):
    ds = open_dataset(Data(path=str(tiny_data)))
    ev = eval_batches(ds, 16, 4, 3)
    tokens = _tokens(tiny_data, "eval")
    np.testing.assert_array_equal(ev[0]["inputs"][1], tokens[16:32])
    assert eval_batches(ds, 512, 64, 1) == []  # a small corpus: no eval, with a notice
    assert "no evaluation: the eval split" in caplog.text
    assert "cannot fill one batch of Train.batch_size=64" in caplog.text


def test_missing_and_bad_datasets(tmp_path):
    with pytest.raises(ConfigError, match="no prepared dataset"):
        open_dataset(Data(path=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="no bundled corpus 'klingon'"):
        open_dataset(Data(path="bundled:klingon", cache_dir=str(tmp_path)))


def test_a_truncated_manifest_or_shard_is_one_line(tiny_data, tmp_path):
    """A dataset damaged after prepare (a copy cut short): its manifest or a shard truncated is
    a ConfigError (one line from the commands, exit 2) naming the file and the check to run,
    not json's or numpy's traceback when the file is read or memory-mapped."""
    import shutil

    for victim in ("manifest.json", "shard"):
        copy = tmp_path / victim
        shutil.copytree(tiny_data, copy)
        (f,) = (copy / "shards").glob("*.bin") if victim == "shard" else [copy / victim]
        f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
        with pytest.raises(ConfigError) as err:
            open_dataset(Data(path=str(copy)))
        assert "\n" not in str(err.value) and f"--verify={copy}" in str(err.value)
        assert ("not valid JSON" if victim == "manifest.json" else
                f"{f.relative_to(copy)} holds {f.stat().st_size:,} bytes") in str(err.value)


def test_bundled_corpus_prepares_once(tmp_path):
    data = Data(path="bundled:shakespeare", tokenizer="bpe:512", cache_dir=str(tmp_path))
    ds = open_dataset(data)
    assert ds.meta["documents"] == 42 and ds.meta["train_tokens"] > 1_000_000
    mtime = (ds.path / "manifest.json").stat().st_mtime
    assert open_dataset(data).path == ds.path
    assert (ds.path / "manifest.json").stat().st_mtime == mtime
    first = next(train_iterator(ds, 64, 2, 0))
    assert first["inputs"].shape == (2, 64)
    assert not [p for p in ds.path.parent.iterdir() if "partial" in p.name]  # no work dir left


def test_processes_preparing_one_corpus_take_turns(tmp_path):
    """Two processes open the same bundled corpus on a fresh cache at once (what
    ``launch/local.sh 2`` does): one prepares, the other waits for it; both succeed."""
    import subprocess
    import sys

    code = ("import sys; from boost_jax.config import Data; "
            "from boost_jax.data.loader import open_dataset; "
            "ds = open_dataset(Data(path='bundled:shakespeare', tokenizer='bpe:512', "
            f"cache_dir={str(tmp_path)!r})); print(ds.path, ds.meta['train_tokens'])")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    assert outs[0][0] == outs[1][0]
    assert not [p for p in (tmp_path / "data").iterdir() if "partial" in p.name]


def test_a_bundled_corpus_names_the_tokenizer_that_fits_too():
    """Issue 49: the tiny model (512 rows) on the default bundled corpus (bpe:4096): the line
    names both fixes, a larger ``Model.vocab_size`` or a tokenizer of the model's size. Seen
    failing on the old message (neither binding named)."""
    from boost_jax.data.loader import check_vocab

    with pytest.raises(ConfigError) as err:
        check_vocab(512, Data(), 4096)
    assert str(err.value) == (
        "Model.vocab_size=512 is smaller than the vocabulary of Data.path='bundled:shakespeare' "
        "(its largest token id + 1: 4096): add --gin_param=Model.vocab_size=4096, or prepare "
        "the bundled corpus with a tokenizer that fits the model: "
        "--gin_param=\"Data.tokenizer='bpe:512'\"")
    check_vocab(4096, Data(), 4096)
