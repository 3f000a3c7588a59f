"""The decoder placed on a mesh: where every parameter lives, and the ``jax.shard_map`` regions.

:class:`ShardedModel` lays the parameter tree (models/init.py: definitions, shapes, specs from
a plan's rules) out on the mesh -- the plan's PartitionSpecs (block parameters split over
``pipe`` when pipelining) and the ``Parallel.zero`` layout over ``data`` (parallel/zero.py) --
builds the plan once with what it decides (parallel/plans), and builds the ``shard_map``
regions that run per device: the global loss (eval, and the GSPMD baseline's gradients), and
any per-device function over the whole mesh (:meth:`ShardedModel.region`: the train step of
train/step.py, gradients, clipping and AdamW included, so no gradient ever leaves the region).
Inside, everything is the single model definition (models/decoder.py), run directly or through
the pipeline schedule (parallel/pipeline.py). Gradients come from JAX's transpose rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.models.attention import Segments, packed_slots, resolve_attention
from boost_jax.models.batch import loss_share, row_sums, segments, token_count
from boost_jax.models.boundaries import Plan
from boost_jax.models.config import Model
from boost_jax.models.decoder import Decoder, abstract_model, bind
from boost_jax.models.execution import Execution
from boost_jax.models.init import STACKED, init_params, map_blocks, param_shapes, param_specs
from boost_jax.parallel.config import Parallel
from boost_jax.parallel.pipeline import canonical_layout, pipeline_token_loss, stage_layout
from boost_jax.parallel.plans import PLANS, get_plan
from boost_jax.parallel.plans.base import (
    DATA,
    MESH_AXES,
    PIPE,
    as_entry,
    entry_axes,
    region_axes,
)
from boost_jax.parallel.zero import DataLayout

BATCH_SPEC = P(DATA, None)


def plan_specs(model: Model, parallel: Parallel) -> dict:
    """The plan's PartitionSpec of every parameter in the canonical layout (block parameters
    ``[L, ...]``, split over ``pipe`` on the layer axis when pipelining), as a nested dict."""
    return param_specs(abstract_model(model)[1], PLANS[parallel.tp_plan].spec,
                       PIPE if parallel.pipe > 1 else None)


def canonical_shapes(model: Model) -> dict:
    """``ShapeDtypeStruct`` (global shape, fp32) of every parameter, canonical layout."""
    return param_shapes(abstract_model(model)[1])


def data_layout(model: Model, parallel: Parallel) -> DataLayout:
    """The ``Parallel.zero`` layout of the canonical parameters (on a mesh of the configured
    shape; for analysis, nothing is placed). Cached: it depends on the mesh shape, the plan,
    the zero stage and where the gradients are reduced only, and the planner asks for it once
    per candidate layout."""
    return _data_layout(model, parallel.shape, parallel.tp_plan, parallel.zero,
                        reduces_in_loop(parallel))


@functools.lru_cache(maxsize=256)
def _data_layout(model: Model, shape: tuple[int, int, int], tp_plan: str, zero: int,
                 in_loop: bool) -> DataLayout:
    data, pipe, tensor = shape
    parallel = Parallel(data=data, pipe=pipe, tensor=tensor, tp_plan=tp_plan, zero=zero)
    return DataLayout(zero, dict(zip(MESH_AXES, shape)), plan_specs(model, parallel),
                      canonical_shapes(model), {STACKED: 1}, in_loop=in_loop)


def reduces_in_loop(parallel: Parallel) -> bool:
    """Is each layer's gradient complete in one backward pass over the layers (no
    accumulation; no pipeline or a GPipe one), so that zero stages 0 and 1 reduce it in the
    backward layer loop (parallel/zero.py)?"""
    return parallel.grad_accum == 1 and parallel.repeats == 1


class ShardedModel:
    """The decoder for ``model`` laid out on ``mesh`` by the plan and ``zero`` stage of
    ``parallel`` (or, with ``gspmd=True``, only its parameter shardings, for the GSPMD
    baseline).

    Block parameters live in the pipeline's stage layout (``[R, L/R, ...]`` for the circular
    schedule, else ``[L, ...]``); checkpoints hold the canonical ``[L, ...]`` layout
    (:meth:`to_canonical` / :meth:`from_canonical`).

    Args:
      model, parallel: configs.
      mesh: the ``(data, pipe, tensor)`` mesh.
      dtype: compute dtype (parameters stay fp32 and are cast inside the region).
      max_segments: ``Data.max_segments``, the packer's bound on documents per packed row
        (cuDNN's packed attention is built for it; ``None``: no bound, XLA for packed rows).
    """

    def __init__(self, model: Model, parallel: Parallel, mesh: Mesh, dtype=jnp.float32,
                 gspmd: bool = False, max_segments: int | None = None):
        self.cfg, self.parallel, self.mesh, self.dtype = model, parallel, mesh, jnp.dtype(dtype)
        #: the baseline a JAX user has for free: the parameter shardings only, the model run
        #: as one global program under jit, and GSPMD choosing every collective
        self.gspmd = gspmd
        if gspmd and parallel.pipe > 1:
            raise ConfigError("the GSPMD baseline runs without a pipeline (Parallel.pipe=1)")
        self.graph, self.defs = abstract_model(model)
        self.pipelined = parallel.pipe > 1
        self.repeats = parallel.repeats
        #: the zero layout of the parameters as checkpoints hold them / as they run
        self.canonical_layout = data_layout(model, parallel)
        self.layout = DataLayout(parallel.zero, dict(mesh.shape),
                                 map_blocks(plan_specs(model, parallel), self._stage_spec),
                                 self.param_shapes(), {STACKED: 2 if self.repeats > 1 else 1},
                                 parallel.reduce_dtype, in_loop=reduces_in_loop(parallel)
                                 and not gspmd)
        self.param_specs = self.layout.param_specs
        self.param_shardings = self.named(self.param_specs)
        self.batch_sharding = NamedSharding(mesh, BATCH_SPEC)
        self.fsdp = parallel.zero == 3 and not gspmd
        #: a per-layer hook of the zero layout: the stacked parameters are cast per layer
        self.per_layer = self.layout.per_layer and not gspmd
        #: where the collectives go (the ``tp_plan``, resolved for the mesh's devices)
        self.plan = get_plan(self.parallel, self.mesh.devices.flat[0])
        #: how the blocks run (models/execution.py)
        self.execution = self._execution(max_segments)

    def _execution(self, max_segments: int | None) -> Execution:
        """Built once with what this model decides: the remat policy, the attention
        implementation (``Parallel.attention``, the compute dtype, the platform), cuDNN's
        packed slots and the zero layout's per-layer hook."""
        attention, packed = resolve_attention(
            self.parallel.attention, self.dtype, self.mesh.devices.flat[0].platform,
            bounded=max_segments is not None)
        hook = dict(layer_hook=functools.partial(self.layout.layer_params, dtype=self.dtype),
                    layer_gathers=self.fsdp) if self.per_layer else {}
        return Execution(remat=self.parallel.remat, attention=attention,
                         packed_attention=packed,
                         segment_slots=None if max_segments is None else packed_slots(
                             max_segments), **hook)

    def named(self, specs):
        """``NamedSharding`` on this model's mesh for every PartitionSpec of ``specs``."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def _stage_spec(self, spec: P) -> P:
        return spec if self.repeats == 1 else P(None, *spec)

    def param_shapes(self, canonical: bool = False) -> dict:
        """``ShapeDtypeStruct`` (global shape, fp32) of every parameter, as a nested dict."""
        shapes = canonical_shapes(self.cfg)
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
        """Global fp32 parameters from ``(seed, path)``, placed with their shardings (the same
        values on any mesh and in any pipeline layout)."""
        return init_params(self.defs, seed, self.param_shardings, transform=self.from_canonical)

    # --- per device, inside a region -----------------------------------------------------
    def region(self, fn, in_specs, out_specs):
        """``fn`` run per device over the mesh (``jax.shard_map``). Specs are read without
        the ``data`` and ``pipe`` axes where those have size 1: a value split over a size-1
        axis would count as varying over it, and every reduction over it would be a real (if
        trivial) all-reduce -- one copy of each gradient buffer."""
        trivial = set(MESH_AXES) - set(region_axes(self.mesh.shape))

        def strip(spec: P) -> P:
            return P(*(as_entry([a for a in entry_axes(e) if a not in trivial]) for e in spec))

        def specs(tree):
            return jax.tree.map(strip, tree, is_leaf=lambda x: isinstance(x, P))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(in_specs),
                             out_specs=specs(out_specs))

    @property
    def loss_axes(self) -> tuple[str, ...]:
        """The axes a per-device loss is summed over (the loss lives on the last stage)."""
        return tuple(a for a in (DATA, PIPE) if self.mesh.shape[a] > 1)

    def bound(self, params: dict) -> Decoder:
        """The decoder holding this device's ``params`` -- stored layout, FSDP's non-layer
        parameters gathered (``layout.gather_globals``) -- cast to the compute dtype (with a
        per-layer hook, layer parameters are cast per layer by the execution's
        ``layer_params``)."""
        cast = lambda p: p.astype(self.dtype)  # noqa: E731
        if self.per_layer:
            params = {k: v if k == STACKED else jax.tree.map(cast, v) for k, v in params.items()}
        else:
            params = jax.tree.map(cast, params)
        return bind(self.cfg, params)

    def _token_loss(self, params: dict, batch: dict) -> jax.Array:
        """This device's per-token cross-entropies ``[b, s]`` of its data shard's rows (under
        the pipeline, of the tokens its stage computes, zero elsewhere)."""
        model = self.bound(params)
        inputs, targets, segs = batch["inputs"], batch["targets"], segments(batch)
        if self.pipelined:
            par = self.parallel
            return pipeline_token_loss(model, self.plan, self.execution, inputs, targets,
                                       par.microbatches, self.repeats, segs)
        return model.token_loss(inputs, targets, self.plan, segs, self.execution)

    def local_loss(self, params: dict, batch: dict, n_tokens: int | jax.Array) -> jax.Array:
        """This device's share of the mean loss: the sum of its tokens' cross-entropies over
        ``n_tokens`` (the step's global count of tokens that count, or per-row denominators
        ``[b, 1]``: models/batch.py :func:`~boost_jax.models.batch.loss_share`), zero on
        all but the last pipeline stage; summed over :attr:`loss_axes` it is the mean.
        ``batch``: this data shard's rows (int ``[b, s]`` each); ``params``: as for
        :meth:`bound`."""
        return loss_share(self._token_loss(params, batch), batch, n_tokens)

    def row_losses(self, params: dict, batch: dict) -> jax.Array:
        """fp32 ``[batch]`` (on ``data``): each row's sum of the cross-entropies of its tokens
        that count, for the global ``batch`` (evaluation: any grouping of rows is a host-side
        sum of these)."""
        if self.gspmd:
            model = bind(self.cfg, params, self.dtype)
            return row_sums(model.token_loss(batch["inputs"], batch["targets"],
                                             Plan(self.plan.grouped), segments(batch),
                                             self.execution), batch)

        def local(params, batch):
            params = self.layout.gather_globals(params, self.dtype)
            rows = row_sums(self._token_loss(params, batch), batch)
            return jax.lax.psum(rows, PIPE) if self.pipelined else rows

        specs = (self.param_specs, {k: BATCH_SPEC for k in batch})
        return self.region(local, specs, P(DATA))(params, batch)

    # --- whole-mesh functions --------------------------------------------------------------
    def loss(self, params: dict, batch: dict, n_tokens: int | jax.Array | None = None
             ) -> jax.Array:
        """Mean next-token cross-entropy over the global ``batch`` (int ``[batch, seq]``
        arrays on ``data``, models/batch.py), or its sum over ``n_tokens`` if given (a
        micro-step's share of a larger step's mean)."""
        n_tokens = token_count(batch) if n_tokens is None else n_tokens
        if self.gspmd:
            model = bind(self.cfg, params, self.dtype)
            # the explicit plan's grouping and execution (attention: cuDNN on a GPU for both,
            # else the baseline would run XLA's attention; remat), not its boundaries
            per_token = model.token_loss(batch["inputs"], batch["targets"],
                                         Plan(self.plan.grouped), segments(batch),
                                         self.execution)
            return loss_share(per_token, batch, n_tokens)

        def local(params, batch, n_tokens):
            # marked varying where replicated: a gradient taken from outside is then reduced
            # once per step, not once per use
            params = self.layout.differentiable(self.layout.gather_globals(params, self.dtype))
            share = self.local_loss(params, batch, n_tokens)
            return jax.lax.psum(share, self.loss_axes) if self.loss_axes else share

        specs = (self.param_specs, {k: BATCH_SPEC for k in batch})
        if isinstance(n_tokens, int):  # a constant of the program
            return self.region(functools.partial(local, n_tokens=n_tokens), specs, P())(
                params, batch)
        return self.region(local, (*specs, P()), P())(params, batch, n_tokens)

    def logits(self, params: dict, tokens: jax.Array, segments: Segments | None = None
               ) -> jax.Array:
        """Logits ``[batch, seq, vocab]`` in fp32 (batch on ``data``; no pipeline) of
        ``tokens`` (packed rows: with their ``segments``)."""
        if self.pipelined:
            raise NotImplementedError("logits() runs the model unpipelined; under pipeline "
                                      "parallelism use loss()")

        def local(params, tokens, *segments):
            model = self.bound(self.layout.gather_globals(params, self.dtype))
            return model.logits(tokens, self.plan, *segments, execution=self.execution)

        out = P(DATA, None, self.plan.rules.get("vocab"))
        args = (params, tokens) + (() if segments is None else (segments,))
        in_specs = (self.param_specs, BATCH_SPEC) + (Segments(BATCH_SPEC, BATCH_SPEC),) * (
            len(args) - 2)
        return self.region(local, in_specs, out)(*args)
