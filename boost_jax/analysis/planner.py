"""The auto-planner: every valid layout of a model on ``gpus`` devices, pruned to those that fit
in device memory and ranked by the performance model's predicted step time.

A layout is a :class:`~boost_jax.config.Parallel`: the ``(data, pipe, tensor)`` factorisation
of the GPUs (``tensor`` inside a node unless allowed across), the tensor-parallel plan the
architecture can run (``fullrank`` for dense, ``vanilla`` / ``btp`` for low-rank, ``none`` at
``tensor=1``), the remat policy (``none`` / ``lowrank`` (low-rank archs) / ``full``), the
pipeline microbatches and schedule (GPipe, or circular with every repeat count that divides the
stage's layers), gradient accumulation and the ZeRO stage (with ``data > 1``). Each candidate
is built as a real :class:`~boost_jax.config.Config`, so the config's own validation prunes the
invalid ones (a :class:`~boost_jax.config.ConfigError` is a rejected candidate, never a special
case here). Survivors are predicted with :func:`boost_jax.analysis.perf_model.predict`, kept if
their memory per device (plus :data:`HEADROOM`) fits the budget (the profile's HBM times the
share JAX may allocate) and ranked by step time; each row names its binding constraint
(:attr:`Layout.binding`).

Verification against the compiler (small shapes, simulated CPU devices) is in
:mod:`boost_jax.compiled.plan_verify`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterator

from boost_jax.analysis.hardware import Hardware
from boost_jax.analysis.perf_model import Efficiency, Prediction, predict
from boost_jax.config import Config, ConfigError, Data, Model, Parallel, Train
from boost_jax.config_fields import Derived

#: share of HBM a run may use: launch/train.sh's default XLA_PYTHON_CLIENT_MEM_FRACTION
USABLE_MEMORY = 0.90
#: a layout fits when its predicted memory plus this share of it is within the budget: the
#: memory model's error against compiled steps (compiled/plan_verify.py) stays below it
HEADROOM = 0.10
#: a layout using at least this share of its budget is bound by memory
MEMORY_BOUND = 0.80
#: an overhead (communication, bubble) at least this share of the step binds the layout
OVERHEAD_BOUND = 0.10
#: most pipeline microbatches / accumulation micro-steps tried (divisors of the batch above
#: this only add bubble-free but ever skinnier GEMMs)
MAX_SPLIT = 64
REMAT_ORDER = ("none", "lowrank", "full")
GIB = 2**30

_TERMS = {"gemm": "GEMM", "attention": "attention", "elementwise": "elementwise",
          "optimizer": "optimizer", "tp": "TP all-reduce", "pp": "PP send",
          "dp": "DP gradients", "bubble": "pipeline bubble"}
_OVERHEADS = ("tp", "pp", "dp", "bubble")


@dataclasses.dataclass(frozen=True)
class Problem(metaclass=Derived):
    """What to plan: a model, a batch and the machine.

    ``memory_fraction`` of each device's HBM is the budget, which a layout's predicted memory
    plus ``headroom`` of it must not exceed; ``cross_node_tensor`` allows
    tensor-parallel groups larger than a node; ``flash_attention``: the memory model's
    attention keeps no ``seq x seq`` scores (GPU; the CPU compiler's XLA attention does).
    """

    model: Model
    gpus: int
    batch: int
    seq_len: int
    hardware: Hardware
    gpus_per_node: int | None = None  # None: the hardware profile's
    efficiency: Efficiency = Efficiency()
    dtype: str = "bfloat16"
    memory_fraction: float = USABLE_MEMORY
    cross_node_tensor: bool = False
    flash_attention: bool = True
    headroom: float = HEADROOM

    @classmethod
    def derive(cls, v: dict) -> dict:
        """``gpus_per_node`` left None: the hardware profile's."""
        if v["gpus_per_node"] is not None:
            return v
        return {**v, "gpus_per_node": v["hardware"].gpus_per_node}

    def __post_init__(self):
        if self.gpus < 1:
            raise ConfigError(f"--gpus={self.gpus} must be a positive integer")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--gpus_per_node={self.gpus_per_node} must be a positive integer")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"--memory_fraction={self.memory_fraction} must be in (0, 1]")

    @property
    def node_hardware(self) -> Hardware:
        """The profile with this problem's GPUs per node (what decides NVLink vs network)."""
        return self.hardware.replace(gpus_per_node=self.gpus_per_node)

    @property
    def budget(self) -> float:
        """Bytes one device may use."""
        return self.hardware.hbm_bytes * self.memory_fraction

    def fits(self, memory: float) -> bool:
        """Whether ``memory`` bytes per device, plus the headroom, are within the budget."""
        return memory * (1 + self.headroom) <= self.budget


@dataclasses.dataclass(frozen=True)
class Layout:
    """One ranked layout: its ``Parallel``, prediction and memory per device (bytes)."""

    parallel: Parallel
    prediction: Prediction
    memory: float
    budget: float
    tokens: int  # per step

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def mfu(self, hw: Hardware) -> float:
        return self.prediction.model_flops / self.step_s / hw.peak_flops

    @property
    def binding(self) -> str:
        """What bounds this layout: memory when at least :data:`MEMORY_BOUND` of the budget is
        used, else the largest overhead (TP, PP, DP communication, bubble) when at least
        :data:`OVERHEAD_BOUND` of the step, else the largest compute term."""
        if self.memory >= MEMORY_BOUND * self.budget:
            return f"memory {self.memory / GIB:.0f}/{self.budget / GIB:.0f} GiB"
        b, step = self.prediction.breakdown, self.step_s
        worst = max(_OVERHEADS, key=lambda k: b[k])
        if b[worst] >= OVERHEAD_BOUND * step:
            return f"{_TERMS[worst]} {100 * b[worst] / step:.0f}%"
        top = max(b, key=lambda k: b[k])
        return f"compute ({_TERMS[top]} {100 * b[top] / step:.0f}%)"

    def describe(self) -> str:
        """``tensor=4 pipe=2 data=1 btp remat=lowrank micro=4 circular x2 accum=1 zero=0``."""
        p = self.parallel
        out = f"data={p.data} pipe={p.pipe} tensor={p.tensor} {p.tp_plan} remat={p.remat}"
        if p.pipe > 1:
            out += f" micro={p.microbatches} {p.pipeline_schedule}"
            out += f"x{p.repeats}" if p.repeats > 1 else ""
        return out + f" accum={p.grad_accum} zero={p.zero}"

    def to_json(self, hw: Hardware) -> dict:
        p = self.parallel
        return {"parallel": {f.name: getattr(p, f.name) for f in dataclasses.fields(p)},
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu(hw),
                "memory_gib": self.memory / GIB, "budget_gib": self.budget / GIB,
                "memory_breakdown_gib": {k: v / GIB for k, v in self.prediction.memory.items()},
                "binding": self.binding, "breakdown_s": self.prediction.breakdown}


@dataclasses.dataclass
class Plan:
    """The planner's answer: fitting layouts fastest first, and what was pruned."""

    problem: Problem
    layouts: list[Layout]
    enumerated: int  # candidates built
    invalid: Counter  # ConfigError message -> count
    over_memory: list[Layout]  # valid but above the budget, least memory first
    seconds: float


def _divisors(n: int, cap: int = MAX_SPLIT) -> list[int]:
    return [k for k in range(1, min(n, cap) + 1) if n % k == 0]


def plans_for(model: Model, tensor: int) -> tuple[str, ...]:
    """The tensor-parallel plans ``model.arch`` can run at degree ``tensor``."""
    if tensor == 1:
        return ("none",)
    return ("fullrank",) if model.arch == "dense" else ("btp", "vanilla")


def remats_for(model: Model) -> tuple[str, ...]:
    return REMAT_ORDER if model.is_lowrank else ("none", "full")


def _pipelines(model: Model, pipe: int, per_pass: int) -> Iterator[dict]:
    """Microbatches and schedule of a pipeline pass of ``per_pass`` rows over ``pipe``
    stages (nothing to choose without pipelining)."""
    if pipe == 1:
        yield {}
        return
    for micro in _divisors(per_pass):
        yield dict(microbatches=micro)
        if micro >= pipe and model.n_layers % pipe == 0:
            for repeats in _divisors(model.n_layers // pipe)[1:]:
                yield dict(microbatches=micro, pipeline_schedule="circular",
                           pipeline_repeats=repeats)


def candidates(problem: Problem) -> Iterator[dict]:
    """Every layout to try, as ``Parallel`` keyword arguments (``Parallel`` and
    :class:`Config` validate them)."""
    m, gpus = problem.model, problem.gpus
    for tensor in _divisors(gpus, gpus):
        if tensor > problem.gpus_per_node and not problem.cross_node_tensor:
            continue
        for pipe in _divisors(gpus // tensor, gpus):
            data = gpus // tensor // pipe
            if problem.batch % data:
                continue
            per_shard = problem.batch // data
            for accum in _divisors(per_shard):
                for pipeline in _pipelines(m, pipe, per_shard // accum):
                    for zero in (0, 1, 3) if data > 1 else (0,):
                        for remat in remats_for(m):
                            for plan in plans_for(m, tensor):
                                yield dict(data=data, pipe=pipe, tensor=tensor,
                                           tp_plan=plan, remat=remat, grad_accum=accum,
                                           zero=zero, **pipeline)


def evaluate(problem: Problem, parallel: Parallel) -> Layout:
    """Predict one (valid) layout of ``problem``."""
    pred = predict(problem.model, parallel, problem.batch, problem.seq_len,
                   problem.node_hardware, problem.efficiency, problem.dtype,
                   flash_attention=problem.flash_attention)
    return Layout(parallel, pred, sum(pred.memory.values()), problem.budget,
                  problem.batch * problem.seq_len)


def _rank_key(layout: Layout) -> tuple:
    """Fastest first; then least memory; then the simplest layout."""
    p = layout.parallel
    return (round(layout.step_s, 9), layout.memory, p.tensor, p.pipe, p.zero,
            REMAT_ORDER.index(p.remat), p.grad_accum, p.microbatches, p.repeats, p.tp_plan)


def plan(problem: Problem) -> Plan:
    """Enumerate, validate, predict, prune and rank (see the module docstring)."""
    start = time.perf_counter()
    train = Train(batch_size=problem.batch, seq_len=problem.seq_len, dtype=problem.dtype)
    data = Data()
    invalid: Counter = Counter()
    fits, over = [], []
    enumerated = 0
    for options in candidates(problem):
        enumerated += 1
        try:
            parallel = Parallel(**options)
            Config(problem.model, parallel, train, data)
        except ConfigError as err:
            invalid[str(err)] += 1
            continue
        layout = evaluate(problem, parallel)
        (fits if problem.fits(layout.memory) else over).append(layout)
    fits.sort(key=_rank_key)
    over.sort(key=lambda lay: (lay.memory, lay.step_s))
    return Plan(problem, fits, enumerated, invalid, over, time.perf_counter() - start)


def emit_gin(layout: Layout, problem: Problem, batch: bool = True) -> str:
    """Gin bindings of ``layout`` (every ``Parallel`` field) plus the batch, sequence length
    and compute dtype it was planned for: ``python -m boost_jax.train --gin_file=<it>`` (with
    the model's own bindings) runs it."""
    p = layout.parallel
    lines = [f"# boost_jax.plan: {layout.describe()}",
             f"# predicted {layout.step_s:.3f} s/step, {layout.tokens_per_s:,.0f} tokens/s, "
             f"{layout.memory / GIB:.1f} GiB/device of {layout.budget / GIB:.1f} on "
             f"{problem.hardware.name}",
             *_model_bindings(problem.model)]
    lines += [f"Parallel.{f.name} = {getattr(p, f.name)!r}" for f in dataclasses.fields(p)]
    if batch:
        lines += [f"Train.batch_size = {problem.batch}", f"Train.seq_len = {problem.seq_len}",
                  f"Train.dtype = {problem.dtype!r}"]
    return "\n".join(lines) + "\n"


def _model_bindings(model: Model) -> list[str]:
    """``Model.*`` bindings that rebuild ``model``: its arch and size, and every field the
    preset alone would not give."""
    try:
        base = Model(arch=model.arch, size=model.size)
    except ConfigError:  # size='custom': every dimension
        base = None
    lines = []
    for f in dataclasses.fields(model):
        value = getattr(model, f.name)
        if f.name in ("arch", "size") or base is None or value != getattr(base, f.name):
            lines.append(f"Model.{f.name} = {value!r}")
    return lines
