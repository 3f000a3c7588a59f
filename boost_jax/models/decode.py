"""Text generation with a key/value cache, on one device (the ``none`` plan).

The model is the training decoder (models/decoder.py): :meth:`Decoder.cached_blocks` runs the
same blocks and projections, with :func:`~boost_jax.models.attention.cached_attention` in place
of causal attention. LaX latents cross from block to block at each token, so they need no cache.

:func:`generate` pads a batch of prompts (right-padded to a power-of-two bucket, each row with
its own length), runs :func:`prefill` over the whole batch in one call, then
:func:`decode_step` once per new token: one jitted function per (batch bucket, cache length,
dtype, greedy or sampled), so every token after the first reuses one compilation. Sampling is
greedy (``temperature=0``) or nucleus (top-p) at a temperature, deterministic per seed: the
token at step ``i`` of row ``j`` draws from ``fold_in(fold_in(PRNGKey(seed), j), i)``.

The cache holds the rotated keys and values of every layer, ``2 * L * max_len * d_kv`` numbers
per row (:func:`cache_bytes`). Low-rank archs could hold the r-wide k/v latents instead
(:func:`latent_cache_bytes`), but RoPE sits after the up factor, so every step would re-run
``B_k`` and RoPE over the whole prefix; see docs/guides/generate.md, "Generating text".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.models.boundaries import Plan
from boost_jax.models.config import Model
from boost_jax.models.decoder import bind

MIN_BUCKET = 16  # the smallest padded prompt length and cache length


class KVCache(NamedTuple):
    """Every layer's rotated keys and values, and how many positions each row holds.

    ``k``, ``v``: ``[n_layers, batch, n_kv_heads, max_len, head_dim]``; ``lengths``: int32
    ``[batch]``, the position the row's next token goes to.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


def init_cache(cfg: Model, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache (zeros, lengths 0) for ``batch`` rows of up to ``max_len`` tokens."""
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros(batch, jnp.int32))


def cache_bytes(cfg: Model, batch: int, max_len: int, dtype=jnp.float32) -> int:
    """Bytes of :class:`KVCache` keys and values: ``2 * L * batch * max_len * d_kv``."""
    return 2 * cfg.n_layers * batch * max_len * cfg.d_kv * jnp.dtype(dtype).itemsize


def latent_cache_bytes(cfg: Model, batch: int, max_len: int, dtype=jnp.float32) -> int:
    """Bytes of a cache of the post-activation k and v latents instead (low-rank archs):
    ``2 * L * batch * max_len * attn_rank`` (not implemented; for comparison)."""
    return 2 * cfg.n_layers * batch * max_len * cfg.attn_rank * jnp.dtype(dtype).itemsize


def extend(cfg: Model, params: dict, tokens: jax.Array, cache: KVCache, dtype=jnp.float32,
           last: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Run ``tokens [b, s]`` at positions ``cache.lengths[:, None] + arange(s)`` over the cache.

    Returns the fp32 logits ``[b, s, V]`` (only those at index ``last [b]`` of each row, ``[b,
    V]``, when given) and the cache holding the new tokens (``lengths + s``). Callers keep
    ``lengths + s <= max_len``.
    """
    model, plan = bind(cfg, params, dtype), Plan()
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h = model.embed_tokens(tokens, plan)
    h, k, v = model.cached_blocks(h, plan, cache.k, cache.v, positions)
    h = model.finish(h, plan)
    if last is not None:
        h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        logits = jnp.einsum("bd,dv->bv", h, model.head_weight(),
                            preferred_element_type=jnp.float32)
    else:
        logits = plan.logits(h, model.head_weight())
    return logits, KVCache(k, v, cache.lengths + tokens.shape[1])


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "dtype"))
def prefill(cfg: Model, params: dict, tokens: jax.Array, lengths: jax.Array, max_len: int,
            dtype=jnp.float32) -> tuple[jax.Array, KVCache]:
    """Prompts ``tokens [b, p]`` (right-padded; row ``i`` holds ``lengths[i] >= 1`` tokens) ->
    ``(logits [b, V] at each row's last prompt token, cache of max_len positions)``."""
    cache = init_cache(cfg, tokens.shape[0], max_len, dtype)
    logits, cache = extend(cfg, params, tokens, cache, dtype, last=lengths - 1)
    return logits, cache._replace(lengths=lengths)


