"""Train state, its shardings, and the jitted train / eval steps.

The state is a plain dict ``{"step": int32[], "params": ..., "opt_state": ...}``. Parameters
are fp32 and placed by the model's layout (the plan's PartitionSpecs, split over ``data`` too
under FSDP); the optimizer moments by the zero layout's moment specs (split over ``data`` at
``Parallel.zero`` 1 and 3); the optimizer's scalars are replicated.

The train step of the explicit plans runs per device, whole, in one ``shard_map`` region
(``ShardedModel.region``): ``Parallel.grad_accum`` micro-steps of gradients summed in fp32
(a ``lax.scan``), their reduction over ``data`` as the zero stage says, the global norm (one
scalar all-reduce), clipping, the AdamW update of this device's slice and, at stage 1, the
all-gather of the updated slices. The state is donated, so parameters and moments are updated
in place and no gradient buffer crosses a region boundary. The GSPMD baseline runs the same
steps as one global program under ``jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax import compat
from boost_jax.models.batch import batch_keys, group_denominators, token_count
from boost_jax.operations.signals import STOP_SIGNALS
from boost_jax.optim.optimizer import Optimizer, clip_by_norm
from boost_jax.parallel.plans.base import DATA, MESH_AXES
from boost_jax.parallel.runner import BATCH_SPEC, ShardedModel


def _batch_specs(batch: dict) -> dict:
    """Every array of a batch (models/batch.py) is split on ``data`` by rows."""
    return {k: BATCH_SPEC for k in batch}


def _shapes(model: ShardedModel, opt: Optimizer, canonical: bool) -> dict:
    params = model.param_shapes(canonical)
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
            "opt_state": jax.eval_shape(opt.tx.init, params)}


def state_specs(model: ShardedModel, opt: Optimizer, canonical: bool = False) -> dict:
    """PartitionSpecs of the state: parameters by the model's layout, optimizer moments by
    the zero layout's moment specs, scalars replicated. ``canonical``: block parameters in
    the checkpoint layout ``[L, ...]``."""
    layout = model.canonical_layout if canonical else model.layout
    opt_state = optax.tree_map_params(
        opt.tx, lambda _, spec: spec, _shapes(model, opt, canonical)["opt_state"],
        layout.moment_specs, transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P))
    return {"step": P(), "params": layout.param_specs, "opt_state": opt_state}


def state_shardings(model: ShardedModel, opt: Optimizer, canonical: bool = False) -> dict:
    return model.named(state_specs(model, opt, canonical))


def abstract_state(model: ShardedModel, opt: Optimizer, canonical: bool = False) -> dict:
    """ShapeDtypeStructs (with shardings) of the state; ``canonical=True`` gives the layout
    checkpoints hold."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        _shapes(model, opt, canonical), state_shardings(model, opt, canonical))


def to_checkpoint_layout(model: ShardedModel, opt: Optimizer, state: dict):
    """The state in the canonical block layout (a copy; the identity unless the schedule is
    circular)."""
    if model.repeats == 1:
        return state
    out = state_shardings(model, opt, canonical=True)
    return jax.jit(model.to_canonical, out_shardings=out)(state)


def from_checkpoint_layout(model: ShardedModel, opt: Optimizer, state: dict):
    if model.repeats == 1:
        return state
    return jax.jit(model.from_canonical, out_shardings=state_shardings(model, opt))(state)


def init_state(model: ShardedModel, opt: Optimizer, seed: int) -> dict:
    params = model.init(seed)
    shardings = state_shardings(model, opt)
    opt_state = jax.jit(opt.tx.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"step": step, "params": params, "opt_state": opt_state}


# --- gradients -----------------------------------------------------------------------------
def _zeros(like: jax.ShapeDtypeStruct) -> jax.Array:
    """fp32 zeros of ``like``'s shape, varying over the mesh axes ``like`` varies over (a
    ``lax.scan`` carry must keep its type)."""
    zeros = jnp.zeros(like.shape, jnp.float32)
    axes = tuple(sorted(compat.varying_axes(like)))
    return lax.pcast(zeros, axes, to="varying") if axes else zeros


