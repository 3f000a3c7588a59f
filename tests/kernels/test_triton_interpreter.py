"""The Triton sources run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, torch tensors)
against the ``jnp`` reference: fp32 to 1e-5 and bf16 to 1e-2, forward and backward, widths
that are not powers of two and a row count that is not a multiple of the block. Needs triton
and torch: skipped without them, a failure with ``BOOST_JAX_REQUIRE_TRITON=1`` (CI). The
jax-triton calls of ops.py are tests/kernels/test_triton_call.py, the GPU path
tests/kernels/test_triton_gpu.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels import reference as ref
from boost_jax.kernels.ops import _pow2, block_rows
from boost_jax.testing import rel_err
from tests.kernels.triton_cpu import interpreted_kernels

torch, tk = interpreted_kernels()

EPS = 1e-6
T, D, C, D_MODEL = 13, 40, 3 * 12, 160
DTYPES = {"float32": (torch.float32, jnp.float32, 1e-5), "bfloat16": (torch.bfloat16,
                                                                      jnp.bfloat16, 1e-2)}


def rand(shape, seed, positive_last=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if positive_last:
        x[:, -1] = np.abs(x[:, -1]) * D_MODEL + 1.0
    return x


def as_torch(x: np.ndarray, dtype) -> "torch.Tensor":
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def as_np(t: "torch.Tensor") -> np.ndarray:
    return t.to(torch.float32).numpy()


def as_jnp(x: np.ndarray, dtype):
    return jnp.asarray(x).astype(dtype)


def grid(width: int) -> tuple[int]:
    return (-(-T // block_rows(width)),)


@pytest.mark.parametrize("name", DTYPES)
def test_norm_local(name):
    tdt, jdt, tol = DTYPES[name]
    x, gamma = rand((T, D), 0), 1.0 + 0.1 * rand((1, D), 1)[0]
    dxh, ds = rand((T, D), 2), rand((T, 1), 3)
    x_hat, s, rho = torch.empty(T, D, dtype=tdt), torch.empty(T), torch.empty(T)
    tk.norm_local_fwd_kernel[grid(D)](as_torch(x, tdt), as_torch(gamma, tdt), x_hat, s, rho,
                                     T, D, EPS, BLOCK_T=block_rows(D), BLOCK_D=_pow2(D))
    want = ref.norm_local_fwd(as_jnp(x, jdt), as_jnp(gamma, jdt), EPS)
    for got, w in zip((x_hat, s, rho), want):
        assert rel_err(as_np(got).reshape(w.shape), np.asarray(w, np.float32)) <= tol

    dx, dg = torch.empty(T, D, dtype=tdt), torch.empty(grid(D)[0], D)
    tk.norm_local_bwd_kernel[grid(D)](as_torch(x, tdt), as_torch(gamma, tdt), rho,
                                     as_torch(dxh, tdt), as_torch(ds[:, 0], torch.float32),
                                     dx, dg, T, D, BLOCK_T=block_rows(D), BLOCK_D=_pow2(D))
    want_dx, want_dg = ref.norm_local_bwd(as_jnp(x, jdt), as_jnp(gamma, jdt), want[2],
                                          as_jnp(dxh, jdt), jnp.asarray(ds))
    assert rel_err(as_np(dx), np.asarray(want_dx, np.float32)) <= tol
    assert rel_err(as_np(dg).sum(0), np.asarray(want_dg, np.float32)) <= tol


@pytest.mark.parametrize("act", ref.ACTIVATIONS)
@pytest.mark.parametrize("name", DTYPES)
def test_recover(name, act):
    tdt, jdt, tol = DTYPES[name]
    payload, dy = rand((T, C + 1), 4, positive_last=True), rand((T, C), 5)
    y, z, rms = torch.empty(T, C, dtype=tdt), torch.empty(T, C, dtype=tdt), torch.empty(T)
    silu = act == "silu"
    tk.recover_fwd_kernel[grid(C)](as_torch(payload, tdt), y, z, rms, T, C, D_MODEL, EPS,
                                  SILU=silu, BLOCK_T=block_rows(C), BLOCK_C=_pow2(C))
    want = ref.recover_fwd(as_jnp(payload, jdt), D_MODEL, EPS, act, jdt)
    for got, w in zip((y, z, rms), want):
        assert rel_err(as_np(got).reshape(w.shape), np.asarray(w, np.float32)) <= tol

    dp = torch.empty(T, C + 1, dtype=tdt)
    tk.recover_bwd_kernel[grid(C)](z, rms, as_torch(dy, tdt), dp, T, C, D_MODEL, SILU=silu,
                                  BLOCK_T=block_rows(C), BLOCK_C=_pow2(C))
    want_dp = ref.recover_bwd(want[1], want[2], as_jnp(dy, jdt), D_MODEL, act, jdt)
    assert rel_err(as_np(dp), np.asarray(want_dp, np.float32)) <= tol
