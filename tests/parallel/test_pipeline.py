"""Pipeline parallelism (GPipe, circular) x data x tensor parallelism against the single-device
model: loss and every gradient; what crosses the pipe axis."""

import functools

import jax
import pytest

from boost_jax.config import Config, Data, Parallel, Train
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import SINGLE, loss_and_grads, rel_err, tiny, tree_rel_err
from boost_jax.tools.comm_report import build_report

PLANS = {"cola": "btp", "dense": "fullrank"}


@functools.cache
def _reference(arch):
    model = tiny(arch, n_layers=4)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs = jax.random.randint(jax.random.key(1), (8, 16), 0, model.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (8, 16), 0, model.vocab_size)
    return model, params, inputs, targets, loss_and_grads(model, SINGLE, params, inputs, targets)


def _check(arch, mesh, schedule, repeats, microbatches, remat="none", **options):
    model, params, inputs, targets, (ref_loss, ref_grads) = _reference(arch)
    data, pipe, tensor = mesh
    parallel = Parallel(data=data, pipe=pipe, tensor=tensor, tp_plan=PLANS[arch],
                        pipeline_schedule=schedule, pipeline_repeats=repeats,
                        microbatches=microbatches, remat=remat, **options)
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert tree_rel_err(grads, ref_grads) <= 1e-5


def _cases():  # (data, pipe, tensor), schedule, repeats, microbatches; tiny has 4 layers
    for mesh in [(2, 2, 2), (1, 4, 2)]:
        for m in (1, 2, 4):
            yield mesh, "gpipe", 1, m
        repeats = 4 // mesh[1]
        for m in (2, 4) if repeats > 1 else (4,):
            if m >= mesh[1]:
                yield mesh, "circular", repeats, m


CASES = [(arch, *case) for arch in PLANS for case in _cases()]
DEFAULT = [("cola", (2, 2, 2), "gpipe", 1, 2), ("cola", (1, 4, 2), "gpipe", 1, 4),
           ("cola", (2, 2, 2), "circular", 2, 2), ("cola", (1, 4, 2), "gpipe", 1, 1),
           ("dense", (2, 2, 2), "gpipe", 1, 4), ("dense", (1, 4, 2), "circular", 1, 4),
           ("dense", (2, 2, 2), "circular", 2, 4)]


@pytest.mark.parametrize("arch, mesh, schedule, repeats, microbatches", DEFAULT)
def test_pipeline_matches_single_device(arch, mesh, schedule, repeats, microbatches):
    _check(arch, mesh, schedule, repeats, microbatches)


@pytest.mark.parametrize("remat", ["lowrank", "full"])
def test_remat_inside_stages(remat):
    _check("cola", (2, 2, 2), "circular", 2, 2, remat)


def test_pipeline_with_zero1_and_accumulation():
    """Two accumulated pipeline passes, gradients reduce-scattered over data (and the
    embedding's all-reduced over pipe) -- still the single-device gradients."""
    _check("cola", (2, 2, 2), "gpipe", 1, 2, zero=1, grad_accum=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch, mesh, schedule, repeats, microbatches", CASES)
def test_pipeline_full_matrix(arch, mesh, schedule, repeats, microbatches):
    _check(arch, mesh, schedule, repeats, microbatches)


@functools.cache
def _report(arch, **parallel):
    model = tiny(arch, n_layers=4)
    return build_report(Config(model, Parallel(**parallel), Train(batch_size=8, seq_len=16),
                               Data()))


@pytest.mark.parametrize("arch", list(PLANS))
def test_pipe_axis_moves_the_residual_shard(arch):
    """One permute per iteration each way, of a microbatch's residual: T d / p under btp."""
    m = tiny(arch)
    rep = _report(arch, data=2, pipe=2, tensor=2, tp_plan=PLANS[arch], microbatches=2)
    assert rep["check"] == []
    permutes = [r for r in rep["collectives"] if r["op"] == "collective-permute"]
    assert {r["axes"] for r in permutes} == {"pipe"}
    tokens = 8 // 2 // 2 * 16  # per microbatch
    d_local = m.d_model // 2 if arch == "cola" else m.d_model
    assert {tuple(r["shape"]) for r in permutes} == {(8 // 2 // 2, 16, d_local)}
    assert {r["bytes"] for r in permutes} == {tokens * d_local * 4}
    iterations = 2 + 2 - 1
    assert sum(r["runs"] * r["instances"] for r in permutes) == 2 * iterations
