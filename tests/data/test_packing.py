"""Document packing: the pieces of a split, packed rows, per-process rows, resume, eval."""

import numpy as np
import pytest

from boost_jax.config import ConfigError, Data
from boost_jax.data.loader import _regions, eval_batches, open_dataset, train_iterator
from boost_jax.data.packing import DocumentPieces

SEQ = 32


def _dataset(path, tmp_path, bins=64):
    return open_dataset(Data(path=str(path), packing="document", cache_dir=str(tmp_path),
                             packing_bins=bins))


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_pieces_cover_every_token_of_the_split_once(packing_data, tmp_path, split):
    ds = _dataset(packing_data, tmp_path)
    assert len(ds.meta["shards"]) >= 3
    pieces = ds.pieces(split, SEQ)
    items = [pieces[j] for j in range(len(pieces))]
    assert all(1 <= len(x["inputs"]) <= SEQ for x in items)
    assert any(len(x["inputs"]) == SEQ for x in items) and any(len(x["inputs"]) < 8
                                                              for x in items)
    for x in items:  # next-token pairs
        np.testing.assert_array_equal(x["inputs"][1:], x["targets"][:-1])
    targets = np.concatenate([x["targets"] for x in items])
    tokens = np.concatenate([np.asarray(r) for r in _regions(packing_data, split)])
    np.testing.assert_array_equal(targets, tokens)  # every token a target once, in order
    eos = ds.meta["eos_id"]
    starts = [x for x in items if x["inputs"][0] == eos]
    assert len(starts) >= ds.meta["documents"] * (0.05 if split == "eval" else 0.8)
    # the index is built once and shared
    assert len(list((tmp_path / "pieces").glob(f"*-{split}-{SEQ}.bin"))) == 1
    assert len(DocumentPieces(packing_data, split, SEQ, tmp_path)) == len(pieces)


def _check_rows(batch, pieces):
    """Every row: segments 1, 2, ... then padding 0; positions restart per segment; each
    segment is one whole piece."""
    seg, pos = batch["segment_ids"], batch["positions"]
    for r in range(seg.shape[0]):
        ids = seg[r][seg[r] > 0]
        assert (seg[r][len(ids):] == 0).all() and (np.diff(ids) >= 0).all()
        assert ids[0] == 1 and np.array_equal(np.unique(ids), np.arange(1, ids.max() + 1))
        for s in np.unique(ids):
            where = np.flatnonzero(seg[r] == s)
            np.testing.assert_array_equal(pos[r, where], np.arange(len(where)))
            key = (batch["inputs"][r, where].tobytes(), batch["targets"][r, where].tobytes())
            assert key in pieces


def test_packed_rows_are_whole_pieces(packing_data, tmp_path):
    ds = _dataset(packing_data, tmp_path)
    source = ds.pieces("train", SEQ)
    pieces = {(x["inputs"].tobytes(), x["targets"].tobytes())
              for x in (source[j] for j in range(len(source)))}
    batches = _take(train_iterator(ds, SEQ, 8, seed=0), 4)
    for b in batches:
        assert set(b) == {"inputs", "targets", "segment_ids", "positions"}
        assert all(v.shape == (8, SEQ) and v.dtype == np.int32 for v in b.values())
        _check_rows(b, pieces)
    used = np.mean([(b["segment_ids"] > 0).mean() for b in batches])
    assert used > 0.8, used  # first-fit over 8 bins leaves little padding


@pytest.mark.parametrize("bins", [64, 4, 2])
def test_packed_stream_per_process_rows_and_resume(packing_data, tmp_path, bins):
    """Processes (rows [0, 4) and [4, 8)) together read the global batch, whatever the
    packing groups (one of 8 rows, two of 4: one per process, four of 2: two per process)."""
    ds = _dataset(packing_data, tmp_path, bins)
    whole = _take(train_iterator(ds, SEQ, 8, seed=3), 3)
    for split in ([(0, 4), (4, 8)], [(0, 2), (2, 6), (6, 8)]):  # the second straddles groups
        parts = [_take(train_iterator(ds, SEQ, 8, seed=3, rows=rows), 3) for rows in split]
        for b in range(3):
            for k in whole[b]:
                np.testing.assert_array_equal(np.concatenate([p[b][k] for p in parts]),
                                              whole[b][k])
    _check_resume(ds)


