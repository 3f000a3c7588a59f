"""A tiny trained run shared by the evaluation tests (perplexity, lm-eval adapter, CLI)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import pytest

from boost_jax.config import Config, Data, Train
from boost_jax.testing import SINGLE, tiny
from boost_jax.train.loop import Summary, run


@dataclasses.dataclass
class TinyRun:
    workdir: Path
    summary: Summary
    config: Config


@pytest.fixture(scope="package")
def tiny_run(tiny_data, tmp_path_factory) -> TinyRun:
    """Tiny CoLA trained 4 steps on one device (batches of 8 x 32), evaluated on 2 batches
    at the end; one checkpoint."""
    train = Train(steps=4, batch_size=8, seq_len=32, log_every=1000, eval_every=1000,
                  checkpoint_every=1000, eval_batches=2)
    config = Config(tiny("cola"), SINGLE, train, Data(path=str(tiny_data)))
    workdir = tmp_path_factory.mktemp("eval_run")
    summary = run(config, workdir, jax.devices()[:1], checkpoint_async=False)
    return TinyRun(workdir, summary, config)
