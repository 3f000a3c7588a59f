"""Triton without a GPU, for the kernel tests: the import rule, the kernels decorated for
Triton's CPU interpreter, and a compile of a kernel for a CUDA GPU the way jax-triton does it.

* Where triton or torch is missing the Triton tests skip, unless ``BOOST_JAX_REQUIRE_TRITON=1``
  (CI's first stack sets it, having installed triton and torch): then the missing package
  fails the module. A comma-separated list of modules instead of ``1`` requires those only
  (CI's newest stack: ``jax_triton,triton``, installed for the GPU compile, without torch).
* Triton reads ``TRITON_INTERPRET`` when it is imported (its own ``tl.sum`` & co. are decorated
  then) and when a kernel is decorated, for the whole process. So the interpreter tests set it
  before importing triton, and are skipped in a ``BOOST_JAX_GPU_TESTS=1`` run, whose GPU tests
  need the compiled kernels; compiles happen in a child process (:func:`compile_for_cuda`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

REQUIRE_ENV = "BOOST_JAX_REQUIRE_TRITON"
REPO = Path(__file__).parents[2]
SOURCES = REPO / "boost_jax" / "kernels" / "triton_kernels.py"
#: the H100's and H200's architecture (sm_90)
CUDA_CAPABILITY = 90
#: jax-triton's pointer element types (triton_lib._JAX_TO_TRITON_TYPE_MAP)
POINTER = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32"}


def triton_call_0_3_1(*args, kernel, out_shape, grid, name="",
                      custom_call_target_name="triton_kernel_call", num_warps=None,
                      num_stages=None, num_ctas=1, compute_capability=None,
                      enable_fp_fusion=True, input_output_aliases=None, zeroed_outputs=(),
                      debug=False, serialized_metadata=b"", **metaparams):
    """jax-triton 0.3.1's ``triton_call`` signature (tests/kernels/test_triton_call.py
    stands in for it; tests/kernels/test_triton_gpu.py compares it with the installed one)."""


def scalar_type(value) -> str:
    """jax-triton's ``get_triton_type`` of a positional scalar."""
    if isinstance(value, bool):
        return "B"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp64"
    if isinstance(value, np.float32):
        return "fp32"
    raise TypeError(f"jax-triton takes no positional scalar of type {type(value).__name__}")


def required(name: str) -> bool:
    """Whether this run must have ``name`` (``BOOST_JAX_REQUIRE_TRITON``: ``1``, or a
    comma-separated list of module names that holds it)."""
    value = os.environ.get(REQUIRE_ENV, "")
    return value == "1" or name in value.split(",")


def require(name: str) -> ModuleType:
    """``import name``; when it fails: skip the calling module, or fail it when this run
    requires ``name`` (:func:`required`)."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        if required(name):
            value = os.environ[REQUIRE_ENV]
            pytest.fail(f"{REQUIRE_ENV}={value} but {name} does not import ({err}); install "
                        "it (see .ci/run)", pytrace=False)
        pytest.skip(f"needs {name} ({err}); CI sets {REQUIRE_ENV}=1 and installs it",
                    allow_module_level=True)


def interpreted_kernels() -> tuple[ModuleType, ModuleType]:
    """``(torch, boost_jax.kernels.triton_kernels)`` with the kernels decorated for Triton's CPU
    interpreter (launch them on torch CPU tensors); skips the calling module where that cannot
    be (see the module docstring)."""
    if os.environ.get("BOOST_JAX_GPU_TESTS") == "1":
        pytest.skip("Triton's interpreter would be process-wide, and this run's GPU tests need "
                    "the compiled kernels (CPU runs and CI run these)", allow_module_level=True)
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    torch = require("torch")
    require("triton")
    from boost_jax.kernels import triton_kernels

    if type(triton_kernels.norm_local_fwd_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)
    return torch, triton_kernels


def _compile(specs: list[dict]) -> list[str]:
    """Compile each spec for sm_90 as jax-triton 0.3.1's lowering does
    (``get_or_create_triton_kernel``); ``''`` or the error of each. Runs in the child."""
    import types

    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import compiler

    spec = importlib.util.spec_from_file_location("_triton_kernels_compiled", SOURCES)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    target = GPUTarget("cuda", CUDA_CAPABILITY, 32)
    backend = CUDABackend(target)
    errors = []
    for s in specs:
        fn = getattr(kernels, s["kernel"])
        types_ = s["arg_types"]
        signature = {fn.arg_names[i]: t for i, t in enumerate(types_)}
        aligned = [t.startswith("*") for t in types_]
        attrs = {(i,): backend.parse_attr(attr) for i, (_, attr) in enumerate(
            native_specialize_impl(backend, types.SimpleNamespace(
                data_ptr=lambda a=a: 16 if a else 0, dtype=t.removeprefix("*")), False, True, a)
            for t, a in zip(types_, aligned))}
        constants = dict(sorted(s["metaparams"].items()))
        constants.update({fn.arg_names[i]: 1 for i, v in s["scalars"] if v == 1})
        signature.update({name: "constexpr" for name in constants})
        try:
            triton.compile(compiler.ASTSource(fn, signature, constants, attrs), target=target,
                           options={"num_warps": s["num_warps"] or 4,
                                    "num_stages": s["num_stages"] or 3,
                                    "num_ctas": s["num_ctas"], "enable_fp_fusion": True})
            errors.append("")
        except Exception as err:  # noqa: BLE001  (reported per spec)
            errors.append(f"{type(err).__name__}: {err}")
    return errors


def compile_for_cuda(specs: list[dict], cache_dir: Path) -> list[str]:
    """Compile each ``spec`` (kernel name, ``arg_types`` of its pointers and positional scalars
    in jax-triton's order, ``scalars`` ``[(index, value)]``, ``metaparams``, ``num_warps``,
    ``num_stages``, ``num_ctas``) with Triton for sm_90, in a child process without
    ``TRITON_INTERPRET``: ``''`` or the error, per spec."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    code = ("import pickle, sys; from tests.kernels.triton_cpu import _compile; "
            "sys.stdout.buffer.write(pickle.dumps(_compile(pickle.load(sys.stdin.buffer))))")
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(specs),
                          capture_output=True, env=env, cwd=REPO, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the compile process failed: {done.stderr.decode()[-2000:]}")
    return pickle.loads(done.stdout)
