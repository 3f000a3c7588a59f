"""The held-out loss, summed once for the trainer and ``python -m boost_jax.eval``, in the two
definitions it is reported in.

* **This project's**: the token-weighted mean over every token that counts (``loss``).
* **The low-rank papers'** (CoLA, LORO, GaLore: their shared ``evaluate_model``,
  alvin-zyl/CoLA ``main.py`` lines 112-182): batches of their per-GPU ``--batch_size`` rows
  (``Train.loss_group_rows``) are read until more than a token target has been seen (10 M,
  line 148, checked before each batch, line 160, counting non-pad inputs, line 173); the loss
  is the sum of the batches' mean losses over the number of batches *plus one*
  (``total_batches = 1``, line 151): ``cola_loss``. One process's figure: on ``W`` GPUs each
  of theirs divides its own sum by its batches + 1 and the results are averaged (lines
  175-180), which lowers the number by about ``(W - 1) / (n + W)`` for ``n`` batches in all.

The eval step returns per-row loss sums and token counts, so every grouping of rows is a sum on
the host (float64), one batch in flight while the previous one is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.models.batch import row_counts

if TYPE_CHECKING:
    from boost_jax.parallel.runner import ShardedModel

#: how the papers' evaluation divides (main.py: ``total_batches = 1`` before the loop, line
#: 151, ``+= 1`` per batch, line 162, ``total_loss / total_batches``, line 175): by the
#: batches evaluated plus one
COLA_EXTRA_BATCHES = 1
#: the papers' token target (main.py line 148: ``target_eval_tokens = 10_000_000``)
COLA_EVAL_TOKENS = 10_000_000


def make_eval_step(model: ShardedModel):
    """``eval_step(params, batch) -> (losses, tokens)`` of one global batch: replicated fp32
    ``[batch]`` per-row loss sums and int32 ``[batch]`` per-row counts of the tokens that
    count (models/batch.py)."""
    replicated = NamedSharding(model.mesh, P())

    def step(params, batch):
        return model.row_losses(params, batch), row_counts(batch)

    return jax.jit(step, in_shardings=(model.param_shardings, model.batch_sharding),
                   out_shardings=(replicated, replicated))


@dataclasses.dataclass(frozen=True)
class EvalTotals:
    """What :func:`evaluate` summed, in nats: the loss over every token that counts
    (``loss_sum``, ``tokens``), the global batches read (``batches``), and the papers' batches
    (``groups`` of ``Train.loss_group_rows`` rows, or whole batches) with the sum of their
    mean losses (``mean_sum``)."""

    loss_sum: float
    tokens: int
    batches: int
    mean_sum: float = 0.0
    groups: int = 0

    @property
    def loss(self) -> float:
        """The token-weighted mean (NaN when nothing was evaluated): this project's
        definition."""
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def cola_loss(self) -> float:
        """The CoLA, LORO and GaLore papers' definition (module docstring): the sum of the
        groups' mean losses over their number *plus one* (:data:`COLA_EXTRA_BATCHES`);
        NaN when nothing was evaluated."""
        return self.mean_sum / (self.groups + COLA_EXTRA_BATCHES) if self.groups else \
            float("nan")


def evaluate(eval_step, params, batches: Iterable[dict],
             on_batch: Callable[[int], None] | None = None, group_rows: int | None = None,
             stop_tokens: int | None = None, counted_per_row: int = 0) -> EvalTotals:
    """``eval_step`` (:func:`make_eval_step`) over global ``batches``: the token-weighted
    sums and, cut into groups of ``group_rows`` rows (default: each batch whole), each
    group's mean for the papers' definition (:attr:`EvalTotals.cola_loss`). ``stop_tokens``:
    the papers' stop -- no further group once more than this many tokens were seen, each row
    counting its targets plus ``counted_per_row`` (1 for padded rows, whose last token the
    papers count though it has no target); the groups read past it are dropped from both
    definitions. ``on_batch(n)`` after the n-th batch."""
    loss_sum = mean_sum = 0.0
    tokens = seen = n = groups = 0
    pending, done = None, False

    def read() -> None:
        nonlocal loss_sum, mean_sum, tokens, seen, n, groups, done
        losses, counts = (np.asarray(x, np.float64) for x in jax.device_get(pending))
        size = group_rows or len(losses)
        for lo in range(0, len(losses), size):
            if stop_tokens is not None and seen > stop_tokens:
                done = True
                break
            part, count = losses[lo:lo + size].sum(), counts[lo:lo + size].sum()
            loss_sum, tokens, groups = loss_sum + part, tokens + int(count), groups + 1
            mean_sum += part / count if count else float("nan")
            seen += int(count) + counted_per_row * len(losses[lo:lo + size])
        n += 1
        if on_batch is not None:
            on_batch(n)

    for batch in batches:
        out = eval_step(params, batch)
        if pending is not None:
            read()
            if done:
                break
        pending = out
    else:
        if pending is not None:
            read()
    return EvalTotals(loss_sum, tokens, n, mean_sum, groups)
