"""Triton sources of BTP's chunk-boundary kernels (math: :mod:`boost_jax.kernels.reference`).

Each program owns ``BLOCK_T`` token rows and the whole feature width (``BLOCK_D`` / ``BLOCK_C``:
the next power of two, masked), so every input is read once and each row statistic is a
register reduction. Arrays are row-major 2-D; pointers follow jax-triton's order (inputs, then
outputs). Every other parameter is a ``tl.constexpr``: ``jax_triton.triton_call`` passes its
keyword arguments as compile-time constants (ops.py), so the row count, the widths and ``eps``
are baked into each compiled kernel (one per shape, as XLA compiles one program per shape).
The same sources run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, torch
tensors) for the tests on machines without a GPU; this module imports ``triton``, so import it
only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_local_fwd_kernel(x_ptr, g_ptr, xh_ptr, s_ptr, rho_ptr, T: tl.constexpr,
                          D: tl.constexpr, eps: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """``x [T, D]``, ``g [D]`` -> ``x_hat [T, D]``, ``s [T]``, ``rho [T]`` (fp32 stats)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    rmask, cmask = rows < T, cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    s = tl.sum(x * x, axis=1)
    rho = tl.sqrt(s / D + eps)
    x_hat = x / rho[:, None] * g[None, :]
    tl.store(xh_ptr + offs, x_hat.to(xh_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, s, mask=rmask)
    tl.store(rho_ptr + rows, rho, mask=rmask)


@triton.jit
def norm_local_bwd_kernel(x_ptr, g_ptr, rho_ptr, dxh_ptr, ds_ptr, dx_ptr, dg_ptr,
                          T: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """-> ``dx [T, D]`` and this program's partial ``dgamma`` row ``dg [programs, D]`` (fp32;
    the caller sums the rows)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    rmask, cmask = rows < T, cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dxh = tl.load(dxh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    rho = tl.load(rho_ptr + rows, mask=rmask, other=1.0)
    ds = tl.load(ds_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    dx = dxh * g[None, :] / rho[:, None] + 2.0 * x * ds[:, None]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dg = tl.sum(dxh * x / rho[:, None], axis=0)
    tl.store(dg_ptr + pid * D + cols, dg, mask=cmask)


@triton.jit
def _silu_parts(z):
    sig = 1.0 / (1.0 + tl.exp(-z))
    return z * sig, sig * (1.0 + z * (1.0 - sig))


@triton.jit
def recover_fwd_kernel(p_ptr, y_ptr, z_ptr, rms_ptr, T: tl.constexpr, C: tl.constexpr,
                       d: tl.constexpr, eps: tl.constexpr, SILU: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``p [T, C + 1]`` -> ``y [T, C]``, ``z [T, C]`` (pre-activation), ``rms [T]`` fp32."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)
    rmask, cmask = rows < T, cols < C
    mask = rmask[:, None] & cmask[None, :]
    h = tl.load(p_ptr + rows[:, None] * (C + 1) + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    s = tl.load(p_ptr + rows * (C + 1) + C, mask=rmask, other=0.0).to(tl.float32)
    rms = tl.sqrt(s / d + eps)
    z = h / rms[:, None]
    if SILU:
        y, _ = _silu_parts(z)
    else:
        y = z
    offs = rows[:, None] * C + cols[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(z_ptr + offs, z.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(rms_ptr + rows, rms, mask=rmask)


@triton.jit
def recover_bwd_kernel(z_ptr, rms_ptr, dy_ptr, dp_ptr, T: tl.constexpr, C: tl.constexpr,
                       d: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """``z``, ``rms``, ``dy [T, C]`` -> ``dp [T, C + 1]`` (latent and statistic cotangents)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)
    rmask, cmask = rows < T, cols < C
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * C + cols[None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rms = tl.load(rms_ptr + rows, mask=rmask, other=1.0)
    if SILU:
        _, slope = _silu_parts(z)
        dz = dy * slope
    else:
        dz = dy
    ds = -tl.sum(dz * z, axis=1) / (2.0 * d * rms * rms)
    out = dp_ptr.dtype.element_ty
    tl.store(dp_ptr + rows[:, None] * (C + 1) + cols[None, :], (dz / rms[:, None]).to(out),
             mask=mask)
    tl.store(dp_ptr + rows * (C + 1) + C, ds.to(out), mask=rmask)
