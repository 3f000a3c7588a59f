"""A run whose checkpoints are on an object store (``--checkpoint_dir=s3://...``), used as a
user does: restarted on a fresh machine (an empty workdir) it keeps its history from the
run's files beside the checkpoints (checkpointing/run_files.py); its checkpoints are read back by
``boost_jax.export``, ``boost_jax.generate`` and ``boost_jax.eval`` from the bucket (no local
workdir), equal to the same checkpoint read from a local directory.

One tiny training run on moto's S3 server (started here: tests/checkpointing/test_object_store.py's
:func:`emulated`), restarted once on a new workdir, shared by the module's tests."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from boost_jax.checkpointing.run_files import RunFiles
from boost_jax.commands import export as export_cli
from boost_jax.commands import generate as generate_cli
from boost_jax.errors import ConfigError
from boost_jax.interop.formats import load_export
from boost_jax.operations.goodput import read_history
from boost_jax.testing import tiny
from boost_jax.train.loop import run
from boost_jax.train.trained import checkpoint_steps, load_trained, trained_config
from tests.checkpointing.test_object_store import _Bucket, _Emulator, emulated
from tests.interop.test_export import assert_params_equal
from tests.train.test_trainer import _config, _losses

PROMPTS = ["ROMEO:", "The king"]


@dataclasses.dataclass
class S3Run:
    store: _Emulator
    bucket: _Bucket
    prefix: str  # the checkpoints' key prefix in the bucket
    url: str  # --checkpoint_dir
    local: Path  # the same checkpoints, downloaded to a local directory
    ref: Path  # the workdir of the same run, uninterrupted, with local checkpoints
    first: str  # the metrics.jsonl of the first process (its workdir was then deleted)
    work: Path  # the workdir of the process that resumed it


@pytest.fixture(scope="module")
def store():
    with emulated("s3") as emulator:
        yield emulator


def _download(bucket: _Bucket, prefix: str, dest: Path) -> None:
    """Every object under ``prefix`` as a file under ``dest`` (with the store's client)."""
    for key in bucket.keys(prefix + "/"):
        path = dest / key[len(prefix) + 1:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bucket.emulator.read(bucket.name, key))


@pytest.fixture(scope="module")
def s3_run(store, tiny_data, tmp_path_factory) -> S3Run:
    """Tiny CoLA trained to step 4 on one device, checkpoints at 3 and 4 in the bucket only;
    checkpoint 4 then lost (deleted from the bucket) and the workdir too, as when a machine
    dies: resumed to step 6 in a new, empty workdir with the same --checkpoint_dir (from 3;
    checkpoint 6). The checkpoints are then downloaded to a local directory. Beside it, the
    same run uninterrupted in one local workdir."""
    bucket = store.bucket("runs")
    prefix = "team/run1/checkpoints"
    url = f"{bucket.url}/{prefix}"
    root = tmp_path_factory.mktemp("s3_run")
    one = jax.devices()[:1]

    def config(steps):  # (CoLA's own layout has no grouped-query attention: export)
        return _config(tiny_data, steps, model=tiny("cola", n_kv_heads=8), schedule_steps=6,
                       checkpoint_every=3)

    run(config(6), root / "ref", one)
    run(config(4), root / "first", one, checkpoint_dir=url)
    assert bucket.committed(prefix) == [3, 4] and not (root / "first" / "checkpoints").exists()
    first = (root / "first" / "metrics.jsonl").read_text()
    bucket.emulator.s3.delete_objects(Bucket=bucket.name, Delete={"Objects": [
        {"Key": k} for k in bucket.keys(f"{prefix}/4/")]})
    shutil.rmtree(root / "first")
    summary = run(config(6), root / "second", one, checkpoint_dir=url)
    assert (summary.start_step, summary.step) == (3, 6)
    assert bucket.committed(prefix) == [3, 6]
    _download(bucket, prefix, root / "local")
    return S3Run(store, bucket, prefix, url, root / "local", root / "ref", first,
                 root / "second")


def test_a_restart_on_a_fresh_workdir_keeps_the_history(s3_run):
    """The resumed process's new workdir starts from the bucket's copy of the metrics: steps
    1..6 logged once each, the losses of the uninterrupted run (bit for bit), step 4's first
    record moved aside, its time counted as lost to the restart and the first process's time
    kept in the goodput account; the bucket holds the run's files as the workdir has them."""
    work, bucket, prefix = s3_run.work, s3_run.bucket, s3_run.prefix
    rows = read_history(work / "metrics.jsonl")
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2, 3, 4, 5, 6]
    assert _losses(work) == _losses(s3_run.ref)
    first = [json.loads(line) for line in s3_run.first.splitlines()]
    (lost_step,) = [r for r in first if r["step"] == 4 and "loss" in r]
    assert lost_step in read_history(work / "metrics.rewound-3.jsonl")
    goodput = [r for r in rows if "goodput/wall_s" in r]
    first_wall = [r for r in first if "goodput/wall_s" in r][-1]["goodput/wall_s"]
    assert goodput[-1]["goodput/lost_s"] == lost_step["step_time"]
    assert goodput[0]["step"] == 3 and goodput[0]["goodput/wall_s"] > first_wall
    assert bucket.keys(f"{prefix}/run/") == [f"{prefix}/run/{name}" for name in
                                             ("config.gin", "config.json", "metrics.jsonl")]
    for name in ("config.gin", "metrics.jsonl"):
        assert bucket.emulator.read(bucket.name, f"{prefix}/run/{name}") == (
            work / name).read_bytes()


