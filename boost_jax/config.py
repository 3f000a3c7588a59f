"""The configuration: ``Model`` (defined in models/config.py), ``Parallel`` (parallel/config.py),
``Train`` and ``Data`` (data/config.py), and ``Config``, the four together.

Each class is a frozen dataclass whose fields are the public gin bindings
(``--gin_param=Model.arch='svd'``), each with its one-line meaning (``--print_config`` lists
them). Construction checks every field's type and validates the values, and raises
:class:`ConfigError` with a one-line message naming the offending binding, so bad input is
reported before anything is compiled. The classes know nothing of gin: a command's entry point
reads the bindings once (:func:`boost_jax.gin_io.load_config`) and passes the
:class:`Config` down; ``Model()`` anywhere else is the defaults. Gin text in and out (files,
bindings, the operative config of a run) is in :mod:`boost_jax.gin_io`.
"""

from __future__ import annotations

import dataclasses

from boost_jax.config_fields import FREE, MATCH, NOTE, Derived
from boost_jax.config_fields import check as _check
from boost_jax.config_fields import config_field as _field
from boost_jax.data.config import PACKINGS, Data  # noqa: F401  (re-exported, as Model is)
from boost_jax.errors import ConfigError  # noqa: F401  (re-exported: the one error type)
from boost_jax.models.config import (  # noqa: F401  (re-exported: the four groups here)
    ARCHS,
    LATENT_ACT_ARCHS,
    LAX_GATES,
    LOWRANK_INITS,
    Model,
)
from boost_jax.parallel.config import (  # noqa: F401  (re-exported, as Model is)
    ATTENTIONS,
    DTYPES,
    KERNELS,
    NORM_PAYLOADS,
    REMATS,
    RMSNORMS,
    SCHEDULES,
    TP_PLANS,
    ZERO_STAGES,
    Parallel,
)
from boost_jax.parallel.plans import check as check_plan

NONFINITE = ("stop", "skip")
OPTIMIZERS = ("adamw", "loro")
LORO_REGULARS = ("authors", "adamw")


