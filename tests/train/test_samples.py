"""``Train.sample_every``: greedy samples of the current parameters, logged while training."""

import contextlib
import io
import json
from pathlib import Path

import jax
import pytest

from boost_jax.config import Config, Data, Parallel, Train
from boost_jax.models.decode import generate
from boost_jax.testing import SINGLE, tiny
from boost_jax.train.loop import run
from boost_jax.train.trained import load_trained

SAMPLE_TOKENS = 5


def train_with_samples(data: Path, workdir: Path, parallel: Parallel = SINGLE, model=None,
                       devices=None) -> str:
    """Train 4 tiny steps in ``workdir`` (checkpoints at 2 and 4, samples at 2 and 4) unless
    done already; returns what the run printed."""
    log = workdir / "stdout.txt"
    if log.exists():
        return log.read_text()
    train = Train(steps=4, batch_size=8, seq_len=32, log_every=1000, eval_batches=0,
                  checkpoint_every=2, sample_every=2, sample_tokens=SAMPLE_TOKENS)
    config = Config(model or tiny("cola"), parallel, train, Data(path=str(data)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(config, workdir, devices or jax.devices()[:1], checkpoint_async=False)
    log.write_text(out.getvalue())
    return out.getvalue()


@pytest.fixture(scope="session")
def sampled_run(tiny_data, tmp_path_factory) -> Path:
    """One tiny trained workdir with logged samples, shared by the generation tests."""
    workdir = tmp_path_factory.getbasetemp() / "sampled_run"
    train_with_samples(tiny_data, workdir)
    return workdir


def logged_samples(workdir: Path) -> dict[int, list[str]]:
    rows = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["samples"] for r in rows if "samples" in r}


def checkpoint_samples(workdir: Path, step: int) -> list[str]:
    """Greedy texts of ``Train.sample_prompts`` from checkpoint ``step``."""
    trained = load_trained(workdir, step)
    tok = trained.tokenizer()
    prompts = tok.encode_batch(list(trained.config.train.sample_prompts))
    new = generate(trained.model, trained.params, prompts, SAMPLE_TOKENS, stop_ids=[tok.eos_id])
    return [tok.decode(p + n) for p, n in zip(prompts, new)]


def test_samples_are_logged_every_sample_every_steps_and_at_the_end(sampled_run):
    """At steps 2 and 4 (the end): a metrics line, TensorBoard text and a stdout line per
    prompt, each the greedy continuation of the parameters of that step."""
    samples = logged_samples(sampled_run)
    assert sorted(samples) == [2, 4]
    for step, texts in samples.items():
        assert texts[0].startswith("ROMEO:") and texts[1].startswith("The king")
        assert texts == checkpoint_samples(sampled_run, step)
    printed = (sampled_run / "stdout.txt").read_text()
    assert f"sample at step 4: {samples[4][0]!r}" in printed
    (events,) = (sampled_run / "tensorboard").glob("events.out.tfevents.*")
    assert samples[4][1].encode() in events.read_bytes()
    losses = [r for r in map(json.loads, (sampled_run / "metrics.jsonl").read_text()
                             .splitlines()) if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4]


@pytest.mark.slow
def test_samples_gather_sharded_parameters(tiny_data, tmp_path):
    """A data x pipe x tensor mesh, circular pipeline, ZeRO-1: the logged samples are those of
    the checkpoint (the parameters gathered to the canonical layout first)."""
    parallel = Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", pipeline_schedule="circular",
                        pipeline_repeats=2, microbatches=2, zero=1)
    train_with_samples(tiny_data, tmp_path, parallel, tiny("cola", n_layers=4), jax.devices())
    samples = logged_samples(tmp_path)
    assert sorted(samples) == [2, 4]
    assert all(texts == checkpoint_samples(tmp_path, step) for step, texts in samples.items())
