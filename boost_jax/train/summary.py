"""What a run did (:class:`Summary`, returned by ``train.loop.run``) and the lines that end it
on stdout: how it ended, the time by bucket, where its checkpoints and metrics are, and a
mirror of the run's files to an object store that did not work."""

from __future__ import annotations

import dataclasses
import math

from boost_jax.operations.goodput import summary as goodput_summary
from boost_jax.operations.progress import duration, say


@dataclasses.dataclass
class Summary:
    """What a run did (returned by :func:`boost_jax.train.loop.run`)."""

    start_step: int
    step: int
    final_loss: float | None
    eval_loss: float | None
    interrupted_by: int | None  # the agreed signal number, if a signal stopped the run
    checkpoint_dir: str
    metrics_file: str
    diverged: str | None = None  # why the non-finite policy stopped the run
    mirror_problem: str | None = None  # why the run's files are not on the object store

    @property
    def eval_ppl(self) -> float | None:
        return None if self.eval_loss is None else math.exp(self.eval_loss)


def ending(summary: Summary, seconds: float) -> str:
    """The run's first closing line: how it ended -- ``finished``, ``stopped by signal N``
    (resumable: a checkpoint was saved) or ``diverged`` (nothing saved over the last good
    checkpoint) -- its steps, losses and time."""
    ppl = "n/a" if summary.eval_ppl is None else f"{summary.eval_ppl:.2f}"
    loss = "n/a" if summary.final_loss is None else f"{summary.final_loss:.4f}"
    steps = f"steps {summary.start_step}->{summary.step}"
    if summary.diverged is not None:
        return (f"diverged after step {summary.step}: {steps}, the last checkpoint is kept; "
                f"{duration(seconds)}")
    if summary.interrupted_by is not None:
        how = (f"stopped by signal {summary.interrupted_by}, resumable (rerun the same "
               "command)")
    else:
        how = "finished"
    return (f"{how}: {steps}, final train loss {loss}, eval perplexity {ppl}, "
            f"{duration(seconds)}")


def report(summary: Summary, goodput: dict, seconds: float, lead: bool,
           tensorboard: str) -> None:
    """The run's closing lines (``lead``: this process writes the run's files)."""
    if lead:  # a diverged run: its command prints the error line too (commands/train.py)
        say(ending(summary, seconds))
    say(goodput_summary(goodput))  # the run's time, by bucket (operations/goodput.py)
    if summary.diverged is None:
        say(f"checkpoints: {summary.checkpoint_dir}")
        say(f"metrics: {summary.metrics_file} (TensorBoard: {tensorboard})")
    if summary.mirror_problem is not None:
        say(f"run files: {summary.mirror_problem}")