@dataclasses.dataclass(frozen=True)
class Train(metaclass=Derived):
    """Optimisation, schedule, logging and checkpoint cadence (CoLA's recipe as defaults)."""

    steps: int = _field(300, "optimizer steps of the run", FREE)
    batch_size: int = _field(16, "global batch, in sequences", NOTE)
    micro_batch_size: int | None = _field(None, "rows a data replica runs per micro-step: "
                                          "Parallel.grad_accum = batch_size / (Parallel.data "
                                          "x this) (None: as set)", FREE)
    seq_len: int = _field(128, "tokens per sequence", NOTE)
    seed: int = _field(0, "seed of the initialisation and the data order", NOTE)
    dtype: str = _field("float32", "compute dtype: float32 | bfloat16 (parameters stay "
                        "float32)", NOTE)
    learning_rate: float = _field(3e-3, "peak learning rate (AdamW)", NOTE)
    min_lr_ratio: float = _field(0.1, "final learning rate of the cosine, as a fraction of the "
                                 "peak", NOTE)
    warmup_steps: int | None = _field(None, "linear warm-up steps (None: 10% of the schedule "
                                      "horizon)", NOTE)
    schedule_steps: int | None = _field(None, "cosine horizon (None: steps); pin it to extend a "
                                        "run", NOTE)
    weight_decay: float = _field(0.01, "AdamW weight decay", NOTE)
    grad_clip: float = _field(0.5, "clip the global gradient norm to this (0: no clipping)",
                              NOTE)
    warmup_from_zero: bool = _field(False, "the first update at learning rate 0, as the "
                                    "low-rank papers' LambdaLR warm-up (alvin-zyl/CoLA "
                                    "training_utils.py line 139); False: at lr / "
                                    "warmup_steps", NOTE)
    decay_norms: bool = _field(False, "weight decay on the norm gains and biases too, as the "
                               "papers' one torch AdamW group (training_utils.py line 228); "
                               "False: on the weight matrices and embeddings only", NOTE)
    loss_group_rows: int | None = _field(None, "the loss is the mean over groups of this many "
                                         "consecutive rows of each group's token mean: the "
                                         "papers' per-GPU micro-batch mean (main.py lines "
                                         "518-519, their --batch_size); None: the token mean "
                                         "of the global batch", NOTE)
    beta1: float = _field(0.9, "AdamW beta1", NOTE)
    beta2: float = _field(0.999, "AdamW beta2", NOTE)
    checkpoint_every: int = _field(100, "steps between checkpoints", FREE)
    keep_checkpoints: int = _field(3, "newest checkpoints kept", FREE)
    eval_every: int = _field(100, "steps between evaluations on the held-out split", FREE)
    eval_batches: int = _field(4, "held-out batches per evaluation (0: no evaluation; fewer "
                               "when the split is smaller)", FREE)
    log_every: int = _field(10, "steps between progress lines", FREE)
    peak_tflops: float | None = _field(None, "per-device peak TFLOP/s for MFU (None: looked up "
                                       "from the device kind)", FREE)
    nonfinite: str = _field("stop", "a step with a non-finite loss or gradient norm is never "
                            "applied; then stop (end the run, no checkpoint over the last good "
                            "one) | skip (go on, up to max_skips in a row)", FREE)
    max_skips: int = _field(10, "nonfinite='skip': most steps skipped in a row", FREE)
    optimizer: str = _field("adamw", "adamw | loro (low-rank Riemannian steps on the svd "
                            "factors, loro_regular's rule on the rest)", MATCH)
    factor_lr_scale: float = _field(1.0, "adamw: the low-rank factors' (A, B) update times "
                                    "this; negative: rank/d_model, LORO's scaler", NOTE)
    loro_exact_every: int = _field(500, "loro: steps between exact Riemannian steps (the "
                                   "paper's K)", NOTE)
    loro_regular: str = _field("authors", "loro: rule of the non-factor parameters (embeddings, "
                               "norms, head): authors (LOROAdamW's regular group: eps 1e-6 on "
                               "sqrt of the uncorrected v, bias correction in the step size, "
                               "decay lr*wd on all of them) | adamw (optax AdamW, eps 1e-8, "
                               "norms not decayed)", NOTE)
    loro_lr_scaler: float = _field(-1.0, "loro: factor of the approximate step's direction; "
                                   "negative: rank/d_model (the authors' runs)", NOTE)
    loro_reset_moments: bool = _field(True, "loro: zero every Adam moment and count after each "
                                      "exact step (the authors' runs: --loro_refresh all)", NOTE)
    sample_every: int | None = _field(None, "steps between greedy samples from "
                                      "sample_prompts, logged to metrics and TensorBoard "
                                      "(None: never)", FREE)
    sample_prompts: tuple[str, ...] = _field(("ROMEO:", "The king"), "prompts of the logged "
                                             "samples", FREE)
    sample_tokens: int = _field(32, "new tokens per logged sample", FREE)
    profile_steps: int = _field(0, "steps traced with jax.profiler into <workdir>/profile/ "
                                "(0: no trace)", FREE)
    profile_start_step: int = _field(10, "the first traced step (profile_steps > 0)", FREE)
    profile_processes: tuple[int, ...] = _field((0,), "the processes that write a trace "
                                                "(profile_steps > 0)", FREE)
    hang_timeout_s: float | None = _field(0.0, "seconds without a finished step before the "
                                          "run dumps its threads' stacks and exits with code "
                                          "75 (0: max(600, 20 x median step time); None: "
                                          "never)", FREE)
    wandb: bool = _field(False, "also log to Weights & Biases (the config, every "
                         "metrics.jsonl record, the samples; run under <workdir>/wandb, "
                         "resumed by the id in <workdir>/wandb_run_id); needs "
                         "pip install 'boost_jax[wandb]'", FREE)
    wandb_project: str = _field("boost_jax", "Train.wandb: the W&B project", FREE)
    wandb_name: str | None = _field(None, "Train.wandb: the W&B run's name (None: the "
                                    "workdir's name)", FREE)

    @classmethod
    def derive(cls, v: dict) -> dict:
        """``warmup_steps`` left None: a tenth of the schedule's horizon --
        :class:`~boost_jax.config_fields.Derived`."""
        if v["warmup_steps"] is not None:
            return v
        return {**v, "warmup_steps": (v["schedule_steps"] or v["steps"]) // 10}

    def __post_init__(self):
        _check(self.nonfinite in NONFINITE,
               f"Train.nonfinite={self.nonfinite!r} must be one of {', '.join(NONFINITE)}")
        _check(self.max_skips >= 0, f"Train.max_skips={self.max_skips} must be >= 0")
        _check(self.optimizer in OPTIMIZERS,
               f"Train.optimizer={self.optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
        _check(self.loro_regular in LORO_REGULARS, f"Train.loro_regular={self.loro_regular!r} "
               f"must be one of {', '.join(LORO_REGULARS)}")
        _check(self.loro_lr_scaler != 0, "Train.loro_lr_scaler=0 would freeze the factors' "
               "approximate steps; use a positive factor or -1 (rank/d_model)")
        _check(self.factor_lr_scale != 0, "Train.factor_lr_scale=0 would freeze the factors; "
               "use a positive factor or -1 (rank/d_model)")
        _check(bool(self.sample_prompts) and all(self.sample_prompts),
               f"Train.sample_prompts={self.sample_prompts!r} must be non-empty strings")
        for name, value in (("sample_every", self.sample_every),
                            ("micro_batch_size", self.micro_batch_size),
                            ("loss_group_rows", self.loss_group_rows)):
            _check(value is None or value > 0, f"Train.{name}={value} must be a positive "
                   "integer or None")
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "keep_checkpoints",
                     "eval_every", "log_every", "loro_exact_every", "sample_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0,
                   f"Train.{name}={value!r} must be a positive integer")
        _check(self.dtype in DTYPES, f"Train.dtype={self.dtype!r} is not one of {DTYPES}")
        self._check_operations()
        _check(bool(self.wandb_project.strip()),
               f"Train.wandb_project={self.wandb_project!r} must be a non-empty string")
        _check(0 <= self.warmup_steps < self.horizon,
               f"Train.warmup_steps={self.warmup_steps} must be in [0, schedule horizon="
               f"{self.horizon})")
        _check(self.eval_batches >= 0, f"Train.eval_batches={self.eval_batches} must be >= 0")
        _check(self.learning_rate > 0, f"Train.learning_rate={self.learning_rate} must be > 0")
        _check(self.grad_clip >= 0, f"Train.grad_clip={self.grad_clip} must be >= 0 (0: no "
               "clipping)")
        _check(0.0 <= self.min_lr_ratio <= 1.0,
               f"Train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")

    def _check_operations(self) -> None:
        """The profiling window and the hang watchdog's limit."""
        _check(self.profile_steps >= 0,
               f"Train.profile_steps={self.profile_steps} must be >= 0 (0: no trace)")
        _check(self.profile_start_step >= 1,
               f"Train.profile_start_step={self.profile_start_step} must be >= 1")
        _check(not self.profile_steps or self.profile_start_step <= self.steps,
               f"Train.profile_start_step={self.profile_start_step} is after the run's last "
               f"step (Train.steps={self.steps}): the trace would be empty")
        _check(bool(self.profile_processes) and min(self.profile_processes) >= 0,
               f"Train.profile_processes={self.profile_processes!r} must name process "
               "indices >= 0, e.g. (0,)")
        _check(self.hang_timeout_s is None or self.hang_timeout_s >= 0,
               f"Train.hang_timeout_s={self.hang_timeout_s} must be >= 0 (0: automatic) or "
               "None (no watchdog)")

    @property
    def horizon(self) -> int:
        """Steps over which the learning-rate schedule decays."""
        return self.schedule_steps or self.steps


@dataclasses.dataclass(frozen=True)
class Config(metaclass=Derived):
    """The four config groups together, as the trainer uses them (``Parallel.grad_accum``
    derived from ``Train.micro_batch_size`` when that is set)."""

    model: Model
    parallel: Parallel
    train: Train
    data: Data

    def __post_init__(self):
        bins = min(self.data.packing_bins, self.train.batch_size)
        _check(self.data.packing != "document" or self.train.batch_size % bins == 0,
               f"Train.batch_size={self.train.batch_size} is not a multiple of "
               f"Data.packing_bins={bins} (document packing fills groups of that many rows)")
        _check(self.parallel.attention != "cudnn" or self.data.packing != "document"
               or self.data.max_segments is not None,
               "Parallel.attention='cudnn' on packed rows needs Data.max_segments (cuDNN's "
               "packed layout is built for a bound on documents per row), e.g. "
               "--gin_param=Data.max_segments=64")
        _check(self.train.batch_size % self.parallel.data == 0,
               f"Train.batch_size={self.train.batch_size} is not divisible by "
               f"Parallel.data={self.parallel.data}")
        check_plan(self.model, self.parallel)
        par, m = self.parallel, self.model
        per_shard = self.train.batch_size // par.data
        group = self.train.loss_group_rows
        _check(group is None or per_shard % group == 0,
               f"Train.loss_group_rows={group} does not divide the batch of a data shard "
               f"(Train.batch_size / Parallel.data = {per_shard})")
        _check(group is None or par.pipe == 1, "Train.loss_group_rows is not supported with "
               "pipeline parallelism yet; use Parallel.pipe=1")
        _check(per_shard % par.grad_accum == 0,
               f"Parallel.grad_accum={par.grad_accum} does not divide the batch of a data shard "
               f"(Train.batch_size / Parallel.data = {per_shard})")
        if par.pipe > 1:
            per_pass = per_shard // par.grad_accum
            _check(per_pass % par.microbatches == 0,
                   f"Parallel.microbatches={par.microbatches} does not divide the batch of a "
                   f"data shard's pipeline pass (Train.batch_size / Parallel.data / "
                   f"Parallel.grad_accum = {per_pass})")
            pass_tokens = per_pass * self.train.seq_len
            _check(pass_tokens % par.pipe == 0,
                   f"Parallel.pipe={par.pipe} does not divide the {pass_tokens} tokens of a data "
                   f"shard's pipeline pass (Train.batch_size / Parallel.data / "
                   f"Parallel.grad_accum x Train.seq_len): each stage embeds and runs the head "
                   f"on an equal share of them")
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

    @classmethod
    def derive(cls, v: dict) -> dict:
        """``Train.micro_batch_size`` set: ``Parallel.grad_accum`` follows (left 1, or equal)
        -- :class:`~boost_jax.config_fields.Derived`."""
        train, parallel = v["train"], v["parallel"]
        micro = train.micro_batch_size
        if micro is None or train.batch_size % parallel.data:  # the latter: __post_init__'s
            return v
        per_shard = train.batch_size // parallel.data
        _check(per_shard % micro == 0,
               f"Train.micro_batch_size={micro} does not divide the batch of a data shard "
               f"(Train.batch_size / Parallel.data = {per_shard})")
        accum = per_shard // micro
        _check(parallel.grad_accum in (1, accum),
               f"Parallel.grad_accum={parallel.grad_accum} contradicts "
               f"Train.micro_batch_size={micro} (which makes it {accum}); set one of them")
        return {**v, "parallel": dataclasses.replace(parallel, grad_accum=accum)}

    def to_dict(self) -> dict:
        return {type(g).__name__: dataclasses.asdict(g)
                for g in (self.model, self.parallel, self.train, self.data)}
