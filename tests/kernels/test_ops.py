"""The kernels' JAX ops on XLA: written-out derivatives == JAX's autodiff of the same math, and
the ``Parallel.kernels`` choice (the Triton sources are checked in tests/kernels/
test_triton_interpreter.py, the GPU path in tests/kernels/test_triton_gpu.py)."""

import jax
import jax.numpy as jnp
import pytest

from boost_jax import gpu_verified, kernels
from boost_jax.config import ConfigError
from boost_jax.kernels import ops, resolve, triton_available
from boost_jax.kernels import reference as ref
from boost_jax.testing import rel_err

EPS = 1e-6


def inputs(key: int, shape, stat: bool = False):
    x = jax.random.normal(jax.random.PRNGKey(key), shape)
    if stat:  # a positive sum of squares in the last column, as a payload carries
        x = x.at[..., -1].set(jnp.abs(x[..., -1]) * shape[-1] + 1.0)
    return x


def autodiff_norm(x, gamma):
    """The local pass as parallel/online_rmsnorm.py writes it (rho a constant)."""
    s = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    rho = jax.lax.stop_gradient(jnp.sqrt(s / x.shape[-1] + EPS))
    return x / rho * gamma, s, rho


def test_norm_local_matches_autodiff():
    x, gamma = inputs(0, (2, 6, 40)), 1.0 + 0.1 * inputs(1, (40,))
    w = inputs(2, (2, 6, 40))

    def loss(fn, x, gamma):
        x_hat, s, rho = fn(x, gamma)
        return jnp.sum(w * x_hat) + jnp.sum(jnp.sqrt(s)) + jnp.sum(rho)

    ours = jax.value_and_grad(lambda *a: loss(lambda x, g: ops.norm_local(x, g, EPS), *a),
                              (0, 1))(x, gamma)
    theirs = jax.value_and_grad(lambda *a: loss(autodiff_norm, *a), (0, 1))(x, gamma)
    assert rel_err(ours[0], theirs[0]) <= 1e-6
    for a, b in zip(ours[1], theirs[1]):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("act", ref.ACTIVATIONS)
def test_recover_matches_autodiff(act):
    payload, w = inputs(3, (2, 6, 3 * 8 + 1), stat=True), inputs(4, (2, 6, 24))
    d = 64

    def direct(p):
        z = p[..., :-1] / jnp.sqrt(p[..., -1:] / d + EPS)
        return ref.activate(z, act)

    def loss(fn, p):
        return jnp.sum(w * fn(p))

    ours = jax.value_and_grad(lambda p: loss(
        lambda q: ops.recover(q, d, EPS, act, jnp.float32), p))(payload)
    theirs = jax.value_and_grad(lambda p: loss(direct, p))(payload)
    assert rel_err(ours[0], theirs[0]) <= 1e-6
    assert rel_err(ours[1], theirs[1]) <= 1e-5


def test_recover_keeps_dtype_and_rejects_unknown_activation():
    payload = inputs(5, (3, 9), stat=True).astype(jnp.bfloat16)
    assert ops.recover(payload, 16, EPS, "silu", jnp.bfloat16).dtype == jnp.bfloat16
    grad = jax.grad(lambda p: jnp.sum(ops.recover(p, 16, EPS, "silu", jnp.bfloat16)
                                      .astype(jnp.float32)))(payload)
    assert grad.dtype == jnp.bfloat16 and grad.shape == payload.shape
    with pytest.raises(ValueError, match="act='gelu'"):
        ops.recover(payload, 16, EPS, "gelu", jnp.float32)


def test_kernel_choice_on_cpu():
    assert not triton_available()
    assert resolve("auto") == "xla" and resolve("xla") == "xla"
    with pytest.raises(ConfigError, match="Parallel.kernels='triton' needs a GPU and jax-triton"):
        resolve("triton")
    with pytest.raises(ConfigError, match="Parallel.kernels='cuda' is not one of"):
        resolve("cuda")


@pytest.fixture
def pretend_gpu_with_jax_triton(monkeypatch):
    """``triton_available()`` true (a GPU and jax-triton), the choice cache emptied around."""
    monkeypatch.setattr(kernels, "triton_available", lambda platform=None: True)
    resolve.cache_clear()
    yield
    resolve.cache_clear()


def test_auto_takes_triton_only_once_its_gpu_parity_test_is_recorded(
        pretend_gpu_with_jax_triton, monkeypatch, caplog):
    """A GPU with jax-triton is not enough for ``auto``: with no recorded GPU parity result it
    runs XLA (and says why); ``triton`` opts in; a recorded result makes ``auto`` Triton."""
    monkeypatch.setattr(gpu_verified, "RECORD", {})
    with caplog.at_level("INFO", logger="absl"):
        assert resolve("auto") == "xla"
    assert "not passed their GPU parity test" in caplog.text
    assert resolve("triton") == "triton"
    resolve.cache_clear()
    passed = gpu_verified.Verified("2026-01-01", "NVIDIA H200", "0.11.2",
                                   gpu_verified.PATHS["triton_kernels"] + "::test_norm_local")
    monkeypatch.setattr(gpu_verified, "RECORD", {"triton_kernels": passed})
    assert resolve("auto") == "triton"


def test_compute_capability_of_a_device():
    """The compute capability the plan passes to jax-triton: a CUDA device's ``"9.0"`` is 90
    (``"8.6"``: 86); a CPU device, which has none, gives None (jax-triton then asks the GPU)."""
    from types import SimpleNamespace

    from boost_jax.kernels import compute_capability

    assert compute_capability(SimpleNamespace(compute_capability="9.0")) == 90
    assert compute_capability(SimpleNamespace(compute_capability="8.6")) == 86
    assert compute_capability(jax.devices()[0]) is None
    assert compute_capability(SimpleNamespace(compute_capability="sm_90")) is None
