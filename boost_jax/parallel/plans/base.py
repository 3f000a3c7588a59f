"""What every mesh-aware plan shares: the mesh axes, Megatron's *f* and *g*, and the
vocab-parallel boundary of the tensor-parallel plans, over the plan interface of
:mod:`boost_jax.models.boundaries` (which also holds ``none``, the single-device plan).

Collectives are plain ``psum``/``psum_scatter``/``all_gather`` plus explicit ``pcast``
(Megatron's *f*: a replicated activation entering sharded weights); their backward collectives
come from JAX's transpose rules, never from hand-written custom_vjps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import jax
from jax import lax

from boost_jax.models.boundaries import Plan
from boost_jax.parallel.vocab import vocab_cross_entropy, vocab_embed

if TYPE_CHECKING:
    from boost_jax.models.config import Model

DATA, PIPE, TENSOR = "data", "pipe", "tensor"
MESH_AXES = (DATA, PIPE, TENSOR)


def region_axes(mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a value can vary over inside a region: ``tensor`` (the plans' collectives
    name it whatever its size), and ``data`` / ``pipe`` where larger than 1 -- a size-1
    ``data`` or ``pipe`` axis is left out of every spec (``ShardedModel.region``), so that no
    gradient is ever all-reduced over one device."""
    return tuple(a for a in MESH_AXES if a == TENSOR or mesh_shape[a] > 1)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (``None``, an axis, or a tuple of axes)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def as_entry(axes: Sequence[str]):
    """Inverse of :func:`entry_axes`: ``None``, the one axis, or the tuple of axes."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def f_op(x):
    """Megatron's *f*: mark a replicated value as entering tensor-sharded weights.

    Identity in the forward pass; its transpose sums the partial cotangents over ``tensor``
    (one all-reduce). Applying it once per input (rather than letting every GEMM cast its own
    copy) keeps the backward pass at one collective per grouped input.
    """
    return jax.tree.map(lambda v: lax.pcast(v, (TENSOR,), to="varying"), x)


def g_op(x):
    """Megatron's *g*: sum partial results over ``tensor`` (its transpose is free)."""
    return jax.tree.map(lambda v: lax.psum(v, TENSOR), x)


@dataclasses.dataclass(frozen=True)
class VocabParallelPlan(Plan):
    """What every tensor-parallel plan shares: the embedding table is split on the vocabulary
    (``[V/p, d]``) and the LM head on its output (``[d, V/p]``), and the cross-entropy works
    on vocab-sharded logits, so full-vocab logits never exist on one device."""

    #: the final hidden state is replicated over ``tensor``, so the head's input needs *f*
    replicated_hidden: ClassVar[bool] = True

    @classmethod
    def divisible(cls, model: Model) -> list[tuple[str, int]]:
        return [("Model.vocab_size", model.vocab_size)]

    def embed(self, tokens: jax.Array, table: jax.Array) -> jax.Array:
        """Replicated residual ``[b, s, d]``: one all-reduce of the looked-up rows."""
        return vocab_embed(tokens, table, scatter=False)

    def logits(self, x: jax.Array, head: jax.Array) -> jax.Array:
        """Local vocab shard ``[b, s, V/p]`` of the logits (column-parallel head)."""
        return super().logits(f_op(x) if self.replicated_hidden else x, head)

    def token_loss(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
        return vocab_cross_entropy(logits, targets)
