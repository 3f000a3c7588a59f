"""The train state's layout over the ``data`` mesh axis (``Parallel.zero``) and the data-axis
collectives of the train step, all run inside the model's ``shard_map`` region.

``0``  parameters, gradients and optimizer state replicated over ``data``; the gradients are
       all-reduced.
``1``  ZeRO-1: each parameter has a *zero dim*, split over ``data`` in its optimizer moments.
       The gradients are reduce-scattered onto that split, every data rank updates its slice
       of the parameters, and the updated slices are all-gathered: a reduce-scatter and an
       all-gather move what the one all-reduce moved.
``3``  FSDP: the parameters are split like the moments. Inside the loss, each layer's
       parameters are all-gathered in the layer loop right before the layer runs, and the
       embedding, head and final norm once at the top; the transposes reduce-scatter the
       gradients (per layer, inside the backward loop, where a GPU overlaps them with the next
       layer's backward). A gathered layer is never kept for the backward pass: the layer is
       rematerialised and gathers its parameters again. Parameters are cast to the compute
       dtype before they are gathered (a bf16 run gathers bf16, half the bytes of the fp32
       masters).

Where stages 0 and 1 reduce (``in_loop``). Without gradient accumulation, each layer's gradient
is reduced inside the backward layer loop, as soon as it is complete (DDP's and torchtitan's
overlap): the layer's parameters enter the block through a cast to the compute dtype whose
transpose all-reduces (stage 0) or reduce-scatters (stage 1) the layer's cotangent over
``data``, so the collective of layer ``l`` can run under the backward of layer ``l - 1``.
Under a GPipe pipeline a stage runs its layers once per microbatch; the cast happens in the
pipeline's first iteration only, which keeps a copy of the cast layer for the later ones
(``keep``): the later iterations' cotangents reach that copy first, and the cast's transpose
adds them before it reduces -- in the last backward iteration, layer by layer
(parallel/pipeline.py). The embedding, head and norms are reduced once, after the loop. With
accumulation, or the circular schedule (a layer group's last use differs per stage), a
layer's gradient is reduced once, after the last micro-step -- reducing inside the loop would
repeat the reduction per micro-step.

Every gradient reduction over ``data`` -- the all-reduce, ZeRO-1's and FSDP's reduce-scatters,
the per-layer ones in the backward loop included -- sums in ``Parallel.reduce_dtype`` (fp32 by
default, whatever the compute dtype; the reduced gradients are fp32 again).

The zero dim is the first dimension of a layer's parameter (past the stacked layer axes) whose
local size under the plan divides by ``data``; one already split over ``tensor`` is split
further (``P(("tensor", "data"))``), so all-gathering the ``data`` slices rebuilds the tensor
shard. A parameter without such a dimension stays replicated (and all-reduced) at every stage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from boost_jax.models.remat import GATHERED, tag
from boost_jax.parallel.data_casts import cast_gather, cast_reduce, varying
from boost_jax.parallel.plans.base import DATA, PIPE, as_entry, entry_axes, region_axes


def _with_data(spec: P, dim: int, ndim: int) -> P:
    """``spec`` with ``data`` added (minor) to dimension ``dim``."""
    entries = list(spec) + [None] * (ndim - len(spec))
    entries[dim] = as_entry((*entry_axes(entries[dim]), DATA))
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter's data-parallel layout.

    ``spec``: the plan's PartitionSpec (pipeline layout included); ``dim``: its zero dim
    (``None``: replicated over ``data``); ``layer_dims``: leading stacked-layer axes;
    ``reduce``: the axes (``data``, ``pipe``, size > 1) its stored copy is replicated over,
    i.e. over which its gradient is summed.
    """

    spec: P
    shape: tuple[int, ...]
    dim: int | None
    layer_dims: int
    reduce: tuple[str, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _keys(path) -> tuple:
    """The dict keys of a pytree path (an ``nnx.State``'s ``.value`` hop dropped)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


class DataLayout:
    """The ``Parallel.zero`` layout of a parameter tree on a mesh (see the module docstring).

    Args:
      stage: 0, 1 or 3.
      mesh_shape: ``{axis: size}`` of the ``(data, pipe, tensor)`` mesh.
      specs, shapes: the plan's PartitionSpecs and the global shapes of the parameters (nested
        dicts); ``stacked`` maps a top-level key (the decoder's ``blocks``) to the number of
        leading layer axes of its leaves.
      reduce_dtype: ``Parallel.reduce_dtype``, the dtype every gradient reduction over
        ``data`` sums in (:meth:`reduce`, and the per-layer reductions).
      in_loop: no accumulation, and a pipeline (if any) runs GPipe: at stages 0 and 1 each
        layer's gradient is reduced in the backward layer loop (:meth:`layer_params`).
    """

    def __init__(self, stage: int, mesh_shape: Mapping[str, int], specs: dict, shapes: dict,
                 stacked: Mapping[str, int], reduce_dtype="float32", in_loop: bool = False):
        self.stage, self.mesh_shape = stage, dict(mesh_shape)
        self.data = self.mesh_shape[DATA]
        self.reduce_dtype = jnp.dtype(reduce_dtype)
        #: stages 0/1 reduce the layers' gradients in the backward loop (module docstring)
        self.in_loop = in_loop and stage in (0, 1) and self.data > 1

        def leaf(path, spec, shape):
            keys = _keys(path)
            layer_dims = stacked.get(keys[0], 0)
            return self._leaf(spec, shape.shape, layer_dims)

        self.leaves = jax.tree_util.tree_map_with_path(
            leaf, specs, shapes, is_leaf=lambda x: isinstance(x, P))
        #: the stacked collection's leaves by their path below it (for the layer loop)
        self.block_leaves = {
            _keys(p)[1:]: lf for p, lf in jax.tree_util.tree_leaves_with_path(
                self.leaves, is_leaf=lambda x: isinstance(x, Leaf))
            if _keys(p)[0] in stacked}

    def _leaf(self, spec: P, shape: tuple[int, ...], layer_dims: int) -> Leaf:
        dim = None
        if self.stage > 0 and self.data > 1:
            entries = list(spec) + [None] * (len(shape) - len(spec))
            for i in range(layer_dims, len(shape)):
                split = math.prod(self.mesh_shape[a] for a in entry_axes(entries[i]))
                if (shape[i] // split) % self.data == 0:
                    dim = i
                    break
        stored = _with_data(spec, dim, len(shape)) if self.stage == 3 and dim is not None \
            else spec
        used = {a for e in stored for a in entry_axes(e)}
        reduce = tuple(a for a in (DATA, PIPE) if a not in used and self.mesh_shape[a] > 1)
        return Leaf(spec, tuple(shape), dim, layer_dims, reduce)

    def local_size(self, lf: Leaf) -> int:
        """Elements of a parameter on one device before any ``data`` split (its tensor and
        pipe shard)."""
        split = math.prod(self.mesh_shape[a] for e in lf.spec for a in entry_axes(e))
        return math.prod(lf.shape) // split

    def items(self) -> list[Leaf]:
        return jax.tree.leaves(self.leaves, is_leaf=lambda x: isinstance(x, Leaf))

    def sharded(self, lf: Leaf) -> bool:
        """Is the parameter's optimizer state (and, under FSDP, the parameter) split over
        ``data``?"""
        return lf.dim is not None

    def fsdp(self, lf: Leaf) -> bool:
        """Is the parameter itself split over ``data`` (and gathered where it is used)?"""
        return self.stage == 3 and lf.dim is not None

    def reduced_in_loop(self, lf: Leaf) -> bool:
        """Is the parameter's gradient reduced over ``data`` inside the backward layer loop
        (a layer parameter: FSDP's reduce-scatter, or stage 0/1's ``in_loop`` reduction)?"""
        return bool(lf.layer_dims) and (self.fsdp(lf) or self.in_loop)

    @property
    def per_layer(self) -> bool:
        """Does :meth:`layer_params` do anything (FSDP's gathers, the in-loop reduction)?"""
        return self.stage == 3 or self.in_loop

    def _map(self, fn, *trees):
        return jax.tree.map(fn, self.leaves, *trees, is_leaf=lambda x: isinstance(x, Leaf))

    # --- specs -------------------------------------------------------------------------------
    @property
    def param_specs(self) -> dict:
        """Where parameters are stored: the plan's specs, split over ``data`` under FSDP."""
        return self._map(lambda lf: _with_data(lf.spec, lf.dim, lf.ndim) if self.fsdp(lf)
                         else lf.spec)

    @property
    def moment_specs(self) -> dict:
        """Optimizer moments (and reduced gradients): split over ``data`` at stages 1 and 3."""
        return self._map(lambda lf: _with_data(lf.spec, lf.dim, lf.ndim) if self.sharded(lf)
                         else lf.spec)

    # --- inside the region (per device) ------------------------------------------------------
    def differentiable(self, params: dict) -> dict:
        """Mark each stored parameter as varying over the axes it is replicated over, so that
        gradients with respect to the result are this device's partial sums (reduced later by
        :meth:`reduce`, once per step) rather than psum-ed where each use is transposed. A
        layer parameter all-reduced in the loop stays invariant over ``data``: its per-layer
        cast marks it varying there, and the cast's transpose is the all-reduce."""
        def mark(lf, p):
            axes = lf.reduce
            if self.in_loop and lf.layer_dims and not self.sharded(lf):
                axes = tuple(a for a in axes if a != DATA)
            return lax.pcast(p, axes, to="varying") if axes else p
        return self._map(mark, params)

    def gather_globals(self, params: dict, dtype=None) -> dict:
        """FSDP: all-gather the non-stacked parameters (embedding, head, norms) over ``data``,
        once per step (outside gradient accumulation), cast to ``dtype`` first (the compute
        dtype; ``None``: as stored). Identity at other stages and for the stacked blocks (see
        :meth:`gather_layer`). Gradients are taken with respect to the gathered values and
        reduce-scattered by :meth:`reduce`."""
        def gather(lf, p):
            if not self.fsdp(lf) or lf.layer_dims:
                return p
            return lax.all_gather(p if dtype is None else p.astype(dtype), DATA, axis=lf.dim,
                                  tiled=True)
        return self._map(gather, params)

    def layer_params(self, layer, dtype, keep: bool = False) -> object:
        """One layer's stored parameters (stacked axes indexed away) as its block computes with
        them, cast to the compute ``dtype``: FSDP's all-gathered ones (:meth:`gather_layer`),
        or under ``in_loop`` through the cast whose transpose reduces the layer's gradient
        over ``data`` in :attr:`reduce_dtype`.

        ``keep`` (``in_loop`` only): returns ``(used, kept)``, two copies of the cast layer;
        the cotangents of both are summed before the reduction (a pipeline's first iteration
        keeps the layer for the later ones, see the module docstring)."""
        if self.stage == 3:
            if keep:
                raise ValueError("FSDP gathers its layers in every pipeline iteration; "
                                 "keep is for the in-loop reduction of zero stages 0 and 1")
            return self.gather_layer(layer, dtype)
        dtype = jnp.dtype(dtype)

        def cast(path, p):
            lf = self.block_leaves[_keys(path)]
            axis = lf.dim - lf.layer_dims if self.sharded(lf) else None
            return cast_reduce(axis, p.dtype, dtype, self.reduce_dtype, keep)(p)
        out = jax.tree_util.tree_map_with_path(cast, layer)
        if not keep:
            return out
        pair = lambda x: isinstance(x, tuple)  # noqa: E731
        return (jax.tree.map(lambda t: t[0], out, is_leaf=pair),
                jax.tree.map(lambda t: t[1], out, is_leaf=pair))

    def gather_layer(self, layer, dtype) -> object:
        """FSDP: one layer's parameters (stacked axes indexed away) cast to the compute
        ``dtype``, all-gathered over ``data`` and tagged :data:`GATHERED` (never kept for
        backward); their gradients are reduce-scattered back onto the shards in the backward
        loop, in :attr:`reduce_dtype`."""
        dtype, reduce_dtype = jnp.dtype(dtype), self.reduce_dtype

        def gather(path, p):
            lf = self.block_leaves[_keys(path)]
            if not self.fsdp(lf):
                return p.astype(dtype)
            axis = lf.dim - lf.layer_dims
            if p.dtype == dtype == reduce_dtype:  # nothing to cast: the plain gather
                p = lax.all_gather(p, DATA, axis=axis, tiled=True)
            else:
                p = cast_gather(axis, p.dtype, dtype, reduce_dtype)(p)
            return tag(p, GATHERED)
        return jax.tree_util.tree_map_with_path(gather, layer)

    def partial_after_gather(self, lf: Leaf) -> bool:
        """Is the parameter used whole (replicated, or gathered once per step) with its
        gradient reduce-scattered after accumulation? Stage 1, and FSDP's non-layer
        parameters (gathered once per step by :meth:`gather_globals`)."""
        return self.sharded(lf) and (self.stage == 1 or not lf.layer_dims)

    def reduce(self, grads: dict) -> dict:
        """Sum this device's partial gradients over the axes each parameter is replicated
        over, in :attr:`reduce_dtype`: all-reduce (stage 0, and unsplit
        leaves), reduce-scatter onto the zero dim (stage 1, FSDP's non-layer parameters),
        nothing over ``data`` for what was reduced in the backward loop (FSDP's layer
        parameters; stage 1's in-loop slices are only cut out here). The result is fp32,
        laid out by :attr:`moment_specs`."""
        def reduce(lf, g):
            if self.reduced_in_loop(lf) and not self.fsdp(lf):
                if self.sharded(lf):  # this rank's reduced slice, zeros elsewhere
                    g = self._rank_slice(lf, g)
                axes = tuple(a for a in lf.reduce if a != DATA)
                return (lax.psum(g, axes) if axes else g).astype(jnp.float32)
            axes = lf.reduce
            if self.partial_after_gather(lf) or axes:
                g = g.astype(self.reduce_dtype)
            if self.partial_after_gather(lf):
                g = lax.psum_scatter(g, DATA, scatter_dimension=lf.dim, tiled=True)
                axes = tuple(a for a in axes if a != DATA)
            return (lax.psum(g, axes) if axes else g).astype(jnp.float32)
        return self._map(reduce, grads)

    def local_slice(self, params: dict) -> dict:
        """Stage 1: this data rank's slice of each (replicated) parameter, the part it
        updates; identity otherwise."""
        return self._map(lambda lf, p: self._rank_slice(lf, p)
                         if self.stage == 1 and lf.dim is not None else p, params)

    def _rank_slice(self, lf: Leaf, x: jax.Array) -> jax.Array:
        """This data rank's slice of ``x`` on the zero dim."""
        n = x.shape[lf.dim] // self.data
        return lax.dynamic_slice_in_dim(x, lax.axis_index(DATA) * n, n, axis=lf.dim)

    def gather_slices(self, params: dict) -> dict:
        """Stage 1: all-gather the updated slices into replicated parameters (inverse of
        :meth:`local_slice`); identity otherwise."""
        def gather(lf, p):
            if self.stage != 1 or lf.dim is None:
                return p
            return lax.all_gather(p, DATA, axis=lf.dim, tiled=True, to="invarying")
        return self._map(gather, params)

    def global_norm(self, grads: dict, riders: jax.Array | None = None):
        """The global L2 norm of gradients laid out by :attr:`moment_specs` (one scalar
        all-reduce over the region's axes): each element counted once, replicas masked out.

        ``riders``: a small fp32 vector per device (varying over the region's axes, e.g. the
        stop flags) summed over every device in the same all-reduce; then returns
        ``(norm, summed riders)``."""
        axes = region_axes(self.mesh_shape)

        def local(lf, g):
            s = jnp.sum(jnp.square(g.astype(jnp.float32)))
            spec = _with_data(lf.spec, lf.dim, lf.ndim) if self.sharded(lf) else lf.spec
            used = {a for e in spec for a in entry_axes(e)}
            for a in axes:
                if a not in used and self.mesh_shape[a] > 1:  # replicated: count rank 0's
                    s = jnp.where(lax.axis_index(a) == 0, s, 0.0)
            return s
        parts = jax.tree.leaves(self._map(local, grads))
        total = varying(sum(parts[1:], parts[0]), axes)
        if riders is None:
            return jnp.sqrt(lax.psum(total, axes) if axes else total)
        both = jnp.concatenate([total[None], riders.reshape(-1).astype(jnp.float32)])
        both = lax.psum(both, axes) if axes else both
        return jnp.sqrt(both[0]), both[1:]
