"""The batch the model trains on: a dict of int32 ``[batch, seq]`` arrays (sharded on
``data``).

``inputs`` and ``targets`` always; packed rows (``Data.packing='document'``) add
``segment_ids`` (1, 2, ... per document in the row, 0 for padding) and ``positions`` (each
token's position in its document). The loss is the mean over the tokens that have a target:
every token of an unpacked batch, the non-padding tokens of a packed one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from boost_jax.models.attention import Segments

TOKEN_KEYS = ("inputs", "targets")
PACKING_KEYS = ("segment_ids", "positions")


def batch_keys(packed: bool) -> tuple[str, ...]:
    return TOKEN_KEYS + (PACKING_KEYS if packed else ())


def segments(batch: dict) -> Segments | None:
    """The document layout of a packed batch (``None`` when unpacked)."""
    if "segment_ids" not in batch:
        return None
    return Segments(batch["segment_ids"], batch["positions"])


def token_count(batch: dict) -> int | jax.Array:
    """Tokens that count in the loss: a Python int for an unpacked batch (its size), an int32
    scalar for a packed one (its non-padding tokens)."""
    if "segment_ids" not in batch:
        return math.prod(batch["inputs"].shape)
    return jnp.sum(batch["segment_ids"] > 0, dtype=jnp.int32)


def loss_sum(per_token: jax.Array, batch: dict) -> jax.Array:
    """The sum of per-token losses ``[b, s]`` over the tokens that count."""
    if "segment_ids" not in batch:
        return jnp.sum(per_token)
    return jnp.sum(jnp.where(batch["segment_ids"] > 0, per_token, 0.0))


def row_sums(per_token: jax.Array, batch: dict) -> jax.Array:
    """fp32 ``[b]``: each row's sum of the per-token losses ``[b, s]`` that count."""
    if "segment_ids" in batch:
        per_token = jnp.where(batch["segment_ids"] > 0, per_token, 0.0)
    return jnp.sum(per_token.astype(jnp.float32), axis=-1)


def row_counts(batch: dict) -> jax.Array:
    """int32 ``[b]``: each row's tokens that count in the loss."""
    if "segment_ids" not in batch:
        return jnp.full(batch["inputs"].shape[:1], batch["inputs"].shape[1], jnp.int32)
    return jnp.sum(batch["segment_ids"] > 0, axis=-1, dtype=jnp.int32)


def loss_share(per_token: jax.Array, batch: dict, denominator: int | jax.Array) -> jax.Array:
    """:func:`loss_sum` over ``denominator``: a scalar (the step's count of tokens that count:
    the token mean) or per row, fp32 ``[b, 1]`` (:func:`group_denominators`)."""
    if jnp.ndim(denominator):
        return loss_sum(per_token / denominator, batch)
    return loss_sum(per_token, batch) / denominator


def group_denominators(batch: dict, rows: int, groups: int) -> jax.Array:
    """fp32 ``[b, 1]``: for each row, ``groups`` times the tokens that count in its group of
    ``rows`` consecutive rows (at least 1), so that the loss summed over every row of the step
    is the mean over its ``groups`` groups of each group's token mean (``Train.loss_group_rows``,
    the low-rank papers' per-GPU micro-batch mean). ``batch``: rows whose count ``rows``
    divides."""
    per_group = jnp.maximum(row_counts(batch).reshape(-1, rows).sum(-1), 1)
    per_group = per_group.astype(jnp.float32)
    return jnp.repeat(per_group * groups, rows)[:, None]

