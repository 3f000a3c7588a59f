"""Held-out perplexity (boost_jax/evaluation/perplexity.py) and ``python -m boost_jax.eval``:
the number is exp of the mean token loss of the reference model on the same windows, the same
on any mesh, and every user mistake is one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import ConfigError, Parallel
from boost_jax.data.loader import eval_batches, iter_eval_batches, open_dataset
from boost_jax.evaluation.perplexity import (
    ONE_DEVICE,
    eval_config,
    evaluate_perplexity,
    fit_devices,
)
from boost_jax.models.decoder import reference_logits
from boost_jax.testing import rel_err
from boost_jax.train.trained import load_trained, trained_config

TP2_DP2 = dict(data=2, tensor=2, tp_plan="btp")


@pytest.fixture(scope="module")
def trained(tiny_run):
    return load_trained(tiny_run.workdir)


@pytest.fixture(scope="module")
def one_device(tiny_run, trained):
    """The whole eval split on one device."""
    config = eval_config(trained_config(tiny_run.workdir)[0])
    return evaluate_perplexity(trained.params, config, jax.devices()[:1])


def _reference_losses(model, params, ds, seq_len: int, n_windows: int) -> np.ndarray:
    """Next-token cross-entropy ``[n_windows, seq_len]`` of the first ``n_windows`` eval
    windows, by ``reference_logits`` (one device, no mesh)."""
    windows = ds.windows("eval", seq_len)
    inputs = np.stack([windows[i]["inputs"] for i in range(n_windows)])
    targets = np.stack([windows[i]["targets"] for i in range(n_windows)])
    logp = jax.nn.log_softmax(reference_logits(model, params, jnp.asarray(inputs)), axis=-1)
    return -np.take_along_axis(np.asarray(logp, np.float64), targets[..., None], -1)[..., 0]


def _reference_loss(model, params, ds, seq_len: int, n_windows: int) -> float:
    """Mean next-token cross-entropy of the first ``n_windows`` eval windows."""
    return float(np.mean(_reference_losses(model, params, ds, seq_len, n_windows)))


def test_perplexity_is_exp_of_the_reference_mean_loss(tiny_run, trained, one_device):
    r, t = one_device, tiny_run.config.train
    ds = open_dataset(tiny_run.config.data)
    n_windows = len(ds.windows("eval", t.seq_len))
    assert r.batches == n_windows // t.batch_size > 2  # the whole split, not eval_batches
    assert r.tokens == r.batches * t.batch_size * t.seq_len
    assert r.left_out == n_windows - r.batches * t.batch_size
    assert r.mesh == {"data": 1, "pipe": 1, "tensor": 1}
    losses = _reference_losses(trained.model, trained.params, ds, t.seq_len,
                               r.batches * t.batch_size)
    assert rel_err(r.loss, np.mean(losses)) <= 1e-5
    assert r.perplexity == pytest.approx(math.exp(np.mean(losses)), rel=1e-4)
    # the low-rank papers' definition: each batch's mean, summed, over batches + 1 (our
    # reading of CoLA's main.py evaluate_model, lines 151-175; not yet run against their code)
    batch_means = losses.reshape(r.batches, -1).mean(axis=1)
    assert rel_err(r.cola_loss, batch_means.sum() / (r.batches + 1)) <= 1e-5


def test_first_batches_are_the_trainers_eval(tiny_run, trained):
    """``max_batches=Train.eval_batches`` reproduces the trainer's final eval loss."""
    run, _ = trained_config(tiny_run.workdir)
    r = evaluate_perplexity(trained.params, eval_config(run), jax.devices()[:1], max_batches=2)
    assert r.batches == 2 and rel_err(r.loss, tiny_run.summary.eval_loss) <= 1e-6
    ds, t = open_dataset(run.data), run.train
    lazy = list(iter_eval_batches(ds, t.seq_len, t.batch_size, (2, 6), max_batches=2))
    eager = eval_batches(ds, t.seq_len, t.batch_size, 2, (2, 6))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(lazy, eager) for k in a)


def test_the_trainer_and_the_eval_command_agree_on_padded_packed_batches(packing_data,
                                                                         tmp_path):
    """Document-packed eval batches hold different numbers of real tokens (padding): the
    trainer's eval loss is the same token-weighted mean as boost_jax.eval's over the same
    batches, to the bit (one code path, train/step.py evaluate)."""
    from boost_jax.config import Config, Data, Train
    from boost_jax.testing import SINGLE, tiny
    from boost_jax.train.loop import run

    train = Train(steps=2, batch_size=8, seq_len=32, eval_batches=3, checkpoint_every=1000,
                  eval_every=1000, log_every=1000)
    config = Config(tiny("cola"), SINGLE, train, Data(path=str(packing_data),
                                                      packing="document", packing_bins=4))
    summary = run(config, tmp_path, jax.devices()[:1], checkpoint_async=False)
    trained, (saved, _) = load_trained(tmp_path), trained_config(tmp_path)
    r = evaluate_perplexity(trained.params, eval_config(saved), jax.devices()[:1],
                            max_batches=3)
    counts = [int((b["segment_ids"] > 0).sum()) for b in eval_batches(
        open_dataset(config.data), 32, 8, 3)]
    assert len(set(counts)) > 1 and r.tokens == sum(counts)  # padding differs per batch
    assert r.loss == summary.eval_loss