def accumulate(grad_fn, params, batch: dict, steps: int):
    """``grad_fn(params, batch) -> (loss, grads)`` summed over ``steps`` micro-steps in a
    ``lax.scan`` (fp32 sums); micro-step ``i`` takes rows ``i, i + steps, ...`` of every
    ``[b, s]`` array of ``batch``, so only one micro-step's activations are alive at a
    time."""
    if steps == 1:
        return grad_fn(params, batch)

    def micro(x):  # [b, s] -> [steps, b / steps, s]
        return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)

    batches = jax.tree.map(micro, batch)

    def body(total, micro_batch):
        out = grad_fn(params, micro_batch)
        return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), total, out), None

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda b: b[0], batches))
    total, _ = lax.scan(body, jax.tree.map(_zeros, shapes), batches)
    return total


def global_token_count(model: ShardedModel, batch: dict) -> int | jax.Array:
    """Per device: the step's count of tokens that count in the loss, from this data shard's
    ``batch`` -- a constant for unpacked rows; for packed rows one scalar all-reduce over
    ``data``."""
    count, data = token_count(batch), model.mesh.shape[DATA]
    if data == 1:
        return count
    return count * data if isinstance(count, int) else lax.psum(count, DATA)


#: the batch key under which :func:`local_grads` carries per-row loss denominators
_DENOMINATOR = "loss_denominator"


def _grad_fn(loss_fn, batch: dict, n_tokens, group_rows: int | None, groups: int):
    """``(batch, grad_fn)``: ``grad_fn(p, b) -> (loss, grads)`` of ``loss_fn(p, b, n)``, with
    ``n`` the step's token count, or with ``group_rows`` per-row denominators carried in the
    batch (so micro-steps take them with their rows; models/batch.py
    :func:`~boost_jax.models.batch.group_denominators`)."""
    if group_rows is None:
        return batch, lambda p, b: jax.value_and_grad(loss_fn)(p, b, n_tokens)
    batch = {**batch, _DENOMINATOR: group_denominators(batch, group_rows, groups)}

    def grad_fn(p, b):
        b = dict(b)
        return jax.value_and_grad(loss_fn)(p, b, b.pop(_DENOMINATOR))

    return batch, grad_fn


def local_grads(model: ShardedModel, params: dict, batch: dict,
                group_rows: int | None = None) -> tuple[jax.Array, dict]:
    """Per device, inside the region: the mean loss of the global step and its gradients
    with respect to ``params`` (stored layout), accumulated over ``Parallel.grad_accum``
    micro-steps and reduced over ``data`` by the zero stage (laid out by
    ``model.layout.moment_specs``). ``batch``: this data shard's rows. ``group_rows``
    (``Train.loss_group_rows``): the loss is the mean of the token means of groups of that
    many consecutive rows (which divides this shard's rows) instead of the token mean."""
    return _local_grads(model, params, batch, group_rows)[:2]


def _local_grads(model: ShardedModel, params: dict, batch: dict, group_rows: int | None
                 ) -> tuple[jax.Array, dict, int | jax.Array]:
    """:func:`local_grads`, and the step's global count of tokens that count."""
    n_tokens = global_token_count(model, batch)
    groups = batch["inputs"].shape[0] * model.mesh.shape[DATA] // (group_rows or 1)
    batch, grad_fn = _grad_fn(model.local_loss, batch, n_tokens, group_rows, groups)

    layout = model.layout
    # FSDP: the non-layer parameters gathered in the compute dtype (the loss casts them to it
    # anyway, so the gradients are the same)
    params = layout.differentiable(layout.gather_globals(params, model.dtype))
    loss, grads = accumulate(grad_fn, params, batch, model.parallel.grad_accum)
    if model.loss_axes:
        loss = lax.psum(loss, model.loss_axes)
    return loss, layout.reduce(grads), n_tokens


