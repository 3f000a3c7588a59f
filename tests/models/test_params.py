"""Parameter counts per arch against closed-form formulas (SPEC §2.4, §6.6)."""

import math

import pytest

from boost_jax.config import Model
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import count
from boost_jax.models.projections import balanced_factors


def _expected(m: Model) -> int:
    d, dkv, dff, ra, rm, L = m.d_model, m.d_kv, m.d_ff, m.attn_rank, m.mlp_rank, m.n_layers
    if m.arch == "dense":
        layer = 2 * d * d + 2 * d * dkv + 3 * d * dff
    else:
        layer = ra * (d + d) + 2 * ra * (d + dkv) + ra * (d + d) + 2 * rm * (d + dff) \
            + rm * (dff + d)
    if m.arch == "lax":
        def extra(r):
            a, b = balanced_factors(r)
            gate = {"identity": 0, "dense": r * r + r, "kronecker": a * a + b * b}[m.lax_gate]
            return gate + (2 * r if m.lax_latent_norm else 0)
        layer += 4 * extra(ra) + 3 * extra(rm)
    layer += 2 * d  # the two RMSNorm gains
    head = 0 if m.tie_embeddings else d * m.vocab_size
    return L * layer + m.vocab_size * d + d + head


@pytest.mark.parametrize("arch, extra", [
    ("dense", {}), ("svd", {}), ("cola", {}), ("lax", {}),
    ("lax", dict(lax_gate="dense", lax_latent_norm=True)),
    ("lax", dict(lax_gate="identity", lax_latent_norm=False)),
    ("cola", dict(tie_embeddings=True, attn_rank=8, mlp_rank=24)),
])
def test_count_matches_formula(arch, extra):
    m = Model(arch=arch, size="tiny", **extra)
    assert count(abstract_model(m)[1]) == _expected(m)


def test_paper_7b_decoder_stack_counts():
    """SPEC §6.6: 7B decoder-stack linear parameters, full rank 6.48B / low rank 2.56B."""
    def linear(arch):
        defs = abstract_model(Model(arch=arch, size="7b"))[1]
        return sum(math.prod(d.shape) for p, d in defs.items()
                   if p[0] == "blocks" and not p[1].endswith("norm"))
    assert round(linear("dense") / 1e9, 2) == 6.48
    assert round(linear("cola") / 1e9, 2) == 2.56
    assert linear("dense") / linear("cola") == pytest.approx(2.53, abs=0.005)


def test_logical_axes_cover_every_dim():
    defs = abstract_model(Model(arch="lax", size="tiny", lax_gate="dense"))[1]
    for path, d in defs.items():
        assert len(d.axes) == len(d.shape), path
        assert d.stacked == (path[0] == "blocks") and (d.axes[0] == "layers") == d.stacked
