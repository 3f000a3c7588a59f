"""Custom GPU kernels (jax-triton / Pallas), each beside a ``jnp`` reference implementation.

No model path needs a custom kernel yet: every op runs through XLA on CPU and GPU alike. Kernels
are added here behind :func:`triton_available`, so CPU-only installs never import GPU code.
"""

from __future__ import annotations


def triton_available() -> bool:
    """True when jax-triton imports (GPU jaxlib) and the default backend is a GPU."""
    try:
        import jax_triton  # noqa: F401  (raises ImportError on CPU-only jaxlib)
    except ImportError:
        return False
    import jax

    return jax.default_backend() == "gpu"
