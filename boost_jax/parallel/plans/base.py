"""The plan interface, and ``none``: the single-device (or pure data-parallel) reference.

The decoder block (models/decoder.py) is written once against these boundary functions. Each
runs per device inside the ``jax.shard_map`` region built by :mod:`boost_jax.parallel.runner`:

=================  ==========================================================================
``embed``          token ids -> residual stream (the plan's residual layout)
``norm``           RMSNorm of the residual for a dense (full-rank) projection's input
``norm_down``      RMSNorm + a low-rank A factor (``gemm``) -> latent; where BTP fuses the
                   norm statistic into the latent's collective
``down``           a row-type GEMM (A factor, or a dense o/down weight) and its reduction
``up``             a column-type GEMM (B factor, or a dense q/kv/gate/up weight)
``final_hidden``   residual stream -> the full hidden state the final norm and head read
``logits``         hidden -> (possibly vocab-sharded) logits
``token_loss``     logits + targets -> per-token cross-entropy (fp32)
=================  ==========================================================================

``gemm`` arguments are callables holding the local matrix product, so a plan decides only where
collectives go, never how the projection is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from boost_jax.models.norms import rms_norm

Gemm = Callable[[jax.Array], jax.Array]

DATA, PIPE, TENSOR = "data", "pipe", "tensor"
MESH_AXES = (DATA, PIPE, TENSOR)


class Plan:
    """``none``: everything local; the residual stream is replicated over ``tensor``."""

    name = "none"
    #: logical axis name -> mesh axis (absent = replicated)
    rules: Mapping[str, str | None] = {}

    def spec(self, axes: Sequence[str | None]) -> P:
        """PartitionSpec of a parameter with the given logical axes."""
        return P(*(self.rules.get(a) if a is not None else None for a in axes))

    # --- boundary functions (per device) -------------------------------------------------
    def embed(self, tokens: jax.Array, table: jax.Array) -> jax.Array:
        """``tokens [b, s]`` int, ``table [V, d]`` -> residual ``[b, s, d]``."""
        return jnp.take(table, tokens, axis=0)

    def norm(self, h: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
        return rms_norm(h, scale, eps)

    def norm_down(self, h: jax.Array, scale: jax.Array, eps: float, gemm: Gemm) -> jax.Array:
        return gemm(rms_norm(h, scale, eps))

    def down(self, x: jax.Array, gemm: Gemm) -> jax.Array:
        return gemm(x)

    def up(self, z: jax.Array, gemm: Gemm) -> jax.Array:
        return gemm(z)

    def final_hidden(self, h: jax.Array) -> jax.Array:
        return h

    def logits(self, x: jax.Array, head: jax.Array) -> jax.Array:
        """``x [b, s, d]``, ``head [d, V]`` -> logits ``[b, s, V]`` in fp32."""
        return jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)

    def token_loss(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
        """Per-token cross-entropy ``[b, s]`` (fp32)."""
        logits = logits.astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return lse - target