def _check_resume(ds):
    """An iterator restored from its state after 5 batches gives the next 3 again."""
    it = train_iterator(ds, SEQ, 8, seed=3)
    _take(it, 5)
    state = it.get_state()
    expected = _take(it, 3)
    it2 = train_iterator(ds, SEQ, 8, seed=3)
    it2.set_state(state)
    for x, y in zip(expected, _take(it2, 3)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_packed_eval_is_fixed_and_split_by_rows(packing_data, tmp_path):
    ds = _dataset(packing_data, tmp_path)
    ev = eval_batches(ds, SEQ, 8, 2)
    again = eval_batches(ds, SEQ, 8, 2)
    halves = [eval_batches(ds, SEQ, 8, 2, (4 * p, 4 * p + 4)) for p in range(2)]
    assert len(ev) == 2
    for b in range(2):
        for k in ev[b]:
            np.testing.assert_array_equal(ev[b][k], again[b][k])
            np.testing.assert_array_equal(np.concatenate([h[b][k] for h in halves]), ev[b][k])
    assert eval_batches(ds, SEQ, 10_000, 1) == []  # too small: no eval, with a notice


def test_packing_needs_document_offsets(tiny_data, tmp_path):
    import json
    import shutil

    old = tmp_path / "format1"
    shutil.copytree(tiny_data, old)
    (old / "manifest.json").rename(old / "meta.json")
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps(dict(meta, format=1)))
    with pytest.raises(ConfigError, match="document offsets"):
        _dataset(old, tmp_path)
    with pytest.raises(ConfigError, match="Data.packing='pack' must be one of"):
        Data(packing="pack")


def test_max_segments_bounds_the_documents_per_row(packing_data, tmp_path):
    """``Data.max_segments``: no packed row holds more pieces (cuDNN's packed attention is
    built for the bound); without it, rows of this corpus hold more."""
    def most(max_segments):
        ds = open_dataset(Data(path=str(packing_data), packing="document",
                               cache_dir=str(tmp_path), max_segments=max_segments))
        batches = _take(train_iterator(ds, SEQ, 8, seed=0), 4)
        return max(int(b["segment_ids"].max()) for b in batches)
    assert most(None) > 2
    assert most(2) == 2


def _pad_dataset(path, tmp_path):
    return open_dataset(Data(path=str(path), packing="pad", cache_dir=str(tmp_path)))


def test_padded_rows_are_the_documents_cut_as_a_tokenizer_truncates(packing_data, tmp_path):
    """``Data.packing='pad'``: document ``i`` of the split is row ``i``: whole when it fits,
    else its first ``seq_len - 1`` tokens and the end-of-text id; inputs all but its last
    token, targets all but its first, segment 1 and positions 0.. on those, padding after."""
    ds = _pad_dataset(packing_data, tmp_path)
    rows, eos = ds.rows("eval", SEQ), ds.meta["eos_id"]
    pieces = ds.pieces("eval", SEQ)
    starts = [j for j in range(len(pieces)) if pieces[j]["inputs"][0] == eos]
    assert len(rows) == len(starts) > 8  # one row per document
    ends, cut = starts[1:] + [len(pieces)], 0
    for i in range(len(rows)):
        x, row = rows[i], rows.row(i)
        # a document's pieces' targets are its tokens (test_pieces_cover_every_token...)
        doc = np.concatenate([pieces[j]["targets"] for j in range(starts[i], ends[i])])
        if len(doc) <= SEQ:
            np.testing.assert_array_equal(row, doc)
        else:
            cut += 1
            np.testing.assert_array_equal(row, np.concatenate([doc[:SEQ - 1], [eos]]))
        n = len(row) - 1
        assert {k: v.shape for k, v in x.items()} == {k: (SEQ,) for k in x}
        np.testing.assert_array_equal(x["inputs"][:n], row[:-1])
        np.testing.assert_array_equal(x["targets"][:n], row[1:])
        np.testing.assert_array_equal(x["segment_ids"], np.arange(SEQ) < n)
        np.testing.assert_array_equal(x["positions"][:n], np.arange(n))
        assert not x["positions"][n:].any() and not x["inputs"][n:].any()
    assert cut > 0 and row[-1] == eos


def test_padded_stream_per_process_rows_resume_and_eval(packing_data, tmp_path):
    """The padded stream: global batches of whole rows that processes split by rows, resumed
    exactly from its state; eval in the split's order."""
    ds = _pad_dataset(packing_data, tmp_path)
    whole = _take(train_iterator(ds, SEQ, 8, seed=3), 3)
    assert set(whole[0]) == {"inputs", "targets", "segment_ids", "positions"}
    parts = [_take(train_iterator(ds, SEQ, 8, seed=3, rows=rows), 3)
             for rows in ((0, 4), (4, 8))]
    for b in range(3):
        for k in whole[b]:
            np.testing.assert_array_equal(np.concatenate([p[b][k] for p in parts]),
                                          whole[b][k])
    _check_resume(ds)
    (ev,) = eval_batches(ds, SEQ, 8, 1)
    rows = ds.rows("eval", SEQ)
    for k in ev:
        np.testing.assert_array_equal(ev[k], np.stack([rows[i][k] for i in range(8)]))
