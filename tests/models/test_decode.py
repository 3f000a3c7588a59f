"""Generation with a key/value cache (models/decode.py) against full-sequence logits."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import Model
from boost_jax.models import decode
from boost_jax.models.decoder import abstract_model, reference_logits
from boost_jax.models.init import unflatten
from boost_jax.testing import rel_err, tiny

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

PROMPTS = [[5, 17, 300, 2, 41], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]
NEW = 6
ARCHS = {"dense": tiny("dense"), "svd": tiny("svd"), "cola": tiny("cola"),
         "lax": tiny("lax", lax_gate="dense", lax_latent_norm=True)}


@functools.cache
def _params(arch: str) -> dict:
    """Parameters drawn as :func:`init_params` would, in numpy (no compilation)."""
    rng, flat = np.random.default_rng(1), {}
    for path, d in abstract_model(ARCHS[arch])[1].items():
        init = d.init
        if init.kind in ("ones", "zeros"):
            x = np.full(d.shape, 1.0 if init.kind == "ones" else 0.0)
        else:
            x = (rng.standard_normal(d.shape) if init.kind == "normal"
                 else rng.uniform(-1, 1, d.shape))
            scale = np.asarray(init.scale)
            if init.scale_axis is not None:
                axis = init.scale_axis + d.stacked
                scale = scale.reshape([-1 if a == axis else 1 for a in range(len(d.shape))])
            x = x * scale
        flat[path] = x.astype(np.float32)
    return unflatten(flat)


def _padded(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_decoding_matches_full_sequence_logits(arch):
    """Prompts of different lengths in one batch: the prefill's logits at each prompt's last
    token equal the full forward pass's (fp32, rel err <= 1e-5), and each greedy token is the
    argmax of the full sequence's logits at the position before it."""
    cfg, params = ARCHS[arch], _params(arch)
    new = decode.generate(cfg, params, PROMPTS, NEW)
    assert [len(n) for n in new] == [NEW] * len(PROMPTS)
    seqs = [p + n for p, n in zip(PROMPTS, new)]
    full = np.asarray(reference_logits(cfg, params, jnp.asarray(_padded(seqs, 24))))
    for i, p in enumerate(PROMPTS):
        argmax = full[i, len(p) - 1:len(seqs[i]) - 1].argmax(-1)
        assert argmax.tolist() == new[i], (arch, i)

    width = decode.bucket(max(map(len, PROMPTS)))  # as generate pads them: no compilation
    lengths = np.asarray([len(p) for p in PROMPTS] + [1], np.int32)
    tokens = _padded([*PROMPTS, [0]], width)
    last, cache = decode.prefill(cfg, params, tokens, lengths, decode.bucket(width + NEW - 1))
    assert cache.lengths.tolist() == lengths.tolist()
    ends = [full[i, len(p) - 1] for i, p in enumerate(PROMPTS)]
    assert rel_err(last[:len(PROMPTS)], np.stack(ends)) <= 1e-5


def test_cached_prefill_logits_equal_full_logits():
    """Every position of a padded prompt batch through the cache (LaX: latents cross at each
    token) has the full forward pass's logits; the cache then holds every position."""
    cfg, params = ARCHS["lax"], _params("lax")
    tokens = jnp.asarray(_padded(PROMPTS, 16))
    cache = decode.init_cache(cfg, len(PROMPTS), 32)
    cached, cache = jax.jit(decode.extend, static_argnums=0)(cfg, params, tokens, cache)
    assert rel_err(cached, reference_logits(cfg, params, tokens)) <= 1e-5
    assert cache.lengths.tolist() == [16] * len(PROMPTS)
    assert not np.asarray(cache.k[..., 16:, :]).any() and np.asarray(cache.k[..., :16, :]).all()


def test_the_decode_step_compiles_once_and_sampling_is_seeded():
    """Many tokens, other prompts of the same bucket, other budgets, temperatures and top-p:
    one compilation of the (sampling) step. The same seed gives the same tokens, another seed
    others; a tiny top-p keeps only the most likely token, so it decodes greedily."""
    cfg, params = ARCHS["cola"], _params("cola")
    decode.decode_step.clear_cache()
    one = decode.generate(cfg, params, PROMPTS, 9, temperature=1.0, top_p=0.95, seed=3)
    again = decode.generate(cfg, params, PROMPTS, 9, temperature=1.0, top_p=0.95, seed=3)
    other = decode.generate(cfg, params, PROMPTS, 9, temperature=1.0, top_p=0.95, seed=4)
    assert one == again and one != other
    decode.generate(cfg, params, [[1, 2], [3] * 15, [4]], 5, temperature=0.7, top_p=0.5)
    assert decode.decode_step._cache_size() == 1
    greedy = decode.generate(cfg, params, PROMPTS, 9)
    assert decode.generate(cfg, params, PROMPTS, 9, temperature=2.0, top_p=1e-6) == greedy
    assert decode.decode_step._cache_size() == 2  # greedy is its own (argmax-only) step


def test_stop_ids_cut_each_row():
    cfg, params = ARCHS["cola"], _params("cola")
    full = decode.generate(cfg, params, PROMPTS, NEW)
    stop = full[0][2]
    cut = decode.generate(cfg, params, PROMPTS, NEW, stop_ids=[stop])
    for row, out in zip(full, cut):
        assert out == (row[:row.index(stop)] if stop in row else row)
    assert decode.generate(cfg, params, PROMPTS, 0) == [[], [], []]


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    """probs 0.4, 0.3, 0.2, 0.1: top_p=0.5 draws tokens 0 and 1 only (both), top_p=1 all."""
    logits = jnp.log(jnp.asarray([[0.1, 0.3, 0.2, 0.4]] * 400))
    key = jax.random.key(0)

    def draws(top_p):
        out = decode._sample(logits, key, jnp.int32(5), jnp.float32(1.0), jnp.float32(top_p),
                             greedy=False)
        return set(np.asarray(out).tolist())

    assert draws(0.5) == {3, 1}
    assert draws(1.0) == {0, 1, 2, 3}
    assert draws(1e-6) == {3}


@pytest.mark.parametrize("prompts, kw, needle", [
    ([], {}, "no prompts"),
    ([[1], []], {}, "prompt 1 is empty"),
    ([[1, 512]], {}, "outside [0, 512)"),
    ([[1]], dict(temperature=-1.0), "temperature=-1.0"),
    ([[1]], dict(temperature=1.0, top_p=0.0), "top_p=0.0"),
])
def test_bad_input_is_one_line(prompts, kw, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        decode.generate(ARCHS["cola"], {}, prompts, 4, **kw)


def test_cache_bytes():
    """Full k/v: ``2 L S d_kv`` numbers a row; the r-wide latents ``2 L S r``."""
    small = Model(size="small")
    assert decode.cache_bytes(small, 1, 2048) == 2 * 4 * 2048 * 256 * 4  # 16 MiB
    assert decode.latent_cache_bytes(small, 1, 2048) == 2 * 4 * 2048 * 64 * 4  # 4 MiB


def test_bucket_is_the_next_power_of_two():
    """The one bucketing of decoding and of the evaluation scorer (evaluation/scoring.py)."""
    from boost_jax.evaluation.scoring import row_width

    assert [decode.bucket(n) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
    assert [decode.bucket(n, smallest=1) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [row_width(n, 40) for n in (1, 16, 17, 33, 40)] == [16, 16, 32, 40, 40]
