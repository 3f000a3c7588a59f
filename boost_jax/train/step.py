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

from boost_jax.parallel.plans.base import DATA
from boost_jax.parallel.runner import ShardedModel


def _shapes(model: ShardedModel, tx: optax.GradientTransformation, canonical: bool) -> dict:
    params = model.param_shapes(canonical)
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
            "opt_state": jax.eval_shape(tx.init, params)}


def zero_spec(spec: P, shape: tuple[int, ...], data: int) -> P:
    """ZeRO-1: also split an optimizer moment over ``data``, on its first dimension that is
    not split yet and divides evenly (moments too small to split stay replicated)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, (entry, size) in enumerate(zip(entries, shape)):
        if entry is None and size % data == 0:
            entries[i] = DATA
            return P(*entries)
    return spec


def state_shardings(model: ShardedModel, tx: optax.GradientTransformation,
                    canonical: bool = False) -> dict:
    """Shardings of the state: parameters by the plan, optimizer moments like their parameter
    (and, with ``Parallel.zero=1``, split over ``data`` too), scalars replicated.
    ``canonical``: block parameters in the checkpoint layout ``[L, ...]``."""
    mesh, data = model.mesh, model.parallel.data
    replicated = NamedSharding(mesh, P())
    params = model.canonical_shardings if canonical else model.param_shardings

    def moment(shape, sharding):
        if model.parallel.zero == 1:
            return NamedSharding(mesh, zero_spec(sharding.spec, shape.shape, data))
        return sharding

    opt = optax.tree_map_params(tx, moment, _shapes(model, tx, canonical)["opt_state"], params,
                                transform_non_params=lambda _: replicated)
    return {"step": replicated, "params": params, "opt_state": opt}


def abstract_state(model: ShardedModel, tx: optax.GradientTransformation,
                   canonical: bool = False) -> dict:
    """ShapeDtypeStructs (with shardings) of the state; ``canonical=True`` gives the layout
    checkpoints hold."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        _shapes(model, tx, canonical), state_shardings(model, tx, canonical))


def to_checkpoint_layout(model: ShardedModel, tx: optax.GradientTransformation, state: dict):
    """The state in the canonical block layout (a copy; the identity unless the schedule is
    circular)."""
    if model.repeats == 1:
        return state
    out = state_shardings(model, tx, canonical=True)
    return jax.jit(model.to_canonical, out_shardings=out)(state)


def from_checkpoint_layout(model: ShardedModel, tx: optax.GradientTransformation, state: dict):
    if model.repeats == 1:
        return state
    return jax.jit(model.from_canonical, out_shardings=state_shardings(model, tx))(state)


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
