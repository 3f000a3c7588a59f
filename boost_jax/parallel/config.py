"""The ``Parallel`` config group: the ``(data, pipe, tensor)`` mesh, the tensor-parallel plan
and how a step runs on it (pipeline, ZeRO, remat, attention, kernels). Re-exported by
:mod:`boost_jax.config` beside the other groups; the parallel code imports it from here, so
that it never depends on the top-level configuration."""

from __future__ import annotations

import dataclasses

from boost_jax.config_fields import NOTE, Derived
from boost_jax.config_fields import check as _check
from boost_jax.config_fields import config_field as _field

TP_PLANS = ("none", "fullrank", "vanilla", "btp")
RMSNORMS = ("online", "sync")
NORM_PAYLOADS = ("lanes", "compute", "float32")
REMATS = ("none", "full", "lowrank", "lowrank_attn")
SCHEDULES = ("gpipe", "circular")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "xla", "cudnn")
KERNELS = ("auto", "triton", "xla")
ZERO_STAGES = (0, 1, 3)  # 2 would only differ from 1 by when gradients are freed


@dataclasses.dataclass(frozen=True)
class Parallel(metaclass=Derived):
    """The ``(data, pipe, tensor)`` device mesh and the tensor-parallel plan.

    ``tp_plan``: ``none`` (no TP), ``fullrank`` (Megatron, dense arch), ``vanilla`` (naive
    low-rank TP) or ``btp`` (bottleneck-aware TP). ``rmsnorm`` (btp): ``online`` (the norm
    statistic rides in the A factor's all-reduce) or ``sync`` (its own all-reduce first).
    ``norm_payload`` (btp online): how the fused all-reduce carries the statistic in bf16 runs:
    ``lanes`` (exact: three bf16 lanes per rank, ``3 tensor - 1`` elements more), ``compute``
    (rounded to bf16) or ``float32`` (the whole payload in fp32); parallel/online_rmsnorm.py.

    Pipeline parallelism over ``pipe``: ``pipeline_schedule`` ``gpipe`` or ``circular``
    (``pipeline_repeats`` passes of every microbatch over the stages), ``microbatches`` per data
    shard and pipeline pass.

    ``grad_accum``: gradient accumulation, ``K`` micro-steps per step, each on ``1/K`` of every
    data shard's rows (a pipeline pass each when pipelining); gradients are summed in fp32 and
    reduced over ``data`` once.

    ``zero``: how the state is laid out over ``data`` (parallel/zero.py). ``0`` replicates it;
    ``1`` (ZeRO-1) splits the optimizer state, reduce-scatters the gradients and all-gathers
    the updated parameters; ``3`` (FSDP) splits the parameters too and gathers each layer's
    inside the layer loop, in the compute dtype (its gradients are reduce-scattered there).
    ``reduce_dtype``: the dtype every gradient reduction over ``data`` sums in.
    """

    data: int = _field(2, "data-parallel degree (mesh axis 'data')", NOTE)
    pipe: int = _field(1, "pipeline stages (mesh axis 'pipe')", NOTE)
    tensor: int = _field(4, "tensor-parallel degree (mesh axis 'tensor')", NOTE)
    tp_plan: str = _field("btp", "tensor-parallel plan: " + " | ".join(TP_PLANS), NOTE)
    rmsnorm: str = _field("online", "btp: online (the norm statistic rides in the A factors' "
                          "all-reduce) | sync (an all-reduce of its own)", NOTE)
    norm_payload: str = _field("lanes", "btp online, bf16: the statistic in the fused all-reduce: "
                               "lanes (exact, 3 bf16 lanes per rank) | compute (rounded to "
                               "bf16) | float32 (an fp32 payload)", NOTE)
    grouping: bool = _field(True, "one GEMM (and collective) for the q/k/v and gate/up A "
                            "factors", NOTE)
    remat: str = _field("none", "activation checkpointing: " + " | ".join(REMATS), NOTE)
    microbatches: int = _field(1, "pipeline microbatches per data shard and pipeline pass", NOTE)
    pipeline_schedule: str = _field("gpipe", "pipeline schedule: " + " | ".join(SCHEDULES), NOTE)
    pipeline_repeats: int = _field(1, "circular schedule: passes of each microbatch over the "
                                   "stages", NOTE)
    grad_accum: int = _field(1, "gradient accumulation micro-steps per step", NOTE)
    zero: int = _field(0, "state layout over 'data': 0 replicated | 1 ZeRO-1 (optimizer state "
                       "split) | 3 FSDP (parameters split too)", NOTE)
    reduce_dtype: str = _field("float32", "dtype of the gradients' reduction over 'data' "
                               "(all-reduce, reduce-scatter): float32 | bfloat16", NOTE)
    attention: str = _field("auto", "attention core: auto (cuDNN on a GPU in bf16 once its GPU "
                            "parity is recorded in gpu_verified.py, packed rows once the packed "
                            "path's is too; else XLA) | xla | cudnn", NOTE)
    kernels: str = _field("auto", "btp chunk-boundary ops: auto (Triton on a GPU with "
                          "jax-triton once the kernels' GPU parity test is recorded in "
                          "gpu_verified.py, else XLA) | triton | xla", NOTE)

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
        _check(self.norm_payload in NORM_PAYLOADS, f"Parallel.norm_payload={self.norm_payload!r} "
               f"is not one of {', '.join(NORM_PAYLOADS)}")
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
        for name, choices in (("attention", ATTENTIONS), ("kernels", KERNELS)):
            _check(getattr(self, name) in choices, f"Parallel.{name}={getattr(self, name)!r} "
                   f"is not one of {', '.join(choices)}")
        _check(self.reduce_dtype in DTYPES, f"Parallel.reduce_dtype={self.reduce_dtype!r} is "
               f"not one of {', '.join(DTYPES)}")
        _check(self.zero in ZERO_STAGES,
               f"Parallel.zero={self.zero!r} is not one of {', '.join(map(str, ZERO_STAGES))}")

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