def sample_logits(logits: jax.Array, key: jax.Array, step: jax.Array, temperature: jax.Array,
                  top_p: jax.Array, greedy: bool) -> jax.Array:
    """Next tokens ``[b]`` int32 from fp32 ``logits [b, V]``: the argmax when ``greedy``, else
    a draw at ``temperature`` from the smallest set of most likely tokens whose probability
    reaches ``top_p`` (nucleus sampling; the most likely token is always in it). Row ``j``
    draws with ``fold_in(fold_in(key, j), step)``."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    order = jnp.argsort(-logits, axis=-1, stable=True)
    probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order, axis=-1)
    # the mass before a token is below top_p (top_p=1 keeps every token, rounding aside)
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1)
    rows = jnp.arange(logits.shape[0])[:, None]
    keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
    masked = jnp.where(keep, logits, -jnp.inf)

    def draw(row_logits, row):
        return jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, row), step),
                                      row_logits)

    return jax.vmap(draw)(masked, rows[:, 0]).astype(jnp.int32)


_sample = jax.jit(sample_logits, static_argnames=("greedy",))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "greedy"), donate_argnames=("cache",))
def decode_step(cfg: Model, params: dict, cache: KVCache, tokens: jax.Array, key: jax.Array,
                step: jax.Array, temperature: jax.Array, top_p: jax.Array, dtype=jnp.float32,
                greedy: bool = True) -> tuple[jax.Array, KVCache]:
    """Feed ``tokens [b]`` (each row's newest token, at position ``cache.lengths``) and pick
    the next ones: ``(next tokens [b] int32, cache)``. The cache is donated; only arrays
    change between calls, so one compilation serves every token."""
    logits, cache = extend(cfg, params, tokens[:, None], cache, dtype)
    return sample_logits(logits[:, 0], key, step, temperature, top_p, greedy), cache


def bucket(n: int, smallest: int = MIN_BUCKET) -> int:
    """The padded size of ``n >= 1``: the next power of two, at least ``smallest`` (the one
    bucketing of decoding and of :mod:`boost_jax.evaluation.scoring`)."""
    return max(smallest, 1 << (n - 1).bit_length())


def _check(cfg: Model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
           top_p: float) -> None:
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (every prompt needs a token)")
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, "
                             f"{cfg.vocab_size})")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 0")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1]")


def generate(cfg: Model, params: dict, prompts: list[list[int]], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_ids: Sequence[int] = (), dtype=jnp.float32) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens.

    Returns the new tokens of each prompt, cut before its first stop id. ``temperature=0``
    is greedy; otherwise nucleus sampling with ``top_p``, deterministic per ``seed``.
    ``params``: canonical layout (numpy or jax arrays), placed on the default device; ``dtype``:
    the compute and cache dtype. Rows that stopped keep decoding until all have (or the budget
    is spent); the batch is padded to a power of two so a batch of another size reuses the
    compiled step when it falls into the same bucket.
    """
    _check(cfg, prompts, max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    n, longest = len(prompts), max(len(p) for p in prompts)
    rows, width = bucket(n, smallest=1), bucket(longest)
    max_len = bucket(width + max_new_tokens - 1)
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.ones(rows, np.int32)  # padding rows: one token 0
    for i, p in enumerate(prompts):
        tokens[i, :len(p)], lengths[i] = p, len(p)
    params = jax.tree.map(jnp.asarray, params)
    greedy = temperature == 0
    key = jax.random.key(seed)
    temp, nucleus = jnp.float32(temperature or 1.0), jnp.float32(top_p)
    stops = np.asarray(list(stop_ids), np.int32)
    logits, cache = prefill(cfg, params, jnp.asarray(tokens), jnp.asarray(lengths), max_len, dtype)
    token = _sample(logits, key, jnp.int32(0), temp, nucleus, greedy=greedy)
    out, done = [token], np.zeros(rows, bool)
    for i in range(1, max_new_tokens):
        if stops.size:
            done |= np.isin(np.asarray(token), stops)
            if done[:n].all():
                break
        token, cache = decode_step(cfg, params, cache, token, key, jnp.int32(i), temp, nucleus,
                                   dtype, greedy=greedy)
        out.append(token)
    new = np.stack([np.asarray(t) for t in out], axis=1)[:n]
    result = []
    for row in new.tolist():
        cut = next((j for j, t in enumerate(row) if t in set(stop_ids)), len(row))
        result.append(row[:cut])
    return result
