"""Batched log-likelihood of token continuations on one device (what lm-eval's
``loglikelihood`` and ``loglikelihood_rolling`` requests need).

A request is ``(context, continuation)``, two lists of token ids (the context non-empty). Its
row is the last ``max_length + 1`` tokens of ``context + continuation``: inputs are all but the
last, and the continuation's tokens are scored where they are the targets. Rows are sorted by
length, cut into batches of ``batch_size`` rows and right-padded to a length bucket (powers of
two from :data:`MIN_BUCKET`, and ``max_length``), so the jitted scorer compiles once per
bucket, not once per request; padding rows and positions are masked out. Causal attention
makes right padding invisible to the real tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.config import Model
from boost_jax.models.boundaries import Plan
from boost_jax.models.decode import bucket
from boost_jax.models.decoder import bind

MIN_BUCKET = 16


def row_width(length: int, max_length: int, smallest: int = MIN_BUCKET) -> int:
    """The padded width of a batch whose longest row has ``length <= max_length`` inputs: the
    next power of two from ``smallest`` (:func:`boost_jax.models.decode.bucket`), at most
    ``max_length`` -- the scorer compiles once per width."""
    return min(bucket(length, smallest), max_length)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def score_rows(cfg: Model, params: dict, inputs: jax.Array, targets: jax.Array,
               mask: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Per row of ``inputs``/``targets``/``mask`` ``[b, s]``: the sum of the targets'
    log-probabilities where ``mask`` is set (fp32 ``[b]``), and whether every one of them is
    the argmax (bool ``[b]``)."""
    logits = bind(cfg, params, dtype).logits(inputs, Plan()).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return jnp.sum(jnp.where(mask, picked, 0.0), axis=-1), jnp.all(greedy | ~mask, axis=-1)


class Scorer:
    """Scores ``(context, continuation)`` token requests with ``params`` (canonical layout)
    of ``cfg`` on ``device`` (default: the first), in batches of ``batch_size`` rows of at most
    ``max_length`` tokens, in the compute ``dtype``."""

    def __init__(self, cfg: Model, params: dict, max_length: int, batch_size: int = 16,
                 dtype: str = "float32", device: jax.Device | None = None):
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"max_length={max_length} and batch_size={batch_size} must be >= 1")
        self.cfg, self.max_length, self.batch_size = cfg, max_length, batch_size
        self.dtype = jnp.dtype(dtype)
        self.params = jax.device_put(params, device or jax.devices()[0])

    def _row(self, context: Sequence[int], continuation: Sequence[int]
             ) -> tuple[list[int], int]:
        """The row's tokens (inputs and the last target) and how many trailing targets are
        the continuation's."""
        if not context or not continuation:
            raise ValueError("a request needs a non-empty context and continuation")
        if len(continuation) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the "
                             f"scoring length of {self.max_length} tokens")
        whole = [*context, *continuation][-(self.max_length + 1):]
        return whole, len(continuation)

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
              ) -> list[tuple[float, bool]]:
        """``(sum of log-probabilities, greedy)`` of each request's continuation, in order."""
        rows = [self._row(c, k) for c, k in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = row_width(len(rows[chunk[0]][0]) - 1, self.max_length)
            inputs = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            mask = np.zeros((self.batch_size, width), bool)
            for j, i in enumerate(chunk):
                whole, n = rows[i]
                length = len(whole) - 1
                inputs[j, :length], targets[j, :length] = whole[:-1], whole[1:]
                mask[j, length - n:length] = True
            sums, greedy = jax.device_get(score_rows(
                self.cfg, self.params, jnp.asarray(inputs), jnp.asarray(targets),
                jnp.asarray(mask), self.dtype))
            for j, i in enumerate(chunk):
                out[i] = (float(sums[j]), bool(greedy[j]))
        return out  # type: ignore[return-value]

