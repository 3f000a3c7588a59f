"""``Train.wandb=True``: the trainer's Weights & Biases run, offline only (no network), read
back from its files under the workdir; and the one-line error without the package."""

import json
import struct
import sys

import pytest

from tests.train.test_cli import _tiny_gin, _train_main
from tests.train.test_trainer import _losses


def _offline(monkeypatch, tmp_path) -> None:
    """W&B offline and silent, its settings and caches under ``tmp_path`` (not $HOME)."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                       "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                       "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(key, str(value))
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(key, raising=False)


def _records(run_dir) -> dict[str, list]:
    """The records of an offline run's ``.wandb`` file by type (``config``, ``summary``,
    ``history``...). wandb 0.31 has no Python reader of its own: the file is a LevelDB-style
    log (a 7-byte file header, 32 KiB blocks of records each behind a 7-byte header: CRC,
    little-endian length, type: 1 full, 2 first, 3 middle, 4 last) of ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, chunks, out = 7, 32768, [], {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            out.setdefault(record.WhichOneof("record_type"), []).append(record)
    return out


def _items(items) -> dict:
    """``{key: value}`` of a record's ``item`` or ``update`` list (values as JSON)."""
    return {"/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json)
            for i in items}


def test_offline_run_holds_the_config_metrics_and_samples(tiny_data, tmp_path, monkeypatch,
                                                           capsys):
    """A 3-step run, then resumed to 5: one W&B run id (kept in the workdir), each process's
    offline run under ``<workdir>/wandb``; its config holds the run's fields, its summary the
    last step's loss as in metrics.jsonl, its history one row per metrics.jsonl record."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install "
                        "'boost_jax[wandb]' (the test extra has it)")
    _offline(monkeypatch, tmp_path)
    workdir = tmp_path / "run"
    gin = [*_tiny_gin(tiny_data), "Train.wandb=True", "Train.wandb_project='test'",
           "Train.sample_every=2", "Train.sample_tokens=4", "Train.checkpoint_every=3",
           "Train.eval_every=2", "Train.schedule_steps=5"]
    runs, first_lines = [], 0
    for steps in (3, 5):
        if runs:  # the first process's lines (its checkpoint is its last step: none rewound)
            first_lines = len((workdir / "metrics.jsonl").read_text().splitlines())
        code, _, err = _train_main(capsys, workdir, [*gin, f"Train.steps={steps}"])
        assert code == 0, err
        run_id = (workdir / "wandb_run_id").read_text().strip()
        new = set((workdir / "wandb").glob(f"offline-run-*-{run_id}")) - {r for r, _ in runs}
        assert len(new) == 1, sorted((workdir / "wandb").iterdir())
        runs.append((new.pop(), run_id))
    assert runs[0][1] == runs[1][1]  # the resumed run continues the same W&B run

    records = _records(runs[1][0])
    (run,) = records["run"]
    config = _items(run.run.config.update)
    assert config["Model"]["size"] == "tiny" and config["Data"]["path"] == str(tiny_data)
    assert config["Train"]["steps"] == 5 and config["Train"]["wandb"] is True

    summary = {}
    for record in records["summary"]:
        summary.update(_items(record.summary.update))
    losses = _losses(workdir)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert summary["train/loss"] == losses[5] and summary["step"] == 5

    # the resumed process's history: one row per line it added to metrics.jsonl, in order
    # (the goodput record it inherits at step 3; steps, goodput, evals and samples at 4 and
    # 5; its final goodput record), each number under its TensorBoard name (a None, like
    # mfu on a device of unknown peak, is left out)
    lines = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text().splitlines()][first_lines:]
    history = [_items(r.history.item) for r in records["history"]]
    assert len(history) == len(lines) == 10
    for row, line in zip(history, lines, strict=True):
        assert row["step"] == line["step"]
        if "samples" in line:  # a table of the texts
            assert row["train/samples/_type"] == "table-file"
            assert row["train/samples/nrows"] == len(line["samples"])
            continue
        names = {k.split("/", 1)[1] if k.startswith(("train/", "eval/")) else k: v
                 for k, v in row.items() if not k.startswith("_") and k != "step"}
        numbers = {k: v for k, v in line.items() if k != "step" and v is not None}  # mfu: None
        assert names == numbers, (row, line)
    assert [(r["step"], r["train/loss"]) for r in history if "train/loss" in r] == \
        [(4, losses[4]), (5, losses[5])]


def test_without_the_package_is_one_line(tiny_data, tmp_path, monkeypatch, capsys):
    """``Train.wandb=True`` where wandb cannot be imported: exit code 2, one line naming the
    extra, nothing trained."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib finds no wandb
    workdir = tmp_path / "run"
    code, _, err = _train_main(capsys, workdir, [*_tiny_gin(tiny_data), "Train.wandb=True"])
    assert code == 2 and "Traceback" not in err
    (error,) = [line for line in err.splitlines() if "error" in line]
    assert error == ("boost_jax.train: error: Train.wandb=True needs the wandb package: pip "
                     "install 'boost_jax[wandb]' (or set Train.wandb=False)")
    assert not (workdir / "checkpoints").exists()
