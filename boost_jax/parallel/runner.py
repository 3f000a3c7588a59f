"""The decoder placed on a mesh: parameter shardings and the ``jax.shard_map`` region.

:class:`ShardedModel` builds the one shard_map region that runs the decoder per device for the
configured plan. Its ``in_specs`` are the plan's parameter PartitionSpecs (block parameters
split over ``pipe`` when pipelining) and the batch split on ``data``; everything inside is the
single model definition (models/decoder.py), run directly or through the pipeline schedule
(parallel/pipeline.py). Gradients come from JAX's transpose rules. Each parameter is marked as
varying over the ``data`` (and, unless split over it, ``pipe``) axes once, in fp32, at the top
of the region, so the data-parallel gradient reduction is one fp32 all-reduce per step after
the backward pass (the transpose of that cast), not one per layer in the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.config import ConfigError, Model, Parallel
from boost_jax.models.decoder import abstract_model, bind
from boost_jax.models.init import STACKED, init_params, unflatten
from boost_jax.parallel.pipeline import canonical_layout, pipeline_token_loss, stage_layout
from boost_jax.parallel.plans import get_plan
from boost_jax.parallel.plans.base import DATA, PIPE, Plan

BATCH_SPEC = P(DATA, None)


def map_blocks(tree, fn):
    """Apply ``fn`` to the leaves under a ``blocks`` key (params, optimizer moments, specs)."""
    def leaf(path, x):
        return fn(x) if any(getattr(k, "key", None) == STACKED for k in path) else x
    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, P))


class ShardedModel:
    """The decoder for ``model`` laid out on ``mesh`` by the plan of ``parallel`` (or, with
    ``gspmd=True``, only its parameter shardings, for the GSPMD baseline).

    Block parameters live in the pipeline's stage layout (``[R, L/R, ...]`` for the circular
    schedule, else ``[L, ...]``); checkpoints hold the canonical ``[L, ...]`` layout
    (:meth:`to_canonical` / :meth:`from_canonical`).

    Args:
      model, parallel: configs.
      mesh: the ``(data, pipe, tensor)`` mesh.
      dtype: compute dtype (parameters stay fp32 and are cast inside the region).
    """

    def __init__(self, model: Model, parallel: Parallel, mesh: Mesh, dtype=jnp.float32,
                 gspmd: bool = False):
        self.cfg, self.parallel, self.mesh, self.dtype = model, parallel, mesh, jnp.dtype(dtype)
        self.plan = get_plan(parallel)
        #: the baseline a JAX user has for free: the plan's parameter shardings only, the model
        #: run as one global program under jit, and GSPMD choosing every collective
        self.gspmd = gspmd
        if gspmd and (parallel.pipe > 1 or parallel.microbatches > 1):
            raise ConfigError("the GSPMD baseline runs without a pipeline (Parallel.pipe=1, "
                              "microbatches=1)")
        self.graph, self.defs = abstract_model(model)
        self.pipelined = parallel.pipe > 1 or parallel.microbatches > 1
        self.repeats = parallel.repeats
        canonical = {p: self.plan.spec(d.axes) for p, d in self.defs.items()}
        if parallel.pipe > 1:  # each stage holds its layers
            canonical = {p: P(PIPE, *s[1:]) if self.defs[p].stacked else s
                         for p, s in canonical.items()}
        self.canonical_specs = unflatten(canonical)
        self.param_specs = map_blocks(self.canonical_specs, self._stage_spec)
        self.param_shardings = self._named(self.param_specs)
        self.canonical_shardings = self._named(self.canonical_specs)
        self.batch_sharding = NamedSharding(mesh, BATCH_SPEC)

    def _named(self, specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def _stage_spec(self, spec: P) -> P:
        return spec if self.repeats == 1 else P(None, *spec)

    def param_shapes(self, canonical: bool = False) -> dict:
        """``ShapeDtypeStruct`` (global shape, fp32) of every parameter, as a nested dict."""
        shapes = unflatten({p: jax.ShapeDtypeStruct(d.shape, jnp.float32)
                            for p, d in self.defs.items()})
        if canonical:
            return shapes
        return map_blocks(shapes, lambda s: jax.eval_shape(
            lambda x: stage_layout(x, self.repeats), s))

    def to_canonical(self, tree):
        """Stage layout -> canonical ``[L, ...]`` for every ``blocks`` leaf of ``tree``."""
        return map_blocks(tree, lambda x: canonical_layout(x, self.repeats))

    def from_canonical(self, tree):
        return map_blocks(tree, lambda x: stage_layout(x, self.repeats))

    def init(self, seed: int) -> dict:
        """Global fp32 parameters from ``(seed, path)``, placed with the plan's shardings (the
        same values on any mesh and in any pipeline layout)."""
        return init_params(self.defs, seed, self.param_shardings, transform=self.from_canonical)

    def _region(self, fn, out_specs):
        in_specs = (self.param_specs, BATCH_SPEC, BATCH_SPEC)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def _varying(self, params: dict) -> dict:
        """Cast each parameter to 'varying' over the data (and pipe) axes it is not split on."""
        def cast(p, spec):
            axes = tuple(a for a in (DATA, PIPE) if a not in spec and self.mesh.shape[a] > 1)
            return jax.lax.pcast(p, axes, to="varying") if axes else p
        return jax.tree.map(cast, params, self.param_specs)

    def loss(self, params: dict, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy over the global batch (``inputs``, ``targets``:
        int ``[batch, seq]`` on ``data``)."""
        n_tokens = math.prod(inputs.shape)
        par = self.parallel
        if self.gspmd:
            model = bind(self.cfg, params, self.dtype)
            local = Plan(self.plan.grouped, self.plan.remat)
            return jnp.sum(model.token_loss(inputs, targets, local)) / n_tokens

        def local(params, inputs, targets):
            model = bind(self.cfg, self._varying(params), self.dtype)
            if self.pipelined:  # the loss lives on the last stage
                per_token = pipeline_token_loss(model, self.plan, inputs, targets,
                                                par.microbatches, self.repeats)
                return jax.lax.psum(jnp.sum(per_token), (DATA, PIPE)) / n_tokens
            per_token = model.token_loss(inputs, targets, self.plan)
            return jax.lax.psum(jnp.sum(per_token), DATA) / n_tokens

        return self._region(local, P())(params, inputs, targets)

    def logits(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Logits ``[batch, seq, vocab]`` in fp32 (batch on ``data``; no pipeline)."""
        if self.pipelined:
            raise NotImplementedError("logits() runs the model unpipelined; under pipeline "
                                      "parallelism use loss()")

        def local(params, tokens, _):
            model = bind(self.cfg, params, self.dtype)
            return model.logits(tokens, self.plan)

        return self._region(local, P(DATA, None, self.plan.rules.get("vocab")))(params, tokens,
                                                                               tokens)
