"""Gin-configurable configuration: ``Model``, ``Parallel``, ``Train`` and ``Data``.

Each class is a frozen dataclass whose fields are the public gin bindings
(``--gin_param=Model.arch='svd'``). Construction validates the values and raises
:class:`ConfigError` with a one-line message naming the offending binding, so bad input is
reported before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import gin

from boost_jax.models.presets import PRESETS

ARCHS = ("dense", "svd", "cola", "lax")
LAX_GATES = ("identity", "dense", "kronecker")
TP_PLANS = ("none", "fullrank", "vanilla", "btp")
RMSNORMS = ("online", "sync")
REMATS = ("none", "full", "lowrank", "lowrank_attn")
SCHEDULES = ("gpipe", "circular")
DTYPES = ("float32", "bfloat16")
PACKINGS = ("concat", "document")
NONFINITE = ("stop", "skip")
ZERO_STAGES = (0, 1, 3)  # 2 would only differ from 1 by when gradients are freed


class ConfigError(ValueError):
    """A configuration problem, reported as one line before any compilation."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _set(obj, **kw) -> None:
    for k, v in kw.items():
        object.__setattr__(obj, k, v)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Model:
    """The decoder. ``size`` picks a preset (models/presets.py); any field set here wins.
    ``size='custom'`` starts from no preset (every dimension must then be given).

    ``rank`` sets both ``attn_rank`` (q, k, v, o) and ``mlp_rank`` (gate, up, down); unset ranks
    default to ``d_model // 4``.
    """

    arch: str = "cola"
    size: str = "small"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_ff: int | None = None
    rank: int | None = None
    attn_rank: int | None = None
    mlp_rank: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    only_lr_act: bool | None = None  # CoLA MLP: True = down(gate*up), False = down(silu(gate)*up)
    lax_gate: str = "identity"  # latent crossing gate: identity | dense | kronecker
    lax_latent_norm: bool = False  # LayerNorm over the r-dim latent after crossing
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02  # embeddings and dense projections

    def __post_init__(self):
        _check(self.arch in ARCHS, f"Model.arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        _check(self.size in PRESETS or self.size == "custom",
               f"Model.size={self.size!r} is not a preset; choose from {', '.join(PRESETS)} "
               "or 'custom' (every dimension set explicitly)")
        preset = {"only_lr_act": True, "tie_embeddings": False, **PRESETS.get(self.size, {})}
        for field in ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size", "tie_embeddings",
                      "only_lr_act", "rank"):
            if getattr(self, field) is None and field in preset:
                _set(self, **{field: preset[field]})
        if self.n_kv_heads is None:
            # a preset's kv-head count only applies when the head count is the preset's too
            same = "n_kv_heads" in preset and self.n_heads == preset["n_heads"]
            _set(self, n_kv_heads=preset["n_kv_heads"] if same else self.n_heads)
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0,
                   f"Model.{name}={value!r} must be a positive integer")
        d = self.d_model
        default_rank = self.rank if self.rank is not None else max(d // 4, 1)
        _set(self, attn_rank=self.attn_rank or default_rank, mlp_rank=self.mlp_rank or default_rank)
        _check(d % self.n_heads == 0,
               f"Model.n_heads={self.n_heads} does not divide Model.d_model={d}")
        _check(self.n_heads % self.n_kv_heads == 0,
               f"Model.n_kv_heads={self.n_kv_heads} does not divide Model.n_heads={self.n_heads}")
        _check(self.head_dim % 2 == 0, f"head dim {self.head_dim} must be even for RoPE")
        if self.is_lowrank:
            for name in ("attn_rank", "mlp_rank"):
                r = getattr(self, name)
                _check(isinstance(r, int) and 0 < r < d,
                       f"Model.{name}={r} must satisfy 0 < rank < Model.d_model={d}"
                       + (" (set by Model.rank)" if self.rank is not None else ""))
        _check(self.lax_gate in LAX_GATES,
               f"Model.lax_gate={self.lax_gate!r} is not one of {', '.join(LAX_GATES)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_lowrank(self) -> bool:
        return self.arch != "dense"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Parallel:
    """The ``(data, pipe, tensor)`` device mesh and the tensor-parallel plan.

    ``tp_plan``: ``none`` (no TP), ``fullrank`` (Megatron, dense arch), ``vanilla`` (naive
    low-rank TP) or ``btp`` (bottleneck-aware TP). ``rmsnorm`` (btp): ``online`` (the norm
    statistic rides in the A factor's all-reduce) or ``sync`` (its own all-reduce first).
    ``norm_payload`` (btp online): dtype of that fused all-reduce, ``compute`` (the compute
    dtype) or ``float32``.

    Pipeline parallelism over ``pipe``: ``pipeline_schedule`` ``gpipe`` or ``circular``
    (``pipeline_repeats`` passes of every microbatch over the stages), ``microbatches`` per data
    shard and pipeline pass.

    ``grad_accum``: gradient accumulation, ``K`` micro-steps per step, each on ``1/K`` of every
    data shard's rows (a pipeline pass each when pipelining); gradients are summed in fp32 and
    reduced over ``data`` once.

    ``zero``: how the state is laid out over ``data`` (parallel/zero.py). ``0`` replicates it;
    ``1`` (ZeRO-1) splits the optimizer state, reduce-scatters the gradients and all-gathers
    the updated parameters; ``3`` (FSDP) splits the parameters too and gathers each layer's
    inside the layer loop (its gradients are reduce-scattered there).
    """

    data: int = 2
    pipe: int = 1
    tensor: int = 4
    tp_plan: str = "btp"
    rmsnorm: str = "online"
    norm_payload: str = "compute"
    grouping: bool = True  # one GEMM (and collective) for the q/k/v or gate/up A factors
    remat: str = "none"  # activation checkpointing: none | full | lowrank | lowrank_attn
    microbatches: int = 1
    pipeline_schedule: str = "gpipe"
    pipeline_repeats: int = 1
    grad_accum: int = 1
    zero: int = 0

    def __post_init__(self):
        for name in ("data", "pipe", "tensor", "microbatches", "pipeline_repeats", "grad_accum"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1,
                   f"Parallel.{name}={value!r} must be a positive integer")
        _check(self.tp_plan in TP_PLANS,
               f"Parallel.tp_plan={self.tp_plan!r} is not one of {', '.join(TP_PLANS)}")
        _check(self.rmsnorm in RMSNORMS,
               f"Parallel.rmsnorm={self.rmsnorm!r} is not one of {', '.join(RMSNORMS)}")
        _check(self.remat in REMATS,
               f"Parallel.remat={self.remat!r} is not one of {', '.join(REMATS)}")
        _check(self.norm_payload in ("compute", "float32"),
               f"Parallel.norm_payload={self.norm_payload!r} is not 'compute' or 'float32'")
        _check(self.tensor == 1 or self.tp_plan != "none",
               f"Parallel.tensor={self.tensor} needs a tensor-parallel plan: set "
               "Parallel.tp_plan to 'btp', 'vanilla' or 'fullrank'")
        _check(self.pipeline_schedule in SCHEDULES, f"Parallel.pipeline_schedule="
               f"{self.pipeline_schedule!r} is not one of {', '.join(SCHEDULES)}")
        _check(self.pipeline_schedule == "circular" or self.pipeline_repeats == 1,
               f"Parallel.pipeline_repeats={self.pipeline_repeats} needs "
               "Parallel.pipeline_schedule='circular'")
        _check(self.repeats == 1 or self.pipe > 1,
               f"Parallel.pipeline_repeats={self.pipeline_repeats} needs pipeline stages "
               "(Parallel.pipe > 1)")
        _check(self.microbatches == 1 or self.pipe > 1,
               f"Parallel.microbatches={self.microbatches} splits a pipeline pass, but "
               "Parallel.pipe=1; for gradient accumulation set Parallel.grad_accum instead")
        _check(self.zero in ZERO_STAGES,
               f"Parallel.zero={self.zero!r} is not one of {', '.join(map(str, ZERO_STAGES))}")
        _check(self.zero != 3 or self.pipe == 1,
               "Parallel.zero=3 (FSDP) with pipeline parallelism is not implemented: use "
               "Parallel.zero=1 with Parallel.pipe > 1, or Parallel.pipe=1")

    @property
    def repeats(self) -> int:
        """Passes of each microbatch over the pipeline stages (1 for GPipe)."""
        return self.pipeline_repeats if self.pipeline_schedule == "circular" else 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.pipe, self.tensor)

    @property
    def num_devices(self) -> int:
        return self.data * self.pipe * self.tensor


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Train:
    """Optimisation, schedule, logging and checkpoint cadence (CoLA's recipe as defaults)."""

    steps: int = 300
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; parameters stay fp32
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None = 10% of the schedule horizon
    schedule_steps: int | None = None  # cosine horizon; None = steps
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    beta1: float = 0.9
    beta2: float = 0.999
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    peak_tflops: float | None = None  # per-device peak for MFU; None = look up the device kind
    #: a step whose loss or gradient norm is not finite is never applied; then ``stop``: end
    #: the run (no checkpoint written over the last good one), ``skip``: go on with the next
    #: batch, unless more than ``max_skips`` steps in a row were skipped
    nonfinite: str = "stop"
    max_skips: int = 10

    def __post_init__(self):
        _check(self.nonfinite in NONFINITE,
               f"Train.nonfinite={self.nonfinite!r} must be one of {', '.join(NONFINITE)}")
        _check(self.max_skips >= 0, f"Train.max_skips={self.max_skips} must be >= 0")
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "keep_checkpoints",
                     "eval_every", "log_every"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0,
                   f"Train.{name}={value!r} must be a positive integer")
        _check(self.dtype in DTYPES, f"Train.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.warmup_steps is None:
            _set(self, warmup_steps=self.horizon // 10)
        _check(0 <= self.warmup_steps < self.horizon,
               f"Train.warmup_steps={self.warmup_steps} must be in [0, schedule horizon="
               f"{self.horizon})")
        _check(self.eval_batches >= 0, f"Train.eval_batches={self.eval_batches} must be >= 0")
        _check(self.learning_rate > 0, f"Train.learning_rate={self.learning_rate} must be > 0")
        _check(0.0 <= self.min_lr_ratio <= 1.0,
               f"Train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")

    @property
    def horizon(self) -> int:
        """Steps over which the learning-rate schedule decays."""
        return self.schedule_steps or self.steps


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Data:
    """Where tokens come from.

    ``path`` is a directory written by ``python -m boost_jax.data.prepare`` or
    ``bundled:<name>`` for a corpus shipped with the package (prepared into ``cache_dir`` on
    first use with ``tokenizer``).
    """

    path: str = "bundled:shakespeare"
    tokenizer: str = "bpe:4096"  # for bundled corpora: bpe:<vocab> | llama32k | spm:<file>
    eval_fraction: float = 0.02  # for bundled corpora
    worker_count: int = 0  # grain worker processes (0 = in-process)
    cache_dir: str | None = None  # default: $BOOST_JAX_CACHE or ~/.cache/boost_jax
    #: concat: windows over concatenated documents; document: whole documents packed into
    #: rows, attention masked to each document (data/packing.py)
    packing: str = "concat"
    #: document packing: rows each packer fills first-fit; the global batch is cut into
    #: groups of this many rows, packed independently (data/packing.py)
    packing_bins: int = 64

    def __post_init__(self):
        _check(self.packing_bins >= 1, f"Data.packing_bins={self.packing_bins} must be >= 1")
        _check(self.packing in PACKINGS,
               f"Data.packing={self.packing!r} must be one of {', '.join(PACKINGS)}")
        _check(0.0 < self.eval_fraction < 0.5,
               f"Data.eval_fraction={self.eval_fraction} must be in (0, 0.5)")
        _check(self.worker_count >= 0, f"Data.worker_count={self.worker_count} must be >= 0")


@dataclasses.dataclass(frozen=True)
class Config:
    """The four config groups together, as the trainer uses them."""

    model: Model
    parallel: Parallel
    train: Train
    data: Data

    def __post_init__(self):
        bins = min(self.data.packing_bins, self.train.batch_size)
        _check(self.data.packing != "document" or self.train.batch_size % bins == 0,
               f"Train.batch_size={self.train.batch_size} is not a multiple of "
               f"Data.packing_bins={bins} (document packing fills groups of that many rows)")
        _check(self.train.batch_size % self.parallel.data == 0,
               f"Train.batch_size={self.train.batch_size} is not divisible by "
               f"Parallel.data={self.parallel.data}")
        from boost_jax.parallel.plans import get_plan  # the plans import this module

        get_plan(self.parallel).check(self.model, self.parallel.tensor)
        par, m = self.parallel, self.model
        per_shard = self.train.batch_size // par.data
        _check(per_shard % par.grad_accum == 0,
               f"Parallel.grad_accum={par.grad_accum} does not divide the batch of a data shard "
               f"(Train.batch_size / Parallel.data = {per_shard})")
        if par.pipe > 1:
            per_pass = per_shard // par.grad_accum
            _check(per_pass % par.microbatches == 0,
                   f"Parallel.microbatches={par.microbatches} does not divide the batch of a "
                   f"data shard's pipeline pass (Train.batch_size / Parallel.data / "
                   f"Parallel.grad_accum = {per_pass})")
            stages = par.pipe * par.repeats
            _check(m.n_layers % stages == 0,
                   f"Model.n_layers={m.n_layers} is not divisible by Parallel.pipe x "
                   f"pipeline_repeats = {stages} pipeline stages")
            _check(par.repeats == 1 or par.microbatches >= par.pipe,
                   f"the circular schedule needs Parallel.microbatches >= Parallel.pipe "
                   f"({par.microbatches} < {par.pipe}): a microbatch re-enters the first stage "
                   "before the others are through")
            _check(m.arch != "lax", "Model.arch='lax' is not supported with pipeline "
                   "parallelism yet (its latents would have to travel between stages); use "
                   "Parallel.pipe=1")

    def to_dict(self) -> dict:
        return {type(g).__name__: dataclasses.asdict(g)
                for g in (self.model, self.parallel, self.train, self.data)}


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split("\n")[0].split())


def parse_gin(files: Iterable[str] = (), bindings: Sequence[str] = (),
              search_paths: Iterable[str] = ()) -> None:
    """Parse gin files (as given, else under ``search_paths``) and bindings; a missing file or
    an unknown configurable or parameter is a ConfigError."""
    search_paths = list(search_paths)
    for path in search_paths:
        gin.add_config_file_search_path(path)  # for `include` inside the files
    found = []
    for name in files:
        candidates = [Path(name)] + [Path(d) / name for d in search_paths]
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            raise ConfigError(f"gin file {name!r} not found (looked in ., "
                              f"{', '.join(search_paths) or 'nowhere else'})")
        found.append(str(hit))
    try:
        gin.parse_config_files_and_bindings(found, list(bindings))
    except (ValueError, KeyError, OSError, SyntaxError) as err:  # gin raises these on bad input
        raise ConfigError(f"gin: {_one_line(err)}") from None


def load_config(**overrides) -> Config:
    """Build the validated :class:`Config` from the parsed gin bindings (plus ``overrides``)."""
    groups = {"model": Model, "parallel": Parallel, "train": Train, "data": Data}
    made = {k: overrides.get(k) or cls() for k, cls in groups.items()}
    return Config(**made)
