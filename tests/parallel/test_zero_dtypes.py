"""The dtypes of the data-parallel collectives (parallel/zero.py): FSDP gathers the parameters
in the compute dtype, every gradient reduction sums in ``Parallel.reduce_dtype`` -- in the
compiled CPU step (read by analysis/hlo.py), in the program lowered for CUDA
(analysis/lowered.py), and in bytes per step against analysis/comm.py's formula.

XLA:CPU computes bf16 collectives in f32: the compiled HLO's bf16 all-gathers are f32 gathers
of a value converted from bf16 and its bf16 reduce-scatters have a ``*_promoted`` reduction;
the HLO reader counts both at 2 bytes per element (what a GPU sends). The CUDA-lowered program
holds the dtypes as JAX wrote them.
"""

import collections

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from boost_jax.analysis import lowered
from boost_jax.analysis.comm import data_parallel_bytes
from boost_jax.analysis.hlo import collectives
from boost_jax.compiled.step_report import build_report, compile_step
from boost_jax.config import Config, ConfigError, Data, Parallel, Train
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import SINGLE, loss_and_grads, norm_rel_err, rel_err, tiny, tree_rel_err

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

BATCH, SEQ = 8, 16
SHORT = {"float32": "f32", "bfloat16": "bf16"}


def test_reduce_dtype_is_checked():
    with pytest.raises(ConfigError, match=r"^Parallel.reduce_dtype='float16' is not one of "
                       r"float32, bfloat16"):
        Parallel(reduce_dtype="float16")


@pytest.mark.parametrize("options", [
    dict(grad_accum=2),
    pytest.param(dict(reduce_dtype="bfloat16"), marks=pytest.mark.slow)], ids=str)
def test_bf16_fsdp_matches_single_device_bf16(options):
    """bf16 FSDP (parameters gathered in bf16, gradients reduce-scattered in fp32 or bf16)
    computes the single-device bf16 model's loss and gradients, within the bf16 tolerances of
    tests/parallel/test_plans.py (loss 2e-2, ``||a - b|| / ||b|| <= 4e-2`` per gradient, 512
    tokens; 0.018 measured on jax 0.10.2; that module says why later XLA:CPUs need 4e-2)."""
    model = tiny("cola")
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs, targets = (jax.random.randint(jax.random.key(i), (BATCH, 4 * SEQ), 0,
                                          model.vocab_size) for i in (1, 2))
    ref_loss, ref_grads = loss_and_grads(model, SINGLE, params, inputs, targets, "bfloat16")
    parallel = Parallel(data=2, tensor=4, zero=3, **options)
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets, "bfloat16")
    assert rel_err(loss, ref_loss) <= 2e-2
    assert tree_rel_err(grads, ref_grads, norm_rel_err) <= 4e-2


@pytest.mark.parametrize("zero, reduce_dtype, dtype", [
    (3, "float32", "bfloat16"), (1, "bfloat16", "float32")], ids=str)
def test_data_axis_dtypes_and_bytes_in_the_compiled_step(zero, reduce_dtype, dtype):
    """Compiled for CPU: every data-axis all-gather carries the compute dtype (FSDP) or the
    fp32 updated slices (ZeRO-1), every data-axis reduce-scatter ``reduce_dtype``, and the
    data axis moves the bytes of the formula (and the elements of every axis's)."""
    parallel = Parallel(data=2, tensor=4, zero=zero, reduce_dtype=reduce_dtype)
    config = Config(tiny("cola"), parallel, Train(batch_size=BATCH, seq_len=SEQ, dtype=dtype),
                    Data())
    model, _, compiled = compile_step(config)
    mesh = model.mesh
    colls = collectives(compiled.as_text(), tuple(mesh.devices.shape), tuple(mesh.axis_names))
    dtypes = {(c.op, c.dtype) for c in colls if c.axes == ("data",) and c.op != "all-reduce"}
    assert dtypes == {("all-gather", SHORT[dtype] if zero == 3 else "f32"),
                      ("reduce-scatter", SHORT[reduce_dtype])}
    rep = build_report(config, compiled=compiled, mesh=mesh)
    assert rep["check"] == []
    formula = data_parallel_bytes(config.model, config.parallel, dtype)["data"]
    assert rep["per_axis"]["data"]["bytes"] == formula


@pytest.mark.parametrize("zero, reduce_dtype", [(3, "float32"), (3, "bfloat16"),
                                                (1, "bfloat16"), (0, "bfloat16")], ids=str)
def test_bf16_step_lowered_for_cuda(zero, reduce_dtype):
    """The bf16 train step lowered for CUDA, every collective as JAX wrote it (loop bodies
    once): FSDP gathers each layer's parameters in bf16 (in the forward loop and again by the
    recomputation) and the non-layer ones once; every gradient is reduced in ``reduce_dtype``
    (FSDP's and ZeRO-1's reduce-scatters, stage 0's all-reduces; a layer's in the layer loop,
once per layer parameter); ZeRO-1 gathers the fp32
    updated slices; each op moves its parameter's bytes in that dtype. btp's final norm
    all-gathers its bf16 output over ``tensor`` (as every tensor-axis gather and
    reduce-scatter does)."""
    from boost_jax.operations.signals import STOP_SIGNALS
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import STOP_SPEC, abstract_batch, abstract_state, make_train_step

    parallel = Parallel(data=2, tensor=4, zero=zero, reduce_dtype=reduce_dtype)
    model = ShardedModel(tiny("cola"), parallel, make_mesh(parallel), jnp.bfloat16)
    opt = make_optimizer(Train())
    stop = jax.ShapeDtypeStruct((model.mesh.size, len(STOP_SIGNALS)), jnp.float32,
                                sharding=NamedSharding(model.mesh, STOP_SPEC))
    ops = lowered.collectives(lowered.cuda_ops(
        make_train_step(model, opt), abstract_state(model, opt),
        abstract_batch(model, BATCH, SEQ), stop))
    got = collections.Counter((o.kind, o.results[0].dtype, o.bytes) for o in ops
                              if o.axes == ("data",) and o.results[0].shape != ())  # not the loss
    layout, n_layers = model.layout, model.cfg.n_layers
    red = SHORT[reduce_dtype], jnp.dtype(reduce_dtype).itemsize
    expected = collections.Counter()
    for lf in layout.items():
        assert layout.sharded(lf) or zero == 0  # every tiny parameter has a zero dim
        if zero == 3:
            per_op = layout.local_size(lf) // (n_layers if lf.layer_dims else 1)
            gathers = 2 if lf.layer_dims else 1  # the layer loop, its recomputation
            expected[("all_gather", "bf16", 2 * per_op)] += gathers
        else:  # without accumulation each layer's gradient is reduced in the loop
            if zero == 1:
                expected[("all_gather", "f32", 4 * layout.local_size(lf))] += 1
            per_op = layout.local_size(lf) // (n_layers if layout.reduced_in_loop(lf) else 1)
        kind = "reduce_scatter" if zero else "all_reduce"
        expected[(kind, red[0], red[1] * per_op)] += 1
    assert got == expected
    tensor = {(o.kind, o.results[0].dtype) for o in ops if o.axes == ("tensor",)
              and o.kind in ("all_gather", "reduce_scatter")}
    assert tensor == {("all_gather", "bf16"), ("reduce_scatter", "bf16")}
