"""How the decoder runs its blocks, beside what a plan computes (models/boundaries.py): the
activation-checkpointing policy, the attention core's implementation, cuDNN's packed slots and
the hook through which each layer's parameters reach its block.

A plan says where the tensor-parallel collectives go; an :class:`Execution` says how the same
math is executed -- none of its fields changes a value the model computes, only what is kept
for the backward pass, which kernel runs attention and how the stored parameters are prepared
per layer. The runner (parallel/runner.py) builds both, once, from the configuration, the
compute dtype and the platform; the model receives both as arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

#: a layer's stored parameters -> the ones its block computes with; ``keep=True``: ``(used,
#: kept)``, the second a copy for a pipeline's later iterations
LayerHook = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the decoder's blocks run (all defaults: a single device, nothing rematerialised,
    XLA's attention, the parameters used as stored).

    Attributes:
      remat: activation-checkpointing policy of the blocks (``Parallel.remat``,
        models/remat.py).
      attention, packed_attention: the attention core's implementation for unpacked / packed
        rows, ``xla`` or ``cudnn`` (the runner's choice from ``Parallel.attention``, the compute
        dtype and the platform).
      segment_slots: cuDNN's packed path: runs of equal segment ids per packed row
        (models/attention.py :func:`packed_slots`, from ``Data.max_segments``); None: unbounded.
      layer_hook: the zero layout's per-layer hook (parallel/zero.py
        ``DataLayout.layer_params``); None: the identity.
      layer_gathers: does the hook all-gather (FSDP: the block is then always checkpointed,
        models/remat.py).
    """

    remat: str = "none"
    attention: str = "xla"
    packed_attention: str = "xla"
    segment_slots: int | None = None
    layer_hook: LayerHook | None = None
    layer_gathers: bool = False

    def layer_params(self, layer, keep: bool = False):
        """One layer's parameters (stacked axes indexed away) as its block uses them.
        ``keep``: returns ``(used, kept)``, the second a copy for a pipeline's later
        iterations (only with a hook that reduces in the loop, :attr:`reduces_in_loop`)."""
        if self.layer_hook is None:
            return (layer, layer) if keep else layer
        return self.layer_hook(layer, keep=keep) if keep else self.layer_hook(layer)

    @property
    def reduces_in_loop(self) -> bool:
        """Does the hook reduce each layer's gradient over ``data`` in the backward loop
        (zero stages 0 and 1, parallel/zero.py ``in_loop``)?"""
        return self.layer_hook is not None and not self.layer_gathers

    def prepared(self) -> Execution:
        """This execution for parameters already through :meth:`layer_params` (the hook
        dropped): a pipeline's iterations after the first run on the kept copies."""
        return dataclasses.replace(self, layer_hook=None)

    def attention_for(self, packed: bool) -> str:
        """The attention implementation for packed (``segments`` given) or unpacked rows."""
        return self.packed_attention if packed else self.attention
