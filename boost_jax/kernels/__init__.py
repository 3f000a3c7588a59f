"""Custom GPU kernels (jax-triton), each beside the ``jnp`` reference it is tested against.

``Parallel.kernels`` picks the implementation of BTP's chunk-boundary ops
(:mod:`boost_jax.kernels.ops`): ``xla`` (the ``jnp`` reference, fused by XLA), ``triton`` (a
GPU and jax-triton, else a one-line error) or ``auto``. ``auto`` takes the Triton kernels only
where a GPU and jax-triton are there *and* the kernels' GPU parity test
(tests/kernels/test_triton_gpu.py) has passed in this repository, as recorded in
:mod:`boost_jax.gpu_verified`; else XLA. The choice is logged once, with its reason. CPU-only
installs never import GPU code.
"""

from __future__ import annotations

import functools
import re

from absl import logging

from boost_jax import gpu_verified
from boost_jax.errors import ConfigError

CHOICES = ("auto", "triton", "xla")
#: the :data:`boost_jax.gpu_verified.PATHS` entry whose recorded GPU result ``auto`` reads
VERIFIED_PATH = "triton_kernels"


def triton_available(platform: str | None = None) -> bool:
    """True when jax-triton imports (a jaxlib with the CUDA plugin) and the devices the step
    runs on (``platform``: a mesh's ``device.platform``; ``None``: the default backend's) are
    GPUs -- the mock GPUs of a deviceless compile (commands/gpu_compile.py) included."""
    try:
        import jax_triton  # noqa: F401  (raises ImportError on CPU-only jaxlib)
    except ImportError:
        return False
    import jax

    return (platform or jax.default_backend()) == "gpu"


def compute_capability(device) -> int | None:
    """The CUDA compute capability the Triton kernels are compiled for on ``device`` (``90``
    for an H100's ``"9.0"``; a deviceless compile's mock GPUs carry their target's), or
    ``None`` (not a CUDA GPU: jax-triton then asks the device itself)."""
    cc = getattr(device, "compute_capability", None)
    if not isinstance(cc, str) or not re.fullmatch(r"\d+\.\d+", cc):
        return None
    major, minor = cc.split(".")
    return 10 * int(major) + int(minor)


def _auto(platform: str | None) -> tuple[str, str]:
    """``auto``'s implementation and the reason for it."""
    if not triton_available(platform):
        return "xla", "no GPU with jax-triton"
    record = gpu_verified.verified(VERIFIED_PATH)
    if record is None:
        return "xla", ("the Triton kernels have not passed their GPU parity test here yet "
                       "(boost_jax/gpu_verified.py); Parallel.kernels='triton' opts in")
    return "triton", (f"GPU parity test passed on {record.gpu}, jax {record.jax}, "
                      f"{record.date}")


@functools.cache
def resolve(choice: str, platform: str | None = None) -> str:
    """``Parallel.kernels`` -> the implementation used on ``platform``'s devices (a mesh's
    ``device.platform``; ``None``: the default backend's): ``'triton'`` or ``'xla'``."""
    if choice not in CHOICES:
        raise ConfigError(f"Parallel.kernels={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "xla":
        return "xla"
    if choice == "triton":
        if not triton_available(platform):
            raise ConfigError("Parallel.kernels='triton' needs a GPU and jax-triton (pip "
                              "install -e \".[gpu]\"); use 'auto' or 'xla' here")
        impl, why = "triton", "asked for"
    else:
        impl, why = _auto(platform)
    logging.info("Parallel.kernels=%r: BTP chunk-boundary ops run on %s (%s)", choice,
                 "Triton kernels" if impl == "triton" else "XLA", why)
    return impl
