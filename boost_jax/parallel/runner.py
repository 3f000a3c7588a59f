"""The decoder placed on a mesh: parameter shardings and the ``jax.shard_map`` region.

:class:`ShardedModel` builds the one shard_map region that runs the decoder per device for the
configured plan. Its ``in_specs`` are the plan's parameter PartitionSpecs and the batch split on
``data``; everything inside is the single model definition (models/decoder.py). Gradients come
from JAX's transpose rules: replicated parameters receive the sum of their cotangents over
``data`` automatically (the data-parallel reduction).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.config import Model, Parallel
from boost_jax.models.decoder import abstract_model, bind
from boost_jax.models.init import init_params, unflatten
from boost_jax.parallel.plans import get_plan
from boost_jax.parallel.plans.base import DATA

BATCH_SPEC = P(DATA, None)


def _data_varying(params: dict) -> dict:
    return jax.tree.map(lambda p: jax.lax.pcast(p, (DATA,), to="varying"), params)


class ShardedModel:
    """The decoder for ``model`` laid out on ``mesh`` by the plan of ``parallel``.

    Args:
      model, parallel: configs.
      mesh: the ``(data, pipe, tensor)`` mesh.
      dtype: compute dtype (parameters stay fp32 and are cast inside the region).
    """

    def __init__(self, model: Model, parallel: Parallel, mesh: Mesh, dtype=jnp.float32):
        self.cfg, self.parallel, self.mesh, self.dtype = model, parallel, mesh, jnp.dtype(dtype)
        self.plan = get_plan(parallel)
        self.graph, self.defs = abstract_model(model)
        self.param_specs = unflatten({p: self.plan.spec(d.axes) for p, d in self.defs.items()})
        self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.param_specs)
        self.batch_sharding = NamedSharding(mesh, BATCH_SPEC)

    def param_shapes(self) -> dict:
        """``ShapeDtypeStruct`` (global shape, fp32) of every parameter, as a nested dict."""
        return unflatten({p: jax.ShapeDtypeStruct(d.shape, jnp.float32)
                          for p, d in self.defs.items()})

    def init(self, seed: int) -> dict:
        """Global fp32 parameters from ``(seed, path)``, placed with the plan's shardings."""
        return init_params(self.defs, seed, self.param_shardings)

    def _region(self, fn, out_specs):
        in_specs = (self.param_specs, BATCH_SPEC, BATCH_SPEC)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def loss(self, params: dict, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy over the global batch (``inputs``, ``targets``:
        int ``[batch, seq]`` on ``data``)."""
        n_tokens = math.prod(inputs.shape)

        def local(params, inputs, targets):
            model = bind(self.cfg, _data_varying(params), self.dtype)
            per_token = model.token_loss(inputs, targets, self.plan)
            return jax.lax.psum(jnp.sum(per_token), DATA) / n_tokens

        return self._region(local, P())(params, inputs, targets)

    def logits(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Logits ``[batch, seq, vocab]`` in fp32 (batch on ``data``)."""
        def local(params, tokens, _):
            model = bind(self.cfg, params, self.dtype)
            return model.logits(tokens, self.plan)

        return self._region(local, P(DATA, None, self.plan.rules.get("vocab")))(params, tokens,
                                                                               tokens)
