"""Held-out perplexity of a trained run on a prepared dataset, on any mesh.

The run's parameters (fp32, canonical layout, read by :func:`~boost_jax.train.trained.load_trained`)
are placed on a ``(data, pipe, tensor)`` mesh by the trainer's
:class:`~boost_jax.parallel.runner.ShardedModel` and scored by the trainer's eval step
(:func:`~boost_jax.train.eval_loss.make_eval_step`: the sharded loss, pipelined or
tensor-parallel as the mesh says), summed by the trainer's own
:func:`~boost_jax.train.eval_loss.evaluate`. Every
full global batch of the eval split is evaluated, in order (or the
first ``max_batches``); the first ``Train.eval_batches`` of them are the batches the trainer
evaluates. The loss is the mean over every token evaluated (token-weighted across batches, so
packed batches with padding count right); windows of a ``concat`` split (documents of a
``pad`` one) that cannot fill a last global batch are left out and counted in
:attr:`Perplexity.left_out`.

Configuration (:func:`eval_config`): the run's own config (from its checkpoint's metadata),
with the mesh (``Parallel.*``), the data (``Data.*``, ``path``), ``seq_len``, ``batch_size``
and the compute ``dtype`` replaceable; the model is always the run's. The mesh defaults to the
run's; when that needs more devices than this host has and no ``Parallel.*`` binding was given,
one device is used instead (:func:`fit_devices`; CPU-only hosts simulate the devices a mesh
needs, as the trainer does, so there the run's mesh always fits).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from boost_jax.config import Config, ConfigError, Parallel
from boost_jax.data.loader import Dataset, iter_eval_batches, open_dataset_on_all
from boost_jax.data.manifest import eval_split_label, larger_eval_split
from boost_jax.operations.progress import say
from boost_jax.parallel.mesh import local_batch_rows, make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.train.eval_loss import evaluate, make_eval_step

#: the one-device mesh used when the run's mesh does not fit (and no mesh was asked for)
ONE_DEVICE = Parallel(data=1, pipe=1, tensor=1, tp_plan="none")


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """The result of :func:`evaluate_perplexity`."""

    loss: float  # mean next-token cross-entropy (nats) over the tokens evaluated
    tokens: int  # tokens evaluated (targets that count in the loss)
    batches: int  # global batches evaluated
    left_out: int | None  # concat (pad): eval windows (documents) not evaluated (a partial
    # last batch, or beyond max_batches); None for document packing
    seq_len: int
    batch_size: int
    data: str
    mesh: dict[str, int]
    dtype: str
    seconds: float
    eval_split: str = ""  # what the eval split is (data/prepare.py: eval_split_label)
    #: the CoLA/LORO/GaLore papers' definition of the same batches
    #: (:attr:`~boost_jax.train.eval_loss.EvalTotals.cola_loss`) and its batches (groups of
    #: ``Train.loss_group_rows`` rows, or the global batches)
    cola_loss: float = float("nan")
    cola_batches: int = 0

    @property
    def perplexity(self) -> float:
        """``exp(loss)``: this project's definition (token-weighted)."""
        return math.exp(self.loss)

    @property
    def cola_perplexity(self) -> float:
        """``exp(cola_loss)``: the low-rank papers' definition."""
        return math.exp(self.cola_loss)

    def to_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "loss"}, "cola_perplexity": self.cola_perplexity}


# --- configuration ------------------------------------------------------------------------
def eval_config(run: Config, parallel: dict | None = None, data: dict | None = None,
                data_path: str | None = None, seq_len: int | None = None,
                batch_size: int | None = None, dtype: str | None = None) -> Config:
    """``run`` with the evaluation's choices: ``parallel``/``data`` field overrides, the data
    path, sequence length, global batch and compute dtype (``None``: the run's). Validated
    like a training config (one-line :class:`ConfigError`); gradient accumulation, which
    evaluation does not use, is reset to 1."""
    par = dataclasses.replace(run.parallel, grad_accum=1, **(parallel or {}))
    dat = dataclasses.replace(run.data, **(data or {}))
    if data_path is not None:
        dat = dataclasses.replace(dat, path=data_path)
    train = {k: v for k, v in (("seq_len", seq_len), ("batch_size", batch_size),
                               ("dtype", dtype)) if v is not None}
    train["micro_batch_size"] = None  # (which would set the accumulation again)
    return Config(run.model, par, dataclasses.replace(run.train, **train), dat)


