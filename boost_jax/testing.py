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


def norm_rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` (Frobenius) in float64: the error measure for bf16 comparisons,
    where single elements carry rounding noise of the format's own size."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / scale) if scale > 0 else float(np.linalg.norm(a))


def tree_rel_err(a, b, metric=rel_err) -> float:
    """Largest ``metric`` (default :func:`rel_err`) over the leaves of two pytrees."""
    import jax

    return max(jax.tree.leaves(jax.tree.map(metric, a, b)))


def tiny(arch: str = "cola", **overrides) -> Model:
    """The ``tiny`` preset (d=64, 2 layers, 8 heads, 4 KV heads, vocab 512) for ``arch``."""
    return Model(arch=arch, size="tiny", **overrides)


def loss_and_grads(model: Model, parallel: Parallel, params: dict, inputs, targets,
                   dtype: str = "float32", gspmd: bool = False, packing: dict | None = None,
                   devices=None, max_segments: int | None = None):
    """Loss and parameter gradients of the global batch under ``parallel`` (on the first
    ``parallel.num_devices`` devices; ``gspmd``: its GSPMD baseline), as the train step
    computes them (accumulation and the zero stage's reduction included), as host arrays;
    ``params`` and the gradients in the canonical layout (blocks ``[L, ...]``) whatever the
    pipeline layout. ``packing``: ``segment_ids`` and ``positions`` of packed rows.
    ``devices``: where to run (default ``jax.devices()``); ``max_segments``:
    ``Data.max_segments`` (cuDNN's packed attention needs it)."""
    import jax
    import jax.numpy as jnp

    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import make_grad_fn

    mesh = make_mesh(parallel, (devices or jax.devices())[:parallel.num_devices])
    sharded = ShardedModel(model, parallel, mesh, jnp.dtype(dtype), gspmd=gspmd,
                           max_segments=max_segments)
    p = jax.device_put(sharded.from_canonical(params), sharded.param_shardings)
    batch = {k: jax.device_put(v, sharded.batch_sharding)
             for k, v in {"inputs": inputs, "targets": targets, **(packing or {})}.items()}
    grad_fn = make_grad_fn(sharded)
    loss, grads = jax.device_get(grad_fn(p, batch))
    return loss, sharded.to_canonical(grads)


def packed_segments(rows, seq: int):
    """The :class:`~boost_jax.models.attention.Segments` of packed rows given each row's
    document lengths (``rows[r] = (n_1, n_2, ...)``, ids ``1, 2, ...``, the rest of the
    ``seq`` tokens padding, id 0); positions restart at every document."""
    import jax.numpy as jnp

    from boost_jax.models.attention import Segments

    ids, pos = np.zeros((len(rows), seq), np.int32), np.zeros((len(rows), seq), np.int32)
    for r, row in enumerate(rows):
        at = 0
        for seg, n in enumerate(row, start=1):
            ids[r, at:at + n], pos[r, at:at + n] = seg, np.arange(n)
            at += n
    return Segments(jnp.asarray(ids), jnp.asarray(pos))
