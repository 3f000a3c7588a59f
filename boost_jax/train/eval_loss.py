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


class _Groups:
    """The evaluated rows, in order, cut into the papers' batches of ``size`` rows (a group
    may span two eval batches: the trainer evaluates its batches in micro-batch parts), with
    their stopping rule (:func:`evaluate`)."""

    def __init__(self, stop_tokens: int | None, counted_per_row: int):
        self.stop, self.per_row = stop_tokens, counted_per_row
        self.rows: list[tuple[float, int, int]] = []  # (loss sum, tokens, batch) not grouped
        self.loss_sum = self.mean_sum = 0.0
        self.tokens = self.seen = self.groups = 0
        self.used: set[int] = set()  # the batches with a row in a group
        self.done = False

    def add(self, losses: np.ndarray, counts: np.ndarray, batch: int, size: int) -> None:
        self.rows += [(float(x), int(c), batch) for x, c in zip(losses, counts)]
        while not self.done and len(self.rows) >= size:
            self.take(size)

    def take(self, size: int) -> None:
        """The next group of ``size`` rows -- unless the papers' evaluation has stopped:
        more than ``stop`` tokens seen before it (their test, before each batch)."""
        if self.stop is not None and self.seen > self.stop:
            self.done = True
            return
        group, self.rows = self.rows[:size], self.rows[size:]
        part, count = sum(r[0] for r in group), sum(r[1] for r in group)
        self.loss_sum, self.tokens, self.groups = self.loss_sum + part, self.tokens + count, \
            self.groups + 1
        self.mean_sum += part / count if count else float("nan")
        self.seen += count + self.per_row * len(group)
        self.used.update(r[2] for r in group)


def evaluate(eval_step, params, batches: Iterable[dict],
             on_batch: Callable[[int], None] | None = None, group_rows: int | None = None,
             stop_tokens: int | None = None, counted_per_row: int = 0) -> EvalTotals:
    """``eval_step`` (:func:`make_eval_step`) over global ``batches``, one in flight while the
    previous one is read: the token-weighted sums and, the rows cut in order into groups of
    ``group_rows`` (default: each batch whole; a group may span batches), each group's mean
    for the papers' definition (:attr:`EvalTotals.cola_loss`; a last shorter group counts,
    as their loader's last batch does). ``stop_tokens``: the papers' stop -- no further group
    once more than this many tokens were seen, each row counting its targets plus
    ``counted_per_row`` (1 for padded rows, whose last token the papers count though it has
    no target); the rows past it are dropped from both definitions, and ``batches`` counts
    the batches with a row evaluated. ``on_batch(n)`` after the n-th batch read."""
    groups = _Groups(stop_tokens, counted_per_row)
    pending, n = None, 0

    def read() -> None:
        nonlocal n
        losses, counts = (np.asarray(x) for x in jax.device_get(pending))
        groups.add(losses, counts, n, group_rows or len(losses))
        n += 1
        if on_batch is not None:
            on_batch(n)

    for batch in batches:
        out = eval_step(params, batch)
        if pending is not None:
            read()
            if groups.done:
                break
        pending = out
    else:
        if pending is not None:
            read()
    if groups.rows and not groups.done:
        groups.take(len(groups.rows))
    return EvalTotals(groups.loss_sum, groups.tokens, len(groups.used), groups.mean_sum,
                      groups.groups)