def fit_devices(config: Config, explicit: bool, devices: Sequence[jax.Device] | None = None
                ) -> tuple[Config, list[jax.Device]]:
    """``config`` and the devices of its mesh: the first ``Parallel.num_devices`` of
    ``devices`` (default: all). A mesh larger than that is an error when it was asked for
    (``explicit``) or the job has several processes; else one device is used instead."""
    devices = list(jax.devices() if devices is None else devices)
    need, multi = config.parallel.num_devices, jax.process_count() > 1
    if need == len(devices) or (need < len(devices) and not multi):
        return config, devices[:need]
    if explicit or multi:
        d, p, t = config.parallel.shape
        raise ConfigError(f"the mesh Parallel.data x pipe x tensor = {d} x {p} x {t} needs "
                          f"{need} devices, but {len(devices)} are available; choose a mesh "
                          f"of {'exactly' if multi else 'at most'} {len(devices)} with "
                          "--gin_param=Parallel.*")
    say(f"the run's mesh {config.parallel.shape} needs {need} devices and {len(devices)} are "
        "available: evaluating on one device", file=sys.stderr)
    return dataclasses.replace(config, parallel=ONE_DEVICE), devices[:1]


# --- batches and parameters ---------------------------------------------------------------
def place_params(model: ShardedModel, params: dict) -> dict:
    """Canonical host ``params`` (the same on every process) laid out on ``model``'s mesh."""
    staged = model.from_canonical(params)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                        staged, model.param_shardings)


def _check_data(ds: Dataset, config: Config) -> None:
    """The eval data's vocabulary must fit the model's (data prepared with another tokenizer
    than the run's would give meaningless numbers; that is the user's to avoid)."""
    if ds.ids_used > config.model.vocab_size:
        raise ConfigError(f"Data.path={config.data.path!r}: its tokens reach id "
                          f"{ds.ids_used - 1}, beyond the model's vocabulary "
                          f"({config.model.vocab_size}); evaluate on data prepared with the "
                          "run's tokenizer")


def _no_batches(ds: Dataset, config: Config) -> ConfigError:
    t = config.train
    what = f"has {ds.describe('eval', t.seq_len)}"
    return ConfigError(f"Data.path={config.data.path!r}: the eval split {what}, not enough "
                       f"for one batch of --batch_size={t.batch_size}; lower --batch_size or "
                       f"--seq_len, or {larger_eval_split(ds.meta)}")


# --- evaluation ---------------------------------------------------------------------------
def evaluate_perplexity(params: dict, config: Config,
                        devices: Sequence[jax.Device] | None = None,
                        max_batches: int | None = None, progress_every: float = 30.0,
                        cola_tokens: int | None = None) -> Perplexity:
    """Perplexity of ``params`` (canonical, host arrays) on the eval split of
    ``config.data`` at ``config.train.seq_len`` / ``batch_size`` / ``dtype``, on the mesh
    ``config.parallel`` over ``devices`` (default: all); see the module docstring. A status
    line goes to stderr every ``progress_every`` seconds. ``cola_tokens``: stop as the
    low-rank papers' evaluation does, once more than this many tokens were seen (counted as
    they count: train/eval_loss.py)."""
    start = time.perf_counter()
    if max_batches is not None and max_batches < 1:
        raise ConfigError(f"--max_batches={max_batches} must be a positive integer")
    t = config.train
    mesh = make_mesh(config.parallel, devices)
    ds = open_dataset_on_all(config.data)
    _check_data(ds, config)
    model = ShardedModel(config.model, config.parallel, mesh, jnp.dtype(t.dtype),
                         max_segments=config.data.segment_bound)
    placed = place_params(model, params)
    eval_step = make_eval_step(model)
    rows = local_batch_rows(mesh, t.batch_size)
    total = len(ds.sequences("eval", t.seq_len)) // t.batch_size \
        if ds.data.packing != "document" else None
    if total is not None and max_batches is not None:
        total = min(total, max_batches)
    shown = time.perf_counter()

    def progress(batches: int) -> None:
        nonlocal shown
        if time.perf_counter() - shown > progress_every:
            shown = time.perf_counter()
            say(f"evaluated {batches}{f'/{total}' if total else ''} batches", file=sys.stderr)

    global_batches = (
        {k: jax.make_array_from_process_local_data(model.batch_sharding, v,
                                                   (t.batch_size, v.shape[1]))
         for k, v in local.items()}
        for local in iter_eval_batches(ds, t.seq_len, t.batch_size, rows, max_batches))
    totals = evaluate(eval_step, placed, global_batches, progress, t.loss_group_rows,
                      cola_tokens, counted_per_row=int(ds.data.packing == "pad"))
    batches = totals.batches
    if batches == 0:
        raise _no_batches(ds, config)
    left_out = None
    if ds.data.packing != "document":
        left_out = len(ds.sequences("eval", t.seq_len)) - batches * t.batch_size
    return Perplexity(totals.loss, totals.tokens, batches, left_out, t.seq_len, t.batch_size,
                      config.data.path, dict(mesh.shape), t.dtype, time.perf_counter() - start,
                      eval_split_label(ds.meta), totals.cola_loss, totals.groups)

