"""The plan interface the model is written against, and its single-device implementation
``none`` (:class:`Plan`); the tensor-parallel plans implement it in :mod:`boost_jax.parallel.plans`
(the dependency runs one way: ``parallel`` imports ``models``, never the reverse).

The decoder block (models/decoder.py) is written once against these boundary functions. Each
runs per device, inside the ``jax.shard_map`` region built by :mod:`boost_jax.parallel.runner`
when the model is placed on a mesh:

=================  ==========================================================================
``embed``          token ids -> residual stream (the plan's residual layout)
``norm``           RMSNorm of the residual for a dense (full-rank) projection's input
``norm_down``      RMSNorm + a low-rank A factor (``gemm``) + the latent activation ->
                   latent; where BTP fuses the norm statistic into the latent's collective
``down``           a row-type GEMM (A factor, or a dense o/down weight) and its reduction
``up``             a column-type GEMM (B factor, or a dense q/kv/gate/up weight)
``cross``          LaX's latent crossing (gate, norm, activation) on the latent in the plan's
                   layout; where a plan that splits the latent gathers what the crossing needs
``final_norm``     residual stream -> the final RMSNorm's full-width output the head reads
``logits``         hidden -> (possibly vocab-sharded) logits
``token_loss``     logits + targets -> per-token cross-entropy (fp32)
=================  ==========================================================================

How the same math is executed -- remat, the attention kernel, the per-layer parameter hook --
is not the plan's: it travels beside it as an :class:`~boost_jax.models.execution.Execution`.

``gemm`` arguments are callables holding the local matrix products (returning an array or a
dict of arrays), so a plan decides only where collectives go, never how a projection is
computed. Collectives are plain ``psum``/``psum_scatter``/``all_gather`` plus explicit
``pcast`` (Megatron's *f*: a replicated activation entering sharded weights); their backward
collectives come from JAX's transpose rules, never from hand-written custom_vjps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.kernels.reference import activate
from boost_jax.models.norms import rms_norm
from boost_jax.models.remat import LATENT, tag

if TYPE_CHECKING:
    from boost_jax.models.config import Model

Gemm = Callable[[jax.Array], Any]
#: LaX's crossing ``(z, prev) -> y`` on whole latents (models/projections.py)
Crossing = Callable[[jax.Array, "jax.Array | None"], jax.Array]


def _logits(x: jax.Array, head: jax.Array) -> jax.Array:
    return jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)


@jax.custom_vjp
def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """``x [b, s, d] @ head [d, V]`` -> fp32 logits ``[b, s, V]``, accumulated in fp32; the
    backward pass takes the logits' cotangent in ``x``'s dtype, so that a bf16 model's two
    backward GEMMs (``dx``, ``dhead``) run in bf16, as PyTorch's autocast runs them. Without
    it, JAX's transpose of the fp32-output dot multiplies the fp32 cotangent by the weights
    converted to fp32: on an H200 (2026-11-28, docs/BENCHMARKS.md "On a GPU") the two
    largest GEMMs of the 1B step ran as fp32/TF32 kernels at about half the bf16 rate. In
    fp32 the function is the plain dot."""
    return _logits(x, head)


def _head_logits_fwd(x, head):
    return _logits(x, head), (x, head)


def _head_logits_bwd(res, ct):
    x, head = res
    ct = ct.astype(x.dtype)
    dx = jnp.einsum("bsv,dv->bsd", ct, head, preferred_element_type=jnp.float32)
    dhead = jnp.einsum("bsd,bsv->dv", x, ct, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dhead.astype(head.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


@dataclasses.dataclass(frozen=True)
class Plan:
    """``none``: everything local; the residual stream is replicated over ``tensor``.

    A plan is immutable: everything it does is fixed when it is built
    (:func:`boost_jax.parallel.plans.get_plan`)."""

    name: ClassVar[str] = "none"
    #: logical axis name -> mesh axis (absent = replicated)
    rules: ClassVar[Mapping[str, str | None]] = {}
    #: the archs this plan can run
    archs: ClassVar[tuple[str, ...]] = ("dense", "svd", "cola", "lax")

    #: one GEMM and collective for the q/k/v (gate/up) members, or one per member
    grouped: bool = True

    @classmethod
    def check(cls, model: Model, tensor: int) -> None:
        """Raise ConfigError if ``model`` cannot run under this plan at TP degree ``tensor``."""
        if model.arch not in cls.archs:
            raise ConfigError(f"Parallel.tp_plan={cls.name!r} runs Model.arch in "
                              f"{', '.join(cls.archs)}, not {model.arch!r}"
                              + (" (use 'fullrank' for dense)" if model.arch == "dense" else
                                 " (use 'btp' or 'vanilla' for low-rank archs)"))
        for name, size in cls.divisible(model):
            if size % tensor:
                raise ConfigError(f"Parallel.tensor={tensor} does not divide {name}={size} "
                                  f"(Parallel.tp_plan={cls.name!r} shards it)")

    @classmethod
    def divisible(cls, model: Model) -> list[tuple[str, int]]:
        """The sizes this plan splits over ``tensor``."""
        return []

    @classmethod
    def spec(cls, axes: Sequence[str | None]) -> P:
        """PartitionSpec of a parameter with the given logical axes."""
        return P(*(cls.rules.get(a) if a is not None else None for a in axes))

    # --- boundary functions (per device) -------------------------------------------------
    def embed(self, tokens: jax.Array, table: jax.Array) -> jax.Array:
        """``tokens [b, s]`` int, ``table [V, d]`` -> residual ``[b, s, d]``."""
        return jnp.take(table, tokens, axis=0)

    def norm(self, h: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
        return rms_norm(h, scale, eps)

    def norm_down(self, h: jax.Array, scale: jax.Array, eps: float, gemm: Gemm,
                  act: str = "identity") -> jax.Array:
        """``act(gemm(RMSNorm(h)))``; ``act`` names the latent activation
        (:data:`boost_jax.kernels.reference.ACTIVATIONS`)."""
        return activate(tag(gemm(rms_norm(h, scale, eps)), LATENT), act)

    def down(self, x: jax.Array, gemm: Gemm):
        return tag(gemm(x), LATENT)

    def up(self, z: jax.Array, gemm: Gemm):
        return gemm(z)

    def cross(self, z: jax.Array, prev: jax.Array | None, crossing: Crossing,
              elementwise: bool) -> tuple[jax.Array, jax.Array]:
        """LaX: ``crossing(z, prev)`` -- gate, latent norm and activation -- of the latent ``z
        [b, s, (c,) r_local]`` (as :meth:`norm_down` / :meth:`down` return it) and the latent
        ``prev`` the previous block carried (``None`` in block 0). ``elementwise``: the crossing
        treats each latent coordinate on its own (identity gate, no norm). Returns ``(y,
        carry)``: the crossed latent in ``z``'s layout, which the B factor reads, and what the
        next block receives as ``prev``. Here the latent is whole: both are ``crossing(z,
        prev)``."""
        y = crossing(z, prev)
        return y, y

    def final_norm(self, h: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
        """The final RMSNorm of the residual stream, full width ``[b, s, d]``."""
        return rms_norm(h, scale, eps)

    def logits(self, x: jax.Array, head: jax.Array) -> jax.Array:
        """``x [b, s, d]``, ``head [d, V]`` -> logits ``[b, s, V]`` in fp32
        (:func:`head_logits`)."""
        return head_logits(x, head)

    def token_loss(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
        """Per-token cross-entropy ``[b, s]`` (fp32)."""
        logits = logits.astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return lse - target
