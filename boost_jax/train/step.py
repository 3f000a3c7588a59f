"""Train state, its shardings, and the jitted train / eval steps.

The state is a plain dict ``{"step": int32[], "params": ..., "opt_state": ...}``; parameters are
fp32 and placed by the plan's PartitionSpecs, the optimizer moments mirror them, and the
optimizer's scalars are replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.parallel.runner import ShardedModel


def _shapes(model: ShardedModel, tx: optax.GradientTransformation) -> dict:
    params = model.param_shapes()
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
            "opt_state": jax.eval_shape(tx.init, params)}


def state_shardings(model: ShardedModel, tx: optax.GradientTransformation) -> dict:
    """Shardings of the state: parameters and optimizer moments by the plan, scalars
    replicated."""
    replicated = NamedSharding(model.mesh, P())
    opt = optax.tree_map_params(tx, lambda _, sharding: sharding, _shapes(model, tx)["opt_state"],
                                model.param_shardings, transform_non_params=lambda _: replicated)
    return {"step": replicated, "params": model.param_shardings, "opt_state": opt}


def abstract_state(model: ShardedModel, tx: optax.GradientTransformation) -> dict:
    """ShapeDtypeStructs (with shardings) of the state: the restore target for checkpoints."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        _shapes(model, tx), state_shardings(model, tx))


def init_state(model: ShardedModel, tx: optax.GradientTransformation, seed: int) -> dict:
    params = model.init(seed)
    shardings = state_shardings(model, tx)
    opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"step": step, "params": params, "opt_state": opt_state}


def make_train_step(model: ShardedModel, tx: optax.GradientTransformation,
                    schedule: optax.Schedule):
    """``step(state, batch) -> (state, metrics)``, jitted with the state donated.

    ``batch`` holds global int32 ``inputs``/``targets`` ``[batch, seq]`` sharded on ``data``;
    metrics are replicated scalars: loss, grad_norm (before clipping) and lr.
    """
    shardings = state_shardings(model, tx)
    batch_shardings = {"inputs": model.batch_sharding, "targets": model.batch_sharding}
    replicated = NamedSharding(model.mesh, P())

    def step(state, batch):
        loss, grads = jax.value_and_grad(model.loss)(state["params"], batch["inputs"],
                                                     batch["targets"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
                   "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return jax.jit(step, in_shardings=(shardings, batch_shardings),
                   out_shardings=(shardings, replicated), donate_argnums=0)


def abstract_batch(model: ShardedModel, batch_size: int, seq_len: int) -> dict:
    """ShapeDtypeStructs of a global batch (``inputs``/``targets`` int32 on ``data``)."""
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32,
                                    sharding=model.batch_sharding) for k in ("inputs", "targets")}


def compile_train_step(model: ShardedModel, tx: optax.GradientTransformation,
                       schedule: optax.Schedule, batch_size: int, seq_len: int):
    """The train step compiled ahead of time for abstract inputs (no data, no parameters)."""
    return make_train_step(model, tx, schedule).lower(
        abstract_state(model, tx), abstract_batch(model, batch_size, seq_len)).compile()


def make_eval_step(model: ShardedModel):
    """``eval_step(params, batch) -> mean loss`` of one global batch."""
    replicated = NamedSharding(model.mesh, P())
    batch_shardings = {"inputs": model.batch_sharding, "targets": model.batch_sharding}
    return jax.jit(lambda params, batch: model.loss(params, batch["inputs"], batch["targets"]),
                   in_shardings=(model.param_shardings, batch_shardings),
                   out_shardings=replicated)
