"""ops.py's ``jax_triton.triton_call`` calls, checked without a GPU (jax-triton itself imports
only with a GPU jaxlib): a stand-in with jax-triton 0.3.1's signature takes the calls, maps
their arguments the way jax-triton does (arrays and scalars positionally, then the outputs;
keyword arguments as ``tl.constexpr``), runs the kernels in Triton's CPU interpreter, and hands
each call to Triton's compiler for sm_90 (H100/H200) as jax-triton's lowering would. The ops'
values and gradients with ``impl='triton'`` then equal ``impl='xla'``: fp32 to 1e-5, bf16 to
1e-2. On a GPU host, tests/kernels/test_triton_gpu.py compares jax-triton's signature with
the pinned one."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from boost_jax.kernels import ops
from boost_jax.testing import norm_rel_err, tree_rel_err
from tests.kernels.triton_cpu import (
    POINTER,
    compile_for_cuda,
    interpreted_kernels,
    scalar_type,
    triton_call_0_3_1,
)

torch, tk = interpreted_kernels()

EPS, D_MODEL = 1e-6, 1200
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))  # a writable copy


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class JaxTritonStandIn:
    """``jax_triton`` for :func:`ops._triton`: records each call as a compile spec and runs it
    in Triton's interpreter through ``jax.pure_callback``."""

    def __init__(self):
        self.specs: list[dict] = []

    def triton_call(self, *args, **kwargs):
        bound = inspect.signature(triton_call_0_3_1).bind(*args, **kwargs)  # TypeError if not
        bound.apply_defaults()
        kw = dict(bound.arguments)
        kernel, grid, metaparams = kw["kernel"], kw["grid"], kw["metaparams"]
        out_shapes, out_tree = jax.tree.flatten(kw["out_shape"])
        flat = jax.tree.leaves(kw["args"])
        scalars = [(i, a) for i, a in enumerate(flat)
                   if isinstance(a, (bool, int, float, np.float32))]
        arrays = [a for a in flat if not isinstance(a, (bool, int, float, np.float32))]
        types = [scalar_type(a) if isinstance(a, (bool, int, float, np.float32))
                 else "*" + POINTER[jnp.dtype(a.dtype).name] for a in flat]
        types += ["*" + POINTER[jnp.dtype(o.dtype).name] for o in out_shapes]
        params = kernel.arg_names
        assert params[len(types):] == sorted(metaparams, key=params.index), (
            f"{kernel.__name__}: positional {len(types)} + keywords {sorted(metaparams)} do not "
            f"cover the parameters {params}")
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        assert 1 <= len(grid) <= 3, grid
        self.specs.append(dict(kernel=kernel.__name__, arg_types=types, scalars=scalars,
                               metaparams=dict(metaparams), num_warps=kw["num_warps"],
                               num_stages=kw["num_stages"], num_ctas=kw["num_ctas"]))

        def launch(*host_arrays):
            it = iter(to_torch(np.asarray(a)) for a in host_arrays)
            inputs = [a if isinstance(a, (bool, int, float, np.float32)) else next(it)
                      for a in flat]
            outs = [to_torch(np.empty(o.shape, o.dtype)) for o in out_shapes]
            kernel[grid](*inputs, *outs, **metaparams)
            return tuple(to_numpy(o) for o in outs)

        result = jax.pure_callback(launch, tuple(out_shapes), *arrays)
        return jax.tree.unflatten(out_tree, result)


@pytest.fixture(scope="module")
def standin():
    jt = JaxTritonStandIn()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "_triton", lambda: (jt, tk))
        yield jt


def data(shape, dtype, seed, positive_last=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if positive_last:
        x[..., -1] = np.abs(x[..., -1]) * D_MODEL + 1.0
    return jnp.asarray(x).astype(dtype)


def both(fn, *args):
    """``fn(impl, *args)`` jitted, with ``impl='triton'`` then ``'xla'``."""
    return [jax.jit(lambda *a, impl=impl: fn(impl, *a))(*args) for impl in ("triton", "xla")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_local(standin, dtype):
    """38 rows of 300 (3 programs of 16 rows, the last masked), forward and gradients."""
    x, gamma = data((2, 19, 300), dtype, 0), 1.0 + 0.1 * data((300,), dtype, 1)
    w = data((2, 19, 300), jnp.float32, 2)

    def fn(impl, x, gamma):
        def loss(x, gamma):
            x_hat, s, rho = ops.norm_local(x, gamma, EPS, impl)
            return jnp.sum(w * x_hat.astype(jnp.float32)) + jnp.sum(jnp.sqrt(s)), (s, rho)

        return jax.value_and_grad(loss, (0, 1), has_aux=True)(x, gamma)

    tri, xla = both(fn, x, gamma)
    assert tree_rel_err(tri, xla, norm_rel_err) <= TOL[dtype]


@pytest.mark.parametrize("act", ["silu", "identity"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recover(standin, dtype, act):
    payload, w = data((2, 19, 3 * 100 + 1), dtype, 3, True), data((2, 19, 300), jnp.float32, 4)

    def fn(impl, p):
        return jax.value_and_grad(lambda q: jnp.sum(
            w * ops.recover(q, D_MODEL, EPS, act, dtype, impl).astype(jnp.float32)))(p)

    tri, xla = both(fn, payload)
    assert tree_rel_err(tri, xla, norm_rel_err) <= TOL[dtype]


def test_calls_compile_for_sm90(standin, tmp_path_factory):
    """Every call the tests above made (4 kernels; fp32, bf16; SiLU, identity) compiles with
    Triton for sm_90, with the signature and constants jax-triton 0.3.1 builds from it."""
    if len(standin.specs) < 12:  # run on its own: make the op tests' calls here
        for dtype in TOL:
            test_norm_local(standin, dtype)
            for act in ("silu", "identity"):
                test_recover(standin, dtype, act)
    unique = {repr(sorted(s.items())): s for s in standin.specs}
    specs = list(unique.values())
    errors = compile_for_cuda(specs, tmp_path_factory.mktemp("triton_cache"))
    failed = [f"{s['kernel']} {s['metaparams']}: {e}" for s, e in zip(specs, errors) if e]
    assert not failed, "\n".join(failed)
