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