def global_grads(model: ShardedModel, params: dict, batch: dict,
                 group_rows: int | None = None) -> tuple[jax.Array, dict]:
    """The GSPMD baseline's loss and gradients (global arrays, plain ``jit``)."""
    groups = batch["inputs"].shape[0] // (group_rows or 1)
    batch, grad_fn = _grad_fn(model.loss, batch, token_count(batch), group_rows, groups)
    return accumulate(grad_fn, params, batch, model.parallel.grad_accum)


def make_grad_fn(model: ShardedModel, group_rows: int | None = None):
    """``grads(params, batch) -> (loss, grads)``, jitted: the train step's gradients before
    clipping, laid out like the optimizer moments (for tests and analysis); ``group_rows``:
    ``Train.loss_group_rows``."""
    out = (P(), model.layout.moment_specs)
    if model.gspmd:
        fn = functools.partial(global_grads, model, group_rows=group_rows)
    else:
        def fn(params, batch):
            return model.region(functools.partial(local_grads, model, group_rows=group_rows),
                                (model.param_specs, _batch_specs(batch)), out)(params, batch)
    return jax.jit(fn, in_shardings=(model.param_shardings, model.batch_sharding),
                   out_shardings=model.named(out))


# --- the agreed stop ------------------------------------------------------------------------
STOP_SPEC = P(MESH_AXES, None)  # one row per device


def stop_flags(model: ShardedModel, signum: int | None = None) -> jax.Array:
    """The train step's stop input: fp32 ``[devices, len(STOP_SIGNALS)]``, one row per device
    (split over every mesh axis), one-hot of the signal this process received (zeros for
    none). The step sums the rows in the gradient norm's all-reduce, so every process reads
    the same ``stop_signal`` in the step's metrics and stops at the same step."""
    row = np.zeros(len(STOP_SIGNALS), np.float32)
    if signum is not None:
        row[STOP_SIGNALS.index(signum)] = 1.0
    shape = (model.mesh.size, len(STOP_SIGNALS))
    return jax.make_array_from_callback(shape, NamedSharding(model.mesh, STOP_SPEC),
                                        lambda index: row[None])


def _agreed_signal(counts: jax.Array) -> jax.Array:
    """The first of :data:`STOP_SIGNALS` some device was flagged with, else 0 (int32)."""
    raised = counts > 0
    signals = jnp.asarray(STOP_SIGNALS, jnp.int32)
    return jnp.where(jnp.any(raised), signals[jnp.argmax(raised)], 0)


# --- the train step ------------------------------------------------------------------------
def _apply_if(finite: jax.Array, apply: Callable, *state):
    """``apply(*state)`` if ``finite`` (a boolean scalar computed on the device), else
    ``state`` unchanged -- chosen per platform when the step is lowered
    (``lax.platform_dependent``; the compiler never sees both):

    * CPU: a conditional. XLA:CPU runs it on the host thread anyway and updates the donated
      state in place inside the branch; with a select it copies parameter- and moment-sized
      buffers (more temporary memory, measured on the compiled step).
    * GPU (any other platform): a select per leaf, elementwise work XLA can fuse into the
      update's kernels (whether XLA:GPU then copies any buffer is not yet measured on a GPU).
      XLA:GPU runs a conditional by copying its predicate to the host and waiting for it: the
      host would stall until the step's gradient norm exists before it could launch the
      update or queue the next step.
    """
    def cond(finite, *state):
        return lax.cond(finite, apply, lambda *x: x, *state)

    def select(finite, *state):
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), apply(*state), state)

    return lax.platform_dependent(finite, *state, cpu=cond, default=select)


