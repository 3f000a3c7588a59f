"""The parameter tree, one owner: each parameter's definition (:class:`ParamDef`: global
shape, logical axes, initialiser), the nested-dict tree and its flat form, the global shapes
and the PartitionSpecs a plan's rules give (:func:`param_shapes`, :func:`param_specs`), the
stacked decoder blocks (:data:`STACKED`, :func:`map_blocks`), and mesh-independent
initialisation from ``(seed, parameter path)``. The model (models/decoder.py) declares the
parameters; the runner (parallel/runner.py) lays them out with these functions.

Every parameter is declared as an ``nnx.Param`` whose metadata carries its initialiser (an
:class:`Init`) and its logical axes. :func:`param_defs` reads those declarations from an
abstract model; :func:`init_params` draws each *global* array from a key derived from the seed
and the parameter's path (and, for the stacked decoder blocks, the layer index), inside ``jit``
with the requested output shardings. Threefry is partitionable, so the values do not depend on
the mesh: a model initialised on one device equals the one initialised on 8.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

STACKED = "blocks"  # top-level collection whose parameters carry a leading layer axis
LAYERS_AXIS = "layers"


@dataclasses.dataclass(frozen=True)
class Init:
    """An initialiser: ``normal`` (std = scale), ``uniform`` (+-scale), ``ones`` or ``zeros``.

    ``scale`` may be a tuple giving one value per index of axis ``scale_axis`` (the member axis
    of a grouped factor whose members have different fan-outs).
    """

    kind: str
    scale: float | tuple[float, ...] = 1.0
    scale_axis: int | None = None

    def __call__(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        if self.kind == "ones":
            return jnp.ones(shape, jnp.float32)
        if self.kind == "zeros":
            return jnp.zeros(shape, jnp.float32)
        if self.kind == "normal":
            x = jax.random.normal(key, shape, jnp.float32)
        elif self.kind == "uniform":
            x = jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0)
        else:
            raise ValueError(f"unknown initialiser kind {self.kind!r}")
        scale = jnp.asarray(self.scale, jnp.float32)
        if self.scale_axis is not None:
            bshape = [1] * len(shape)
            bshape[self.scale_axis] = shape[self.scale_axis]
            scale = scale.reshape(bshape)
        return x * scale


def param(shape: tuple[int, ...], init: Init, axes: tuple[str | None, ...]) -> nnx.Param:
    """Declare a parameter: its global shape, initialiser and logical axis names."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(jnp.zeros(shape, jnp.float32), init=init, axes=tuple(axes))


@dataclasses.dataclass(frozen=True)
class ParamDef:
    """A parameter's global shape, logical axes and initialiser."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Init
    stacked: bool  # leading layer axis: each layer slice is drawn from its own key


def path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def param_defs(abstract_model: nnx.Module, n_layers: int) -> dict[tuple, ParamDef]:
    """Flat ``{path: ParamDef}`` of a model; parameters under ``blocks`` get ``[n_layers, ...]``."""
    _, state = nnx.split(abstract_model)
    defs = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        shape, axes = tuple(var.get_value().shape), tuple(meta["axes"])
        stacked = path[0] == STACKED
        if stacked:
            shape, axes = (n_layers, *shape), (LAYERS_AXIS, *axes)
        defs[path] = ParamDef(shape, axes, meta["init"], stacked)
    return defs


def param_key(seed: int | jax.Array, path: tuple) -> jax.Array:
    """The key of one parameter: a stable 32-bit hash of its path folded into the seed."""
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(path_str(path).encode()))


def _init_one(seed: jax.Array, path: tuple, d: ParamDef) -> jax.Array:
    key = param_key(seed, path)
    if not d.stacked:
        return d.init(key, d.shape)
    layer_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(d.shape[0]))
    return jax.vmap(lambda k: d.init(k, d.shape[1:]))(layer_keys)


def unflatten(flat: Mapping[tuple, object]) -> dict:
    """``{(a, b): x}`` -> ``{a: {b: x}}``."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return out


def flatten(tree: Mapping, prefix: tuple = ()) -> dict[tuple, object]:
    """Inverse of :func:`unflatten` for nested dicts."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def param_shapes(defs: Mapping[tuple, ParamDef]) -> dict:
    """``ShapeDtypeStruct`` (global shape, fp32) of every parameter, as a nested dict."""
    return unflatten({p: jax.ShapeDtypeStruct(d.shape, jnp.float32) for p, d in defs.items()})


def param_specs(defs: Mapping[tuple, ParamDef], spec: Callable[[tuple], P],
                stage_axis: str | None = None) -> dict:
    """Every parameter's PartitionSpec, as a nested dict: ``spec`` maps its logical axes to one
    (a plan's rules); ``stage_axis``: the mesh axis the stacked layer axis is split over (a
    pipeline's stages), else the layers stay whole."""
    out = {p: spec(d.axes) for p, d in defs.items()}
    if stage_axis is not None:
        out = {p: P(stage_axis, *s[1:]) if defs[p].stacked else s for p, s in out.items()}
    return unflatten(out)


def map_blocks(tree, fn):
    """Apply ``fn`` to the leaves under the :data:`STACKED` key of ``tree`` (parameters,
    optimizer moments, specs)."""
    def leaf(path, x):
        return fn(x) if any(getattr(k, "key", None) == STACKED for k in path) else x
    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, P))


def init_params(defs: Mapping[tuple, ParamDef], seed: int,
                shardings: Callable[[ParamDef], object] | Mapping | None = None,
                transform: Callable[[dict], dict] | None = None) -> dict:
    """Draw every parameter (fp32, global shape) under ``jit``; returns a nested dict.

    ``shardings`` maps each ParamDef to its output sharding (or is a nested dict of them, for
    the ``transform``-ed tree); ``None`` leaves placement to JAX (one device). ``transform``
    (e.g. a pipeline layout) is applied to the drawn tree inside the same ``jit``.
    """
    def build(seed):  # the seed is traced: one compilation serves every seed
        tree = unflatten({p: _init_one(seed, p, d) for p, d in defs.items()})
        return transform(tree) if transform else tree

    out_shardings = None
    if callable(shardings):
        out_shardings = unflatten({p: shardings(d) for p, d in defs.items()})
    elif shardings is not None:
        out_shardings = shardings
    return jax.jit(build, out_shardings=out_shardings)(jnp.uint32(seed))


def count(defs: Mapping[tuple, ParamDef]) -> int:
    return sum(math.prod(d.shape) for d in defs.values())
