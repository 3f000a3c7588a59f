"""Every tensor-parallel plan against the single-device model: loss and every gradient, on the
same global weights and batch.

fp32: ``max|a - b| / max|b| <= 1e-5`` for the loss and every parameter gradient. bf16 (against
the single-device model in bf16): ``||a - b|| / ||b|| <= 2e-2`` per gradient, on 512 tokens --
two bf16 computations of one function differ by rounding of bf16's own size (single-device bf16
is itself 1-2% from fp32 here), which the norm-wise error measures without letting one rounded
element of a sparse embedding gradient decide.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from boost_jax.config import Parallel
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import SINGLE, loss_and_grads, norm_rel_err, rel_err, tiny, tree_rel_err

BATCH, SEQ = 8, 16


#: LaX's crossing (gate, latent norm) unless a case names one: the dense gate with the norm
CROSSING = ("dense", True)


def _model(arch, crossing=CROSSING):
    gate, norm = crossing
    return tiny(arch, lax_gate=gate, lax_latent_norm=norm, n_layers=3 if arch == "lax" else 2)


@functools.cache
def _problem(arch, dtype="float32", crossing=CROSSING):
    model = _model(arch, crossing)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    seq = SEQ if dtype == "float32" else 4 * SEQ
    inputs = jax.random.randint(jax.random.key(1), (BATCH, seq), 0, model.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (BATCH, seq), 0, model.vocab_size)
    ref = loss_and_grads(model, SINGLE, params, inputs, targets, dtype)
    return model, params, inputs, targets, ref


def _check(arch, plan, data, tensor, dtype="float32", gspmd=False, crossing=CROSSING,
           **options):
    model, params, inputs, targets, (ref_loss, ref_grads) = _problem(arch, dtype, crossing)
    parallel = Parallel(data=data, tensor=tensor, tp_plan=plan, **options)
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets, dtype, gspmd)
    tol, metric = (1e-5, rel_err) if dtype == "float32" else (2e-2, norm_rel_err)
    assert rel_err(loss, ref_loss) <= tol, (loss, ref_loss)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert tree_rel_err(grads, ref_grads, metric) <= tol


# a representative matrix: every arch under every applicable plan, both norms, grouping on
# and off, TP=2, TP=4 and DP x TP = 2 x 4 (GQA throughout: 8 heads, 4 KV heads)
REPRESENTATIVE = [
    ("cola", "btp", 2, 4, dict(rmsnorm="online")),
    ("cola", "btp", 1, 2, dict(rmsnorm="sync")),
    ("svd", "btp", 1, 4, dict(rmsnorm="online", grouping=False)),
    ("lax", "btp", 2, 4, dict(rmsnorm="online")),
    ("lax", "btp", 1, 2, dict(rmsnorm="sync", grouping=False)),
    ("cola", "vanilla", 2, 4, {}),
    ("svd", "vanilla", 1, 2, dict(grouping=False)),
    ("lax", "vanilla", 1, 4, {}),
    ("dense", "fullrank", 2, 4, {}),
    ("dense", "fullrank", 1, 2, dict(grouping=False)),
]


@pytest.mark.parametrize("arch, plan, data, tensor, options", REPRESENTATIVE,
                         ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_plan_matches_single_device(arch, plan, data, tensor, options):
    _check(arch, plan, data, tensor, **options)


@pytest.mark.parametrize("crossing, data, tensor, options", [
    (("kronecker", True), 2, 4, {}),  # the LaX authors' crossing (the default)
    (("identity", True), 1, 2, dict(grouping=False)),
    (("identity", False), 1, 4, {}),  # elementwise: crossed on the rank slices
], ids=str)
def test_vanilla_lax_crossings_match_single_device(crossing, data, tensor, options):
    """Vanilla splits LaX's latents on the rank: every crossing (the dense gate with the norm
    is in the matrix above) matches one device -- the gathered latent crosses whole."""
    _check("lax", "vanilla", data, tensor, crossing=crossing, **options)


@pytest.mark.parametrize("arch, plan", [
    ("cola", "btp"), pytest.param("dense", "fullrank", marks=pytest.mark.slow),
    pytest.param("cola", "vanilla", marks=pytest.mark.slow)])
def test_gspmd_baseline_matches_single_device(arch, plan):
    """The benchmarks' GSPMD rows (plain jit, the plan's parameter shardings) compute the same
    loss and gradients."""
    _check(arch, plan, 2, 4, gspmd=True)


@pytest.mark.parametrize("arch, plan, options", [
    ("cola", "btp", {}), ("cola", "btp", dict(norm_payload="float32")),
    ("cola", "vanilla", {}), ("dense", "fullrank", {})])
def test_bf16_matches_single_device_bf16(arch, plan, options):
    _check(arch, plan, 2, 4, dtype="bfloat16", **options)


def _full_matrix():
    plans = {"dense": ["fullrank"], "svd": ["btp", "vanilla"], "cola": ["btp", "vanilla"],
             "lax": ["btp", "vanilla"]}
    for arch, arch_plans in plans.items():
        for plan, (data, tensor), grouping in itertools.product(
                arch_plans, [(1, 2), (1, 4), (2, 4)], [True, False]):
            for norm in (["online", "sync"] if plan == "btp" else ["online"]):
                yield arch, plan, data, tensor, dict(rmsnorm=norm, grouping=grouping)


@pytest.mark.slow
@pytest.mark.parametrize("arch, plan, data, tensor, options", list(_full_matrix()))
def test_full_matrix(arch, plan, data, tensor, options):
    _check(arch, plan, data, tensor, **options)


def test_logits_are_vocab_sharded_and_equal():
    from boost_jax.models.decoder import reference_logits
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel

    model, params, inputs, _, _ = _problem("cola")
    parallel = Parallel(data=2, tensor=4, tp_plan="btp")
    sharded = ShardedModel(model, parallel, make_mesh(parallel))
    logits = jax.jit(sharded.logits)(jax.device_put(params, sharded.param_shardings),
                                     jax.device_put(inputs, sharded.batch_sharding))
    assert logits.sharding.spec[2] == "tensor"  # no device holds the full vocabulary
    assert rel_err(logits, reference_logits(model, params, jnp.asarray(inputs))) < 1e-5
