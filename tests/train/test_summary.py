"""The run's closing lines on stdout (train/summary.py): the first says how the run ended."""

from __future__ import annotations

import math

from boost_jax.operations.goodput import BUCKETS, PREFIX
from boost_jax.train.summary import Summary, report

#: a goodput record (operations/goodput.py): all of 12 s in steps
GOODPUT = {PREFIX + "wall_s": 12.0, **{PREFIX + b: float(b == "step") for b in BUCKETS}}


def _summary(**kw) -> Summary:
    return Summary(**{"start_step": 0, "step": 133, "final_loss": 4.5, "eval_loss": math.log(90),
                      "interrupted_by": None, "checkpoint_dir": "runs/x/checkpoints",
                      "metrics_file": "runs/x/metrics.jsonl", **kw})


def test_the_first_line_on_stdout_says_how_the_run_ended(capsys):
    """Finished, stopped by a signal (resumable) or diverged, on stdout where a user reads the
    run's result -- not only an absl warning on stderr (issue 49: an interrupted run printed
    ``done: steps 0->133``). Seen failing on the old summary: ``done:`` for all three, and
    nothing on stdout for a diverged run."""
    firsts = []
    for kw in ({}, {"interrupted_by": 15}, {"diverged": "loss is nan at step 134"}):
        report(_summary(**kw), GOODPUT, 12.0, lead=True, tensorboard="runs/x/tb")
        firsts.append(capsys.readouterr().out.splitlines()[0])
    assert firsts[0].startswith("finished: steps 0->133, final train loss 4.5000, eval "
                                "perplexity 90.00")
    assert firsts[1].startswith("stopped by signal 15, resumable (rerun the same command): "
                                "steps 0->133")
    assert firsts[2].startswith("diverged after step 133: steps 0->133, the last checkpoint "
                                "is kept")
