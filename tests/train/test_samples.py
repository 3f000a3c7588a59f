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


def test_bf16_samples_cast_the_weights_once_on_the_host(tiny_data, monkeypatch):
    """``Train.dtype='bfloat16'``: the host's fp32 parameters are cast to bf16 before they go
    to the device, so the prefill and every decode step take bf16 weights -- no fp32 weight
    is an input of the decode step, and no weight matrix is cast inside it."""
    import jax.numpy as jnp
    import numpy as np

    from boost_jax.models import decode
    from boost_jax.models.decoder import abstract_model
    from boost_jax.models.init import init_params
    from boost_jax.train.samples import Sampler

    cfg = tiny("cola")
    params = jax.device_get(init_params(abstract_model(cfg)[1], seed=0))
    assert {np.asarray(p).dtype for p in jax.tree.leaves(params)} == {np.dtype("float32")}
    seen = {}
    real_prefill, real_step = decode.prefill, decode.decode_step

    def prefill(cfg, params, *args):
        seen["prefill"] = {p.dtype for p in jax.tree.leaves(params)}
        return real_prefill(cfg, params, *args)

    def decode_step(cfg, params, *args, **kwargs):
        seen["decode"] = {p.dtype for p in jax.tree.leaves(params)}
        seen["jaxpr"] = real_step.trace(cfg, params, *args, **kwargs).jaxpr
        return real_step(cfg, params, *args, **kwargs)

    monkeypatch.setattr(decode, "prefill", prefill)
    monkeypatch.setattr(decode, "decode_step", decode_step)
    train = Train(dtype="bfloat16", sample_every=1, sample_tokens=3)
    texts = Sampler(train, tiny_data).texts(cfg, params)
    assert texts[0].startswith("ROMEO:") and texts[1].startswith("The king")
    assert seen["prefill"] == seen["decode"] == {jnp.dtype(jnp.bfloat16)}
    jaxpr = seen["jaxpr"].jaxpr
    n_weights = len(jax.tree.leaves(params))
    weights = jaxpr.invars[:n_weights]  # params come first (cfg is static)
    assert {v.aval.dtype for v in weights} == {jnp.dtype(jnp.bfloat16)}
    matrices = [v for v in weights if v.aval.ndim >= 2]  # (norm gains may be read in fp32)
    upcasts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
               and any(v in matrices for v in e.invars)]
    assert matrices and not upcasts


def test_sampling_a_model_too_large_for_one_device_is_refused_before_anything_is_built(
        tiny_data, tmp_path, capsys, monkeypatch):
    """``Train.sample_every`` with the 7b preset (2.7 B parameters, above MAX_SAMPLE_PARAMS):
    exit code 2 and one line, before the mesh, the model or a step is built."""
    from boost_jax.train import loop
    from tests.train.test_cli import _train_main

    def built(*args, **kwargs):
        raise AssertionError("the trainer was set up before the sample size was checked")

    monkeypatch.setattr(loop, "make_mesh", built)
    code, _, err = _train_main(capsys, tmp_path / "run", [
        "Model.size='7b'", f"Data.path='{tiny_data}'", "Train.sample_every=10"])
    assert code == 2
    (line,) = [line for line in err.splitlines() if "error" in line]  # one line
    assert line.startswith("boost_jax.train: error: Train.sample_every=10: Model.size='7b' "
                           "(cola) has 2,689,863,680 parameters, more than the 2,000,000,000")
    assert "python -m boost_jax.generate" in line