def _update(model: ShardedModel, opt: Optimizer, state: dict, loss, grads, norm,
            stop_counts, tokens) -> tuple:
    """Clip, AdamW on this device's slice of the parameters, gather the slices -- unless the
    loss or the gradient norm is not finite: then parameters and optimizer state stay as
    they were (the step counter advances, the optimizer's count does not, and ``nonfinite``
    in the metrics is 1). ``lr`` in the metrics is the learning rate of this update, read at
    the optimizer's count (:meth:`Optimizer.lr`); on a skipped step, the rate it would have
    applied, which the next update applies. ``stop_counts``: the devices flagged with each of
    :data:`STOP_SIGNALS`, summed; ``tokens``: the step's tokens that count in the loss."""
    layout = model.layout if not model.gspmd else None
    params = state["params"] if layout is None else layout.local_slice(state["params"])

    def apply(params, opt_state):
        updates, opt_state = opt.tx.update(clip_by_norm(grads, norm, opt.max_norm), opt_state,
                                           params)
        return optax.apply_updates(params, updates), opt_state

    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    params, opt_state = _apply_if(finite, apply, params, state["opt_state"])
    if layout is not None:
        params = layout.gather_slices(params)
    metrics = {"loss": loss, "grad_norm": norm, "lr": opt.lr(state["opt_state"]),
               "nonfinite": 1 - finite.astype(jnp.int32),
               "stop_signal": _agreed_signal(stop_counts),
               "tokens": jnp.asarray(tokens, jnp.int32)}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def make_train_step(model: ShardedModel, opt: Optimizer, group_rows: int | None = None):
    """``step(state, batch, stop) -> (state, metrics)``, jitted with the state donated;
    ``group_rows``: ``Train.loss_group_rows`` (:func:`local_grads`).

    ``batch`` holds global int32 ``[batch, seq]`` arrays sharded on ``data``
    (models/batch.py: ``inputs``/``targets``, and the packing keys for packed rows); ``stop``
    is :func:`stop_flags`. Metrics are replicated scalars: loss, grad_norm (before clipping),
    lr (the learning rate applied by this step's update, see :func:`_update`), nonfinite,
    stop_signal (the agreed signal number, 0 for none) and tokens (the targets that count in
    the loss: padding excluded).
    """
    specs = state_specs(model, opt)
    if model.gspmd:
        def step(state, batch, stop):
            loss, grads = global_grads(model, state["params"], batch, group_rows)
            return _update(model, opt, state, loss, grads, optax.global_norm(grads),
                           jnp.sum(stop, axis=0), token_count(batch))
    else:
        def local_step(state, batch, stop):
            loss, grads, tokens = _local_grads(model, state["params"], batch, group_rows)
            norm, counts = model.layout.global_norm(grads, riders=stop)
            return _update(model, opt, state, loss, grads, norm, counts, tokens)

        def step(state, batch, stop):
            return model.region(local_step, (specs, _batch_specs(batch), STOP_SPEC),
                                (specs, P()))(state, batch, stop)
    return jax.jit(step, in_shardings=(model.named(specs), model.batch_sharding,
                                       NamedSharding(model.mesh, STOP_SPEC)),
                   out_shardings=(model.named(specs), model.named(P())),
                   donate_argnums=0)


def abstract_batch(model: ShardedModel, batch_size: int, seq_len: int, packed: bool = False
                   ) -> dict:
    """ShapeDtypeStructs of a global batch (int32 ``[batch_size, seq_len]`` arrays on
    ``data``; with the packing keys if ``packed``)."""
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32,
                                    sharding=model.batch_sharding) for k in batch_keys(packed)}


def compile_train_step(model: ShardedModel, opt: Optimizer, batch_size: int, seq_len: int,
                       packed: bool = False, compiler_options: dict[str, str] | None = None,
                       group_rows: int | None = None):
    """The train step compiled ahead of time for abstract inputs (no data, no parameters);
    ``compiler_options``: XLA options for this compile (``{"xla_gpu_...": "true"}``), over
    ``XLA_FLAGS``; ``group_rows``: ``Train.loss_group_rows``."""
    stop = jax.ShapeDtypeStruct((model.mesh.size, len(STOP_SIGNALS)), jnp.float32,
                                sharding=NamedSharding(model.mesh, STOP_SPEC))
    return make_train_step(model, opt, group_rows).lower(
        abstract_state(model, opt), abstract_batch(model, batch_size, seq_len, packed),
        stop).compile(compiler_options=compiler_options)
