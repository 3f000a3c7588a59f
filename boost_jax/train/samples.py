"""``Train.sample_every``: greedy samples of the parameters being trained, for the logs.

The trainer's parameters live on its mesh (tensor shards, pipeline stage layout, ZeRO slices);
:func:`host_params` gathers them to the canonical layout on the host, and :class:`Sampler`
continues the fixed ``Train.sample_prompts`` with them on one device (models/decode.py).
"""

from __future__ import annotations

from pathlib import Path

import jax

from boost_jax.config import ConfigError, Model, Train
from boost_jax.data import tokenizer as tokenizers
from boost_jax.models.decode import generate
from boost_jax.parallel.runner import ShardedModel


def host_params(model: ShardedModel, params: dict) -> dict:
    """``params`` in the canonical layout (block parameters ``[L, ...]``) as host numpy
    arrays, whatever the mesh, pipeline layout and ``zero`` stage. Every process must call
    it: a multi-process run gathers across processes."""
    if model.repeats > 1:
        params = jax.jit(model.to_canonical)(params)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


class Sampler:
    """The prompts of ``train`` encoded with the tokenizer of the dataset at ``data_path``."""

    def __init__(self, train: Train, data_path: str | Path):
        self.tokens = train.sample_tokens
        self.tokenizer = tokenizers.load(data_path)
        self.prompts = self.tokenizer.encode_batch(list(train.sample_prompts))
        for text, ids in zip(train.sample_prompts, self.prompts):
            if not ids:
                raise ConfigError(f"Train.sample_prompts: {text!r} encodes to no tokens")

    def texts(self, cfg: Model, params: dict) -> list[str]:
        """Each prompt and its greedy continuation (``Train.sample_tokens`` tokens at most,
        up to the end-of-text token) by the canonical ``params`` (fp32)."""
        eos = self.tokenizer.eos_id
        new = generate(cfg, params, self.prompts, self.tokens,
                       stop_ids=() if eos is None else (eos,))
        return [self.tokenizer.decode(p + n) for p, n in zip(self.prompts, new)]
