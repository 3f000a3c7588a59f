"""The `gpu` marker's condition: a GPU platform initialised beside the simulated CPU devices
(``BOOST_JAX_GPU_TESTS=1`` on a GPU host, see tests/conftest.py)."""

import os

import jax
import pytest


def gpu_device():
    """The first GPU, or skip the test with the reason."""
    if "cuda" not in os.environ.get("JAX_PLATFORMS", ""):
        pytest.skip("needs a GPU: run `BOOST_JAX_GPU_TESTS=1 pytest -m gpu` on a GPU host")
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as err:
        pytest.skip(f"no GPU platform: {err}")


def needs_jax_triton():
    # ImportError too: jax-triton raises it on import where JAX has no GPU backend
    pytest.importorskip("jax_triton", reason="needs jax-triton (pip install -e \".[gpu]\")",
                        exc_type=ImportError)
