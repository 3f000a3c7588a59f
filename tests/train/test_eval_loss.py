"""The eval arithmetic of train/eval_loss.py on given per-row numbers: the token mean, the
papers' groups of ``Train.loss_group_rows`` rows over groups + 1, and their stopping rule
(more than N tokens seen, a padded row counting its last token) -- against a transcription of
their loop (alvin-zyl/CoLA ``main.py`` lines 148-175; its 10 M target cannot be reached by a
fixture, so this part is checked against our reading only; the rest is checked against their
code in tests/train/test_cola_protocol.py)."""

import numpy as np
import pytest

from boost_jax.train.eval_loss import evaluate

ROWS = 12  # 3 global batches of 4 rows


def _numbers():
    rng = np.random.default_rng(0)
    targets = rng.integers(1, 9, ROWS)  # a padded row of m tokens has m - 1 targets
    losses = rng.uniform(0.5, 3.0, ROWS) * targets
    return losses, targets


def _theirs(losses, targets, batch_rows, target_tokens):
    """Their evaluate_model over batches of ``batch_rows`` rows, one process."""
    total_loss, total_batches, evaluated = 0.0, 1, 0
    for lo in range(0, ROWS, batch_rows):
        if evaluated > target_tokens:
            break
        total_batches += 1
        t = targets[lo:lo + batch_rows]
        total_loss += losses[lo:lo + batch_rows].sum() / t.sum()
        evaluated += int((t + 1).sum())  # non-pad inputs: targets + the row's last token
    return total_loss / total_batches


def _seen_after(groups: int, rows: int) -> int:
    """Tokens the papers count after ``groups`` batches of ``rows`` rows (a tie with the
    target: their test is ``>``, so one more batch is read)."""
    return int((_numbers()[1][:groups * rows] + 1).sum())


@pytest.mark.parametrize("group_rows, stop", [(2, None), (4, None), (2, 20), (1, 7),
                                              (2, _seen_after(2, 2))])
def test_groups_and_the_stopping_rule_follow_the_papers_loop(group_rows, stop):
    losses, targets = _numbers()
    batches = [slice(i, i + 4) for i in range(0, ROWS, 4)]

    def step(_, s):
        return losses[s].astype(np.float32), targets[s].astype(np.int32)

    totals = evaluate(step, None, batches, group_rows=group_rows, stop_tokens=stop,
                      counted_per_row=1)
    want = _theirs(losses, targets, group_rows, stop if stop is not None else 10**9)
    assert totals.cola_loss == pytest.approx(want, rel=1e-6)
    used = totals.groups * group_rows
    assert totals.tokens == targets[:used].sum()
    assert totals.loss == pytest.approx(losses[:used].sum() / targets[:used].sum(), rel=1e-6)
    if stop is None:
        assert totals.groups == ROWS // group_rows and totals.batches == 3
    else:
        assert totals.groups < ROWS // group_rows


def test_without_groups_a_batch_is_one_of_their_batches():
    losses, targets = _numbers()
    totals = evaluate(lambda _, s: (losses[s], targets[s]), None,
                      [slice(i, i + 4) for i in range(0, ROWS, 4)])
    assert totals.groups == totals.batches == 3
    assert totals.cola_loss == pytest.approx(_theirs(losses, targets, 4, 10**9), rel=1e-6)


def test_groups_span_the_batches_the_trainer_cuts():
    """The trainer evaluates each batch in its gradient-accumulation parts: the papers' groups
    of 4 rows read over parts of 2 rows are the groups of the whole batches of 4."""
    losses, targets = _numbers()

    def step(_, s):
        return losses[s], targets[s]

    whole = evaluate(step, None, [slice(i, i + 4) for i in range(0, ROWS, 4)], group_rows=4)
    parts = evaluate(step, None, [slice(i, i + 2) for i in range(0, ROWS, 2)], group_rows=4)
    assert parts.groups == whole.groups == 3 and parts.batches == 6
    assert parts.cola_loss == pytest.approx(whole.cola_loss, rel=1e-12)


def test_a_batch_after_the_stop_is_not_counted():
    """When the papers' evaluation stops at a batch boundary, the batch read past it (in
    flight) counts in neither definition nor in ``batches``."""
    losses, targets = _numbers()
    stop = _seen_after(2, 2) - 1  # crossed by the end of batch 0 (groups 1 and 2)
    totals = evaluate(lambda _, s: (losses[s], targets[s]), None,
                      [slice(i, i + 4) for i in range(0, ROWS, 4)], group_rows=2,
                      stop_tokens=stop, counted_per_row=1)
    assert (totals.groups, totals.batches, totals.tokens) == (2, 1, targets[:4].sum())