def test_the_run_files_rules(store, tmp_path, monkeypatch, caplog):
    """What :class:`RunFiles` copies: down, the bucket's metrics to a workdir without any or
    with a history that ends earlier (kept aside), never over one that ends later; up, only
    what changed; nothing for local checkpoints; a store that fails is a warning, and one that
    cannot be read at start is never written over."""
    bucket = store.bucket("rules")
    url = f"{bucket.url}/ckpt"
    remote = "ckpt/run"
    lines = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    bucket.emulator.write(bucket.name, f"{remote}/metrics.jsonl", lines.encode())
    bucket.emulator.write(bucket.name, f"{remote}/wandb_run_id", b"abc123\n")
    fresh, stale, ahead = (tmp_path / n for n in ("fresh", "stale", "ahead"))
    for work in (fresh, stale, ahead):
        work.mkdir()
    assert RunFiles(fresh, url).fetch() == ["metrics.jsonl", "wandb_run_id"]
    assert (fresh / "metrics.jsonl").read_text() == lines
    assert (fresh / "wandb_run_id").read_text() == "abc123\n"
    (stale / "metrics.jsonl").write_text('{"step": 2, "loss": 0.5}\n')
    assert RunFiles(stale, url, enabled=False).fetch() == []  # processes other than 0
    assert RunFiles(stale, url).fetch()[0] == "metrics.jsonl"
    assert (stale / "metrics.stale-2.jsonl").read_text() == '{"step": 2, "loss": 0.5}\n'
    assert (stale / "metrics.jsonl").read_text() == lines
    (ahead / "metrics.jsonl").write_text('{"step": 7, "loss": 0.5}\n')
    assert RunFiles(ahead, url).fetch() == ["wandb_run_id"]
    assert sorted(p.name for p in ahead.iterdir()) == ["metrics.jsonl", "wandb_run_id"]

    files = RunFiles(ahead, url)
    assert files.upload() == ["metrics.jsonl", "wandb_run_id"] and files.upload() == []
    with (ahead / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "loss": 0.4}\n')
    assert files.upload() == ["metrics.jsonl"]
    assert bucket.emulator.read(bucket.name, f"{remote}/metrics.jsonl") == (
        ahead / "metrics.jsonl").read_bytes()
    assert RunFiles(ahead, tmp_path / "local_ckpt").upload() == []  # local checkpoints: no copy

    def unreachable(*args, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr("etils.epath.gpath.PosixGPath.write_bytes", unreachable)
    assert RunFiles(ahead, url).upload() == []
    assert "could not copy config.gin" not in caplog.text  # (no such file in the workdir)
    assert "could not copy metrics.jsonl to s3://rules/ckpt/run (connection refused)" in (
        caplog.text)
    monkeypatch.setattr("etils.epath.gpath.PosixGPath.read_bytes", unreachable)
    blind = RunFiles(tmp_path / "fresh2", url)
    (tmp_path / "fresh2").mkdir()
    assert blind.fetch() == [] and blind.remote is None and blind.upload() == []
    assert "could not read the run's files in s3://rules/ckpt/run" in caplog.text


def test_a_brief_outage_is_retried_and_a_lasting_one_reported_at_every_save(
        store, tiny_data, tmp_path, monkeypatch, caplog, capsys):
    """Reading the bucket's copy at start is retried (a first read that fails, then works,
    fetches it); when every try fails, nothing is written over it, and the run says so at
    each checkpoint save and in its last lines, instead of going quiet after one warning."""
    from etils.epath import gpath

    bucket = store.bucket("outage")
    url = f"{bucket.url}/ckpt"
    bucket.emulator.write(bucket.name, "ckpt/run/wandb_run_id", b"abc123\n")
    read, failures = gpath.PosixGPath.read_bytes, []

    def flaky(self, *args, **kwargs):
        if self.name == "wandb_run_id" and len(failures) < budget[0]:
            failures.append(self)
            raise OSError("connection reset")
        return read(self, *args, **kwargs)

    monkeypatch.setattr("etils.epath.gpath.PosixGPath.read_bytes", flaky)
    monkeypatch.setattr("boost_jax.checkpointing.run_files.FETCH_DELAYS_S", (0.0, 0.0))
    budget = [1]
    (tmp_path / "brief").mkdir()
    brief = RunFiles(tmp_path / "brief", url)
    assert brief.fetch() == ["wandb_run_id"] and brief.problem is None
    budget, failures[:] = [10**6], []
    summary = run(_config(tiny_data, 2, checkpoint_every=1), tmp_path / "lasting",
                  jax.devices()[:1], checkpoint_dir=url)
    assert len(failures) == 3  # every try
    assert bucket.keys("ckpt/run/") == ["ckpt/run/wandb_run_id"]  # nothing written over it
    said = [r for r in caplog.records if "could not read the run's files" in r.getMessage()]
    assert len(said) >= 1 + 2  # at start, then at each save (steps 1 and 2)
    assert summary.mirror_problem.startswith("could not read the run's files in s3://outage")
    assert "run files: could not read the run's files in s3://outage/ckpt/run" in (
        capsys.readouterr().out)


def test_a_local_write_error_while_fetching_is_the_runs_own(store, tmp_path, monkeypatch):
    """Only the bucket's reads are retried and reported as the store's problem: a local disk
    that cannot take the fetched copy is a one-line WriteError (exit code 1 in the trainer),
    and the bucket's copy stays mirrored-to (nothing turned off)."""
    import errno
    from pathlib import Path as LocalPath

    from boost_jax.operations.disk_errors import WriteError

    bucket = store.bucket("localdisk")
    bucket.emulator.write(bucket.name, "ckpt/run/metrics.jsonl", b'{"step": 1, "loss": 1.0}\n')
    write = LocalPath.write_bytes

    def full(self, data):
        if self.name.endswith(".fetched"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, data)

    monkeypatch.setattr(LocalPath, "write_bytes", full)
    (tmp_path / "work").mkdir()
    files = RunFiles(tmp_path / "work", f"{bucket.url}/ckpt")
    with pytest.raises(WriteError, match="could not write .*metrics.jsonl.fetched: No space"):
        files.fetch()
    assert files.remote is not None and files.problem is None


def test_a_finished_run_rerun_writes_nothing_over_the_bucket(s3_run, tiny_data, tmp_path):
    """A rerun with nothing to train, from a stale workdir whose metrics end earlier, stops
    before the bucket's copy is fetched -- so it never uploads its own over it."""
    work = tmp_path / "stale"
    work.mkdir()
    (work / "metrics.jsonl").write_text('{"step": 2, "loss": 0.5}\n')
    key = f"{s3_run.prefix}/run/metrics.jsonl"
    before = s3_run.bucket.emulator.read(s3_run.bucket.name, key)
    config = _config(tiny_data, 6, model=tiny("cola", n_kv_heads=8), schedule_steps=6,
                     checkpoint_every=3)  # s3_run's
    summary = run(config, work, jax.devices()[:1], checkpoint_dir=s3_run.url)
    assert summary.start_step == summary.step == 6
    assert s3_run.bucket.emulator.read(s3_run.bucket.name, key) == before


def test_export_reads_the_checkpoint_dir_on_the_bucket(s3_run, tmp_path, capsys):
    """``boost_jax.export --checkpoint_dir=s3://...`` without a workdir: the parameters of the
    same checkpoint read from a local directory, bit for bit."""
    assert export_cli.command(None, str(tmp_path / "s3"), checkpoint_dir=s3_run.url,
                              tokenizer="none") == 0
    assert f"step 6 of {s3_run.url} as" in capsys.readouterr().out
    assert export_cli.command(None, str(tmp_path / "local"), step=6,
                              checkpoint_dir=str(s3_run.local), tokenizer="none") == 0
    (cfg, got), (_, ref) = load_export(tmp_path / "s3"), load_export(tmp_path / "local")
    assert cfg.arch == "cola"
    assert_params_equal(ref, got)  # bit for bit
    assert_params_equal(load_trained(checkpoint_dir=s3_run.url).params, got)
    assert_params_equal(load_trained(s3_run.ref).params, got)  # the resume: bit for bit
    config = (tmp_path / "s3" / "config.json").read_text()
    assert f'"checkpoint_dir": "{s3_run.url}"' in config and '"workdir"' not in config


def test_generate_reads_the_checkpoint_dir_on_the_bucket(s3_run, capsys):
    """``boost_jax.generate --checkpoint_dir=s3://...`` (an older step too): the texts of the
    same checkpoint read from a local directory."""
    texts = {}
    for where in (s3_run.url, str(s3_run.local)):
        for step in (3, 6):
            assert generate_cli.command(None, PROMPTS, step=step, max_new_tokens=6,
                                        checkpoint_dir=where) == 0
            out = capsys.readouterr()
            assert out.err == f"boost_jax.generate: {where} at step {step}\n"
            texts[where, step] = out.out
    assert texts[s3_run.url, 6] == texts[str(s3_run.local), 6]
    assert texts[s3_run.url, 3] == texts[str(s3_run.local), 3] != texts[s3_run.url, 6]
    assert texts[s3_run.url, 6].startswith("=== prompt 1, sample 1 ===\nROMEO:")


def test_only_committed_steps_of_the_bucket_count(s3_run):
    """A step written and never committed (no orbax marker) and names that are no step are
    not checkpoints; an unknown step, an empty prefix and a bad scheme are one-line errors."""
    bucket, prefix, url = s3_run.bucket, s3_run.prefix, s3_run.url
    for key in ("9/state/manifest.ocdbt", "9/meta/metadata", "run/notes.txt",
                "corrupt-2-17/state/x"):
        bucket.emulator.write(bucket.name, f"{prefix}/{key}", b"{}")
    assert checkpoint_steps(url) == [3, 6]
    config, step = trained_config(checkpoint_dir=url)
    assert step == 6 and config.train.steps == 6
    trained = load_trained(checkpoint_dir=url, step=3)
    assert (trained.step, trained.workdir, trained.source) == (3, None, url)
    with pytest.raises(ConfigError, match=rf"^--step=9: {url} has checkpoints at steps 3, 6$"):
        trained_config(None, 9, url)
    empty = f"{bucket.url}/nothing/here"
    with pytest.raises(ConfigError, match=rf"^--checkpoint_dir={empty} holds no checkpoint "
                                          rf"\(train first: python -m boost_jax.train "
                                          rf"--checkpoint_dir={empty}\)$"):
        trained_config(checkpoint_dir=empty)
    with pytest.raises(ConfigError, match=r"^checkpoints at az://c/x: az:// is not supported"):
        trained_config(checkpoint_dir="az://c/x")
    with pytest.raises(ConfigError, match=r"^give the training run: --workdir=W"):
        trained_config()


def test_the_commands_say_what_is_missing_in_one_line(s3_run, tmp_path, capsys):
    missing = tmp_path / "nope"
    assert export_cli.command(None, str(tmp_path / "o"), checkpoint_dir=str(missing)) == 2
    assert capsys.readouterr().err == (f"boost_jax.export: error: --checkpoint_dir={missing} "
                                       "does not exist\n")
    assert generate_cli.command(None, PROMPTS, checkpoint_dir=f"{s3_run.bucket.url}/none") == 2
    assert capsys.readouterr().err == (
        f"boost_jax.generate: error: --checkpoint_dir={s3_run.bucket.url}/none holds no "
        f"checkpoint (train first: python -m boost_jax.train "
        f"--checkpoint_dir={s3_run.bucket.url}/none)\n")
    assert export_cli.command(None, str(tmp_path / "o")) == 2
    assert "--workdir=RUN (or --checkpoint_dir=CKPT)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_reads_the_checkpoint_dir_on_the_bucket(s3_run):
    """``python -m boost_jax.eval --checkpoint_dir=s3://... --json`` (a subprocess, as a user
    runs it): the loss of the same checkpoint read from a local directory."""
    got = {}
    for where in (s3_run.url, str(s3_run.local)):
        out = subprocess.run([sys.executable, "-m", "boost_jax.eval", f"--checkpoint_dir={where}",
                              "--max_batches=1", "--json"], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got[where] = json.loads(out.stdout)
    s3, local = got[s3_run.url], got[str(s3_run.local)]
    assert (s3["workdir"], s3["checkpoint_dir"], s3["step"]) == (None, s3_run.url, 6)
    assert s3["loss"] == local["loss"] and s3["tokens"] == local["tokens"] == 8 * 32