def test_tp2_dp2_mesh_gives_the_one_device_number(tiny_run, trained, one_device):
    config = eval_config(trained_config(tiny_run.workdir)[0], parallel=TP2_DP2)
    r = evaluate_perplexity(trained.params, config, jax.devices()[:4])
    assert r.mesh == {"data": 2, "pipe": 1, "tensor": 2}
    assert (r.tokens, r.batches) == (one_device.tokens, one_device.batches)
    assert rel_err(r.loss, one_device.loss) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(data=1, pipe=2, tensor=1, tp_plan="none"),
                                      dict(data=4, tensor=1, tp_plan="none", zero=3),
                                      dict(data=2, tensor=2, tp_plan="vanilla")],
                         ids=["pipe2", "fsdp4", "vanilla_tp2"])
def test_other_meshes_give_the_one_device_number(tiny_run, trained, one_device, parallel):
    config = eval_config(trained_config(tiny_run.workdir)[0], parallel=parallel)
    r = evaluate_perplexity(trained.params, config, jax.devices()[:config.parallel.num_devices])
    assert rel_err(r.loss, one_device.loss) <= 1e-5


@pytest.mark.slow
def test_document_packing_on_a_mesh_gives_the_one_device_number(tiny_run, trained):
    """Packed eval rows (padding masked, counts summed over the mesh): DP2 x TP2 = 1 device."""
    run, _ = trained_config(tiny_run.workdir)
    one = evaluate_perplexity(trained.params, eval_config(run, data=dict(packing="document")),
                              jax.devices()[:1])
    four = evaluate_perplexity(trained.params, eval_config(
        run, parallel=TP2_DP2, data=dict(packing="document")), jax.devices()[:4])
    assert one.left_out is None and 0 < one.tokens <= one.batches * 8 * 32
    assert (four.tokens, four.batches) == (one.tokens, one.batches)
    assert rel_err(four.loss, one.loss) <= 1e-5


def test_the_mesh_must_fit_the_devices(tiny_run):
    run, _ = trained_config(tiny_run.workdir)
    big = eval_config(run, parallel=dict(data=4, tensor=2, tp_plan="btp"))
    config, devices = fit_devices(big, explicit=False, devices=jax.devices()[:4])
    assert config.parallel == ONE_DEVICE and len(devices) == 1  # the run's mesh: one device
    with pytest.raises(ConfigError, match=r"needs 8 devices, but 4 are available"):
        fit_devices(big, explicit=True, devices=jax.devices()[:4])  # asked for: an error
    config, devices = fit_devices(eval_config(run, parallel=TP2_DP2), True, jax.devices())
    assert config.parallel.num_devices == len(devices) == 4


def test_user_mistakes_are_config_errors(tiny_run, trained, tmp_path):
    run, step = trained_config(tiny_run.workdir)
    assert step == 4
    with pytest.raises(ConfigError, match="does not exist"):
        trained_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        trained_config(tmp_path)
    with pytest.raises(ConfigError, match=r"--step=3: .* checkpoints at steps 4"):
        trained_config(tiny_run.workdir, 3)
    with pytest.raises(ConfigError, match="not enough for one batch of --batch_size=4096"):
        evaluate_perplexity(trained.params, eval_config(run, batch_size=4096),
                            jax.devices()[:1])
    with pytest.raises(ConfigError, match="no prepared dataset there"):
        evaluate_perplexity(trained.params, eval_config(run, data_path=str(tmp_path)),
                            jax.devices()[:1])
    with pytest.raises(ConfigError, match="--max_batches=0 must be a positive integer"):
        evaluate_perplexity(trained.params, eval_config(run), jax.devices()[:1], max_batches=0)
    with pytest.raises(ConfigError, match="Parallel.tensor=3"):
        eval_config(run, parallel=dict(tensor=3, tp_plan="btp"))
    assert eval_config(run, parallel=dict(data=2)).parallel == Parallel(data=2, tensor=1,
                                                                        tp_plan="none")


# --- the command ----------------------------------------------------------------------------
def _eval(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "boost_jax.eval", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def _error_line(out: subprocess.CompletedProcess) -> str:
    """The last stderr line of a failed command: ``boost_jax.eval: error: ...``, and no
    traceback (status lines may precede it)."""
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("boost_jax.eval: error: "), out.stderr
    return line


def test_command_prints_the_perplexity_as_json(tiny_run, trained):
    run, _ = trained_config(tiny_run.workdir)
    out = _eval(f"--workdir={tiny_run.workdir}", "--max_batches=3", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert (got["step"], got["batches"], got["tokens"]) == (4, 3, 3 * 8 * 32)
    assert got["mesh"] == {"data": 1, "pipe": 1, "tensor": 1}  # the run's mesh
    assert got["eval_split"] == ("tail of the training shards (--eval_fraction=0.05; no "
                                 "validation input)")  # tiny_data has no validation input
    ref = evaluate_perplexity(trained.params, eval_config(run), jax.devices()[:1], 3)
    assert rel_err(got["loss"], ref.loss) <= 1e-5
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))


def test_command_errors_are_one_line(tiny_run, tmp_path):
    line = _error_line(_eval(f"--workdir={tmp_path / 'nope'}"))
    assert line.endswith(f"--workdir={tmp_path / 'nope'} does not exist")
    # without lm-eval, --tasks names the extra to install
    block = ("import runpy, sys; sys.modules['lm_eval'] = None; "
             "sys.argv = ['boost_jax.eval', *sys.argv[1:]]; "
             "runpy.run_module('boost_jax.eval', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", block, f"--workdir={tiny_run.workdir}",
                          "--tasks=hellaswag"], capture_output=True, text=True, timeout=300)
    assert _error_line(out).endswith('--tasks needs lm-eval: pip install -e ".[eval]"')
