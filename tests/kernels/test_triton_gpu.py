"""The Triton kernels through jax-triton on a GPU (marker `gpu`; skipped with the reason
elsewhere): each op against its XLA version on fresh random inputs, forward and gradients,
fp32 to 1e-5 and bf16 to 1e-2; and a BTP TP=1 training step with ``Parallel.kernels='triton'``
equal to ``'xla'`` to bf16 tolerance. Also: jax-triton's ``triton_call`` takes what ops.py's calls
were checked against on CPU (tests/kernels/test_triton_call.py)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels import ops
from boost_jax.testing import norm_rel_err, tiny, tree_rel_err
from tests.gpu import gpu_device, needs_jax_triton
from tests.kernels.triton_cpu import triton_call_0_3_1

pytestmark = pytest.mark.gpu
EPS = 1e-6
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def gpu():
    device = gpu_device()
    needs_jax_triton()
    return device


def test_jax_triton_takes_the_pinned_signature():
    """The installed jax-triton's ``triton_call`` has jax-triton 0.3.1's parameters (kinds and
    defaults), the signature the CPU tests bind ops.py's calls to."""
    needs_jax_triton()
    import jax_triton

    params = lambda f: [(p.name, p.kind, p.default)  # noqa: E731
                        for p in inspect.signature(f).parameters.values()]
    assert params(jax_triton.triton_call) == params(triton_call_0_3_1)


def fresh(shape, dtype, positive_last=False):
    x = np.random.default_rng().standard_normal(shape).astype(np.float32)  # fresh each run
    if positive_last:
        x[..., -1] = np.abs(x[..., -1]) * shape[-1] + 1.0
    return jnp.asarray(x).astype(dtype)


def run_both(fn, *args):
    return [jax.jit(lambda *a, impl=impl: fn(impl, *a))(*args) for impl in ("triton", "xla")]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_local(gpu, dtype):
    with jax.default_device(gpu):
        x, gamma, w = fresh((4, 333, 1024), dtype), fresh((1024,), dtype), fresh((4, 333, 1024),
                                                                               jnp.float32)

        def loss(impl, x, gamma):
            x_hat, s, rho = ops.norm_local(x, gamma, EPS, impl)
            return jnp.sum(w * x_hat.astype(jnp.float32)) + jnp.sum(jnp.sqrt(s)), (x_hat, s, rho)

        def fn(impl, x, gamma):
            return jax.value_and_grad(lambda *a: loss(impl, *a), (0, 1), has_aux=True)(x, gamma)

        tri, xla = run_both(fn, x, gamma)
    assert tree_rel_err(tri, xla, norm_rel_err) <= TOL[dtype]


@pytest.mark.parametrize("act", ["silu", "identity"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_recover(gpu, dtype, act):
    with jax.default_device(gpu):
        payload, w = fresh((4, 333, 3 * 256 + 1), dtype, True), fresh((4, 333, 768), jnp.float32)

        def fn(impl, p):
            return jax.value_and_grad(lambda q: jnp.sum(
                w * ops.recover(q, 2048, EPS, act, dtype, impl).astype(jnp.float32)))(p)

        tri, xla = run_both(fn, payload)
    assert tree_rel_err(tri, xla, norm_rel_err) <= TOL[dtype]


def test_btp_step_with_kernels_equals_xla(gpu, monkeypatch):
    """Loss and every gradient of a bf16 BTP TP=1 step, Triton kernels vs XLA."""
    from boost_jax.config import Parallel
    from boost_jax.models.decoder import abstract_model
    from boost_jax.models.init import init_params
    from boost_jax.parallel import plans
    from boost_jax.testing import loss_and_grads

    model = tiny("cola")
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs = np.random.default_rng(1).integers(0, model.vocab_size, (4, 64), dtype=np.int32)
    targets = np.roll(inputs, -1, axis=1)
    results = {}
    for impl in ("triton", "xla"):
        monkeypatch.setattr(plans, "resolve_kernels", lambda choice, platform=None, impl=impl: impl)
        # the Triton recovery reads the statistic as the payload's last element: not in lanes
        parallel = Parallel(data=1, tensor=1, tp_plan="btp", norm_payload="compute")
        results[impl] = loss_and_grads(model, parallel, params, inputs, targets, "bfloat16",
                                       devices=[gpu])
    assert tree_rel_err(results["triton"], results["xla"], norm_rel_err) <= 1e-2
