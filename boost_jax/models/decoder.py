"""The LLaMA-style decoder: embedding -> blocks -> final RMSNorm -> head; the block math, once.

Every function here runs *per device*: under a tensor-parallel plan it sees local shards
(``d/p`` residual columns, ``h/p`` heads, ...) and the plan's boundary functions put the
collectives in place. Shapes in docstrings are local; which mesh axis a value is split on is
the plan's choice (parallel/plans).

Parameters are a nested dict (the Flax NNX state of :class:`Decoder` as pure arrays). Block
parameters are stacked on a leading layer axis and applied with ``lax.scan``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.models.attention import Segments, cached_attention, causal_attention
from boost_jax.models.boundaries import Plan
from boost_jax.models.config import Model
from boost_jax.models.execution import Execution
from boost_jax.models.init import Init, ParamDef, param, param_defs
from boost_jax.models.projections import Fanout, Single
from boost_jax.models.remat import ATTENTION, RESIDUAL, checkpointed, tag


class Block(nnx.Module):
    """Pre-norm block: ``h += o(attn(qkv(norm(h))))``, then ``h += down(mlp(gate_up(norm(h))))``."""

    def __init__(self, cfg: Model):
        d = cfg.d_model
        self.eps, self.theta, self.head_dim = cfg.norm_eps, cfg.rope_theta, cfg.head_dim
        # CoLA's only_lr_act=True drops the SiLU on the full-width gate (cola, lax only)
        self.silu_gate = not cfg.bilinear_mlp
        kw = dict(init_std=cfg.init_std, lax_gate=cfg.lax_gate, lax_norm=cfg.lax_latent_norm,
                  init=cfg.lowrank_init)
        self.attn_norm = param((d,), Init("ones"), ("embed",))
        self.qkv = Fanout(cfg.arch, d, (("q", 1, d, "q_heads"), ("kv", 2, cfg.d_kv, "kv_heads")),
                          cfg.attn_rank, **kw)
        self.o = Single(cfg.arch, d, d, "q_heads", cfg.attn_rank, **kw)
        self.mlp_norm = param((d,), Init("ones"), ("embed",))
        self.gate_up = Fanout(cfg.arch, d, (("gu", 2, cfg.d_ff, "mlp"),), cfg.mlp_rank, **kw)
        self.down = Single(cfg.arch, cfg.d_ff, d, "mlp", cfg.mlp_rank, **kw)

    def __call__(self, h: jax.Array, cross: dict | None, plan: Plan,
                 segments: Segments | None = None, execution: Execution = Execution()
                 ) -> tuple[jax.Array, dict]:
        """Residual ``h [b, s, d_local]`` -> ``(h, latents)``.

        ``cross`` holds the previous block's LaX latents (``None`` for block 0 or non-LaX
        archs); the returned dict holds this block's (empty unless LaX). ``segments``: the
        document layout of packed rows (models/attention.py), or ``None``; ``execution``
        chooses the attention kernel.
        """
        def attend(q, k, v):
            impl = execution.attention_for(packed=segments is not None)
            out = causal_attention(q, k, v, self.theta, segments, impl, execution.segment_slots)
            return tag(out, ATTENTION), None

        h, latents, _ = self._apply(h, cross, plan, attend)
        return h, latents

    def cached(self, h: jax.Array, cross: dict | None, plan: Plan, cache: tuple[jax.Array, ...],
               layer: jax.Array | int, positions: jax.Array
               ) -> tuple[jax.Array, dict, tuple[jax.Array, jax.Array]]:
        """:meth:`__call__` for generation: the ``s`` new tokens of ``h [b, s, d_local]`` at
        ``positions [b, s]`` attend over layer ``layer`` of the key/value caches ``(k, v)``,
        each ``[n_layers, b, kv_heads, max_len, head_dim]``, which they are written into.
        Returns ``(h, latents, (k, v))`` (models/attention.py :func:`cached_attention`)."""
        def attend(q, k, v):
            out, *kv = cached_attention(q, k, v, *cache, layer, positions, self.theta)
            return out, tuple(kv)

        return self._apply(h, cross, plan, attend)

    def _apply(self, h: jax.Array, cross: dict | None, plan: Plan, attend):
        """The block around its attention core ``attend(q, k, v) -> (out, extra)``; returns
        ``(h, latents, extra)``."""
        cross = cross or {}
        b, s = h.shape[:2]
        qkv, c_qkv = self.qkv(h, self.attn_norm[...], self.eps, plan, cross.get("qkv"))
        q = qkv["q"][:, :, 0].reshape(b, s, -1, self.head_dim)
        k = qkv["kv"][:, :, 0].reshape(b, s, -1, self.head_dim)
        v = qkv["kv"][:, :, 1].reshape(b, s, -1, self.head_dim)
        attention, extra = attend(q, k, v)
        y, c_o = self.o(attention, plan, cross.get("o"))
        h = tag(h + y, RESIDUAL)
        gu, c_gu = self.gate_up(h, self.mlp_norm[...], self.eps, plan, cross.get("gate_up"))
        g, u = gu["gu"][:, :, 0], gu["gu"][:, :, 1]
        y, c_d = self.down((jax.nn.silu(g) if self.silu_gate else g) * u, plan, cross.get("down"))
        h = h + y
        latents = dict(qkv=c_qkv, o=c_o, gate_up=c_gu, down=c_d)
        return h, {k_: v_ for k_, v_ in latents.items() if v_ is not None}, extra


class Decoder(nnx.Module):
    """Token ids -> final hidden state -> logits. ``blocks`` holds one block's structure; its
    parameters carry a leading ``[n_layers]`` axis (see models/init.py)."""

    def __init__(self, cfg: Model):
        d, vocab = cfg.d_model, cfg.vocab_size
        self.eps, self.tied, self.crosses = cfg.norm_eps, cfg.tie_embeddings, cfg.arch == "lax"
        self.embed = param((vocab, d), Init("normal", cfg.init_std), ("vocab", None))
        self.blocks = Block(cfg)
        self.final_norm = param((d,), Init("ones"), ("embed",))
        if not cfg.tie_embeddings:
            self.head = param((d, vocab), Init("normal", cfg.init_std), (None, "vocab"))

    def embed_tokens(self, tokens: jax.Array, plan: Plan) -> jax.Array:
        """``tokens [b, s]`` -> residual stream ``[b, s, d_local]``."""
        return plan.embed(tokens, self.embed[...])

    def run_blocks(self, h: jax.Array, plan: Plan, execution: Execution = Execution(),
                   layers=None, segments: Segments | None = None, keep: bool = False,
                   repeat: jax.Array | None = None):
        """Apply stacked blocks to the residual ``h``: all of them, or the stacked parameter
        slice ``layers`` (a pipeline stage's ``[n, ...]`` share of ``nnx.split(blocks)[1]``).
        ``segments``: the packed rows' document layout, or ``None``. Each layer's parameters
        reach its block through ``execution.layer_params``, under ``execution.remat``.

        ``keep``: each layer goes through ``execution.layer_params(..., keep=True)`` and the
        kept copies are returned stacked beside ``h``, ``(h, kept)`` (a pipeline's first
        iteration, parallel/pipeline.py, whose later iterations run on them with
        ``execution.prepared()``).

        ``repeat`` (a traced index; ``layers`` then ``[R, n, ...]``): run the ``n`` layers of
        repeat ``repeat``, each layer's parameters sliced inside its checkpointed block, so that
        the backward pass slices them again rather than keeping the slice -- a pipeline takes
        a different repeat in every iteration, and a slice kept for the backward pass would be
        a copy of the stage's parameters per iteration (parallel/pipeline.py)."""
        graph, stacked = nnx.split(self.blocks)

        def block(layer, h, cross):
            layer = layer if keep else execution.layer_params(layer)
            return nnx.merge(graph, layer)(h, cross, plan, segments, execution)

        gathers = execution.layer_gathers
        cross = None
        if repeat is not None:  # xs: the layer indices; the block slices its parameters
            sliced, block_of = layers, block

            def block(index, h, cross):
                take = lambda w: w[repeat, index]  # noqa: E731
                return block_of(jax.tree.map(take, sliced), h, cross)

            stacked = jnp.arange(jax.tree.leaves(layers)[0].shape[1])
        elif layers is not None:
            stacked = layers
        elif self.crosses:  # block 0 has no latent to cross: run it before the scan
            first = jax.tree.map(lambda x: x[0], stacked)
            h, cross = checkpointed(block, execution.remat, False, gathers)(first, h, None)
            stacked = jax.tree.map(lambda x: x[1:], stacked)
        block = checkpointed(block, execution.remat, gathers=gathers or repeat is not None)

        def body(carry, layer):
            kept = None
            if keep:
                layer, kept = execution.layer_params(layer, keep=True)
            return block(layer, *carry), kept

        (h, _), kept = jax.lax.scan(body, (h, cross or {}), stacked)
        return (h, kept) if keep else h

    def cached_blocks(self, h: jax.Array, plan: Plan, cache_k: jax.Array, cache_v: jax.Array,
                      positions: jax.Array, execution: Execution = Execution()
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """:meth:`run_blocks` for generation (no remat, no pipeline): the new tokens of ``h [b,
        s, d_local]`` at ``positions [b, s]`` through every block, each attending over its
        layer of the key/value caches ``cache_k, cache_v [L, b, kv_heads, max_len,
        head_dim]``. The caches ride in the layer loop's carry, so each layer's new keys and
        values are written in place. Returns ``(h, cache_k, cache_v)``. LaX latents cross from
        block to block at each token, as in :meth:`run_blocks`."""
        graph, stacked = nnx.split(self.blocks)

        def block(layer, index, h, cross, kv):
            return nnx.merge(graph, execution.layer_params(layer)).cached(
                h, cross, plan, kv, index, positions)

        cross, kv, first = None, (cache_k, cache_v), 0
        if self.crosses:  # block 0 has no latent to cross: run it before the scan
            h, cross, kv = block(jax.tree.map(lambda x: x[0], stacked), 0, h, None, kv)
            stacked, first = jax.tree.map(lambda x: x[1:], stacked), 1

        def body(carry, xs):
            h, cross, kv = block(*xs, *carry)
            return (h, cross, kv), None

        indices = jnp.arange(first, cache_k.shape[0], dtype=jnp.int32)
        (h, _, (cache_k, cache_v)), _ = jax.lax.scan(body, (h, cross or {}, kv),
                                                     (stacked, indices))
        return h, cache_k, cache_v

    def finish(self, h: jax.Array, plan: Plan) -> jax.Array:
        """Residual stream -> final-normed hidden ``[b, s, d]`` (full width)."""
        return plan.final_norm(h, self.final_norm[...], self.eps)

    def hidden(self, tokens: jax.Array, plan: Plan, segments: Segments | None = None,
               execution: Execution = Execution()) -> jax.Array:
        """``tokens [b, s]`` -> final-normed hidden ``[b, s, d]`` (full width)."""
        h = self.run_blocks(self.embed_tokens(tokens, plan), plan, execution, segments=segments)
        return self.finish(h, plan)

    def head_weight(self) -> jax.Array:
        """``[d, V]`` (the transposed embedding when tied)."""
        return self.embed[...].T if self.tied else self.head[...]

    def logits(self, tokens: jax.Array, plan: Plan, segments: Segments | None = None,
               execution: Execution = Execution()) -> jax.Array:
        return plan.logits(self.hidden(tokens, plan, segments, execution), self.head_weight())

    def hidden_loss(self, hidden: jax.Array, targets: jax.Array, plan: Plan) -> jax.Array:
        """Per-token cross-entropy ``[b, s]`` (fp32) of a final hidden state."""
        return plan.token_loss(plan.logits(hidden, self.head_weight()), targets)

    def token_loss(self, tokens: jax.Array, targets: jax.Array, plan: Plan,
                   segments: Segments | None = None, execution: Execution = Execution()
                   ) -> jax.Array:
        """Per-token cross-entropy ``[b, s]`` (fp32)."""
        return self.hidden_loss(self.hidden(tokens, plan, segments, execution), targets, plan)


@functools.lru_cache(maxsize=32)
def abstract_model(cfg: Model) -> tuple[nnx.GraphDef, dict[tuple, ParamDef]]:
    """The decoder's graph definition and flat ``{path: ParamDef}`` (nothing is allocated)."""
    model = nnx.eval_shape(lambda: Decoder(cfg))
    graph, _ = nnx.split(model)
    return graph, param_defs(model, cfg.n_layers)


def bind(cfg: Model, params: dict, dtype=None) -> Decoder:
    """A :class:`Decoder` holding ``params`` (cast to the compute ``dtype`` if given)."""
    graph, _ = abstract_model(cfg)
    if dtype is not None:
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    return nnx.merge(graph, params)


@functools.partial(jax.jit, static_argnums=(0, 3))
def reference_logits(cfg: Model, params: dict, tokens: jax.Array, dtype=jnp.float32,
                     segments: Segments | None = None) -> jax.Array:
    """Single-device logits ``[b, s, V]`` with the ``none`` plan (no mesh needed)."""
    return bind(cfg, params, dtype).logits(tokens, Plan(), segments)
