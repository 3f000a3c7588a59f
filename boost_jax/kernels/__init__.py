"""Custom GPU kernels (jax-triton), each beside the ``jnp`` reference it is tested against.

``Parallel.kernels`` picks the implementation of BTP's chunk-boundary ops
(:mod:`boost_jax.kernels.ops`): ``xla`` (the ``jnp`` reference, fused by XLA), ``triton`` (a
GPU and jax-triton, else a one-line error) or ``auto`` (Triton when both are there, else XLA;
the choice is logged once). CPU-only installs never import GPU code.
"""

from __future__ import annotations

import functools

from absl import logging

from boost_jax.config import ConfigError

CHOICES = ("auto", "triton", "xla")


def triton_available() -> bool:
    """True when jax-triton imports (GPU jaxlib) and the default backend is a GPU."""
    try:
        import jax_triton  # noqa: F401  (raises ImportError on CPU-only jaxlib)
    except ImportError:
        return False
    import jax

    return jax.default_backend() == "gpu"


@functools.cache
def resolve(choice: str) -> str:
    """``Parallel.kernels`` -> the implementation used: ``'triton'`` or ``'xla'``."""
    if choice not in CHOICES:
        raise ConfigError(f"Parallel.kernels={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "xla":
        return "xla"
    available = triton_available()
    if choice == "triton" and not available:
        raise ConfigError("Parallel.kernels='triton' needs a GPU and jax-triton (pip install "
                          "-e \".[gpu]\"); use 'auto' or 'xla' here")
    impl = "triton" if available else "xla"
    logging.info("Parallel.kernels=%r: BTP chunk-boundary ops run on %s", choice,
                 "Triton kernels" if impl == "triton" else "XLA (no GPU with jax-triton)")
    return impl
