"""``Train.sample_every``: greedy samples of the parameters being trained, for the logs.

The trainer's parameters live on its mesh (tensor shards, pipeline stage layout, ZeRO slices);
:func:`host_params` gathers them to the canonical layout on the host, and :class:`Sampler`
casts them there, once, to the compute dtype (``Train.dtype``) and continues the fixed
``Train.sample_prompts`` with them on one device (models/decode.py), where they sit beside
that device's share of the training state. :func:`check_sample_size` refuses, before anything
is built, a model too large for that (:data:`MAX_SAMPLE_PARAMS`).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.config import ConfigError, Model, Train
from boost_jax.data import tokenizer as tokenizers
from boost_jax.models.decode import generate
from boost_jax.models.decoder import abstract_model
from boost_jax.parallel.runner import ShardedModel

#: the most parameters ``Train.sample_every`` samples from. Sampling copies the whole model:
#: gathered in fp32 on every process's host (8 GB at this size) and placed on device 0 in the
#: compute dtype (4 GB in bf16, 8 GB in fp32) beside that device's share of the training
#: state (fp32 weights and Adam moments, 12 bytes per parameter without ZeRO) and activations.
#: 2e9 admits dense 1b and the low-rank 3b presets; 7b (and dense 3b) would need generation
#: on the sharded model, which is not implemented -- sample from a checkpoint instead.
MAX_SAMPLE_PARAMS = 2_000_000_000


def model_parameters(cfg: Model) -> int:
    """Parameters of ``cfg``, counted from the abstract model (shapes only, nothing built)."""
    return sum(math.prod(d.shape) for d in abstract_model(cfg)[1].values())


def check_sample_size(cfg: Model, train: Train) -> None:
    """One-line :class:`ConfigError` when ``train`` samples (``sample_every``) from a model
    with more than :data:`MAX_SAMPLE_PARAMS` parameters."""
    if not train.sample_every:
        return
    n = model_parameters(cfg)
    if n > MAX_SAMPLE_PARAMS:
        raise ConfigError(
            f"Train.sample_every={train.sample_every}: Model.size={cfg.size!r} ({cfg.arch}) has "
            f"{n:,} parameters, more than the {MAX_SAMPLE_PARAMS:,} that samples while "
            "training take (the whole model on one device, beside the training state; "
            "boost_jax/train/samples.py); set Train.sample_every=None and sample from a "
            "checkpoint with python -m boost_jax.generate")


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
    """The prompts of ``train`` encoded with the tokenizer of the dataset at ``data_path``,
    generated in ``train``'s compute dtype."""

    def __init__(self, train: Train, data_path: str | Path):
        self.tokens = train.sample_tokens
        self.dtype = jnp.dtype(train.dtype)
        self.tokenizer = tokenizers.load(data_path)
        self.prompts = self.tokenizer.encode_batch(list(train.sample_prompts))
        for text, ids in zip(train.sample_prompts, self.prompts):
            if not ids:
                raise ConfigError(f"Train.sample_prompts: {text!r} encodes to no tokens")

    def texts(self, cfg: Model, params: dict) -> list[str]:
        """Each prompt and its greedy continuation (``Train.sample_tokens`` tokens at most,
        up to the end-of-text token) by the canonical host ``params`` (fp32 numpy), cast here
        to the compute dtype before they go to the device -- the decode steps then hold and
        read only that copy."""
        params = jax.tree.map(lambda p: np.asarray(p).astype(self.dtype), params)
        eos = self.tokenizer.eos_id
        new = generate(cfg, params, self.prompts, self.tokens,
                       stop_ids=() if eos is None else (eos,), dtype=self.dtype)
        return [self.tokenizer.decode(p + n) for p, n in zip(self.prompts, new)]
