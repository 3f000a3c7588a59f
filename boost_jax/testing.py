"""Helpers shared by the tests (and handy in notebooks): error metrics, small configs."""

from __future__ import annotations

import numpy as np

from boost_jax.config import Model, Parallel

#: one device, no tensor parallelism: the reference layout
SINGLE = Parallel(data=1, pipe=1, tensor=1, tp_plan="none")


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|`` in float64 (``max|a|`` when ``b`` is all zeros)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / scale) if scale > 0 else float(np.max(np.abs(a)))


def tree_rel_err(a, b) -> float:
    """Largest :func:`rel_err` over the leaves of two pytrees of the same structure."""
    import jax

    return max(jax.tree.leaves(jax.tree.map(rel_err, a, b)))


def tiny(arch: str = "cola", **overrides) -> Model:
    """The ``tiny`` preset (d=64, 2 layers, 8 heads, 4 KV heads, vocab 512) for ``arch``."""
    return Model(arch=arch, size="tiny", **overrides)
