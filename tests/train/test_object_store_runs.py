"""A run whose checkpoints are on an object store (``--checkpoint_dir=s3://...``), used as a
user does: its checkpoints read back by ``boost_jax.export`` and ``boost_jax.generate`` from
the bucket (no local workdir), equal to the same checkpoint read from a local directory.

One tiny training run on moto's S3 server (started here: tests/train/test_object_store.py's
:func:`emulated`), shared by the module's tests."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from boost_jax.commands import export as export_cli
from boost_jax.commands import generate as generate_cli
from boost_jax.errors import ConfigError
from boost_jax.interop.export import load_export
from boost_jax.testing import tiny
from boost_jax.train.loop import run
from boost_jax.train.trained import checkpoint_steps, load_trained, trained_config
from tests.interop.test_export import assert_params_equal
from tests.train.test_object_store import _Bucket, _Emulator, emulated
from tests.train.test_trainer import _config

PROMPTS = ["ROMEO:", "The king"]


@dataclasses.dataclass
class S3Run:
    store: _Emulator
    bucket: _Bucket
    prefix: str  # the checkpoints' key prefix in the bucket
    url: str  # --checkpoint_dir
    local: Path  # the same checkpoints, downloaded to a local directory


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
    """Tiny CoLA trained 6 steps on one device, checkpoints at 3 and 6 in the bucket only;
    then downloaded to a local directory."""
    bucket = store.bucket("runs")
    prefix = "team/run1/checkpoints"
    url = f"{bucket.url}/{prefix}"
    root = tmp_path_factory.mktemp("s3_run")
    config = _config(tiny_data, 6, model=tiny("cola", n_kv_heads=8), schedule_steps=6,
                     checkpoint_every=3)  # (CoLA's own layout has no grouped-query attention)
    run(config, root / "work", jax.devices()[:1], checkpoint_async=False, checkpoint_dir=url)
    assert bucket.committed(prefix) == [3, 6] and not (root / "work" / "checkpoints").exists()
    _download(bucket, prefix, root / "local")
    return S3Run(store, bucket, prefix, url, root / "local")


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
