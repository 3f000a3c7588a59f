"""Hugging Face LLaMA import (logit parity with transformers) and SVD low-rank initialisation."""

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from boost_jax.config import ConfigError  # noqa: E402
from boost_jax.interop.hf import (  # noqa: E402
    load_hf,
    lowrank_from_dense,
    model_config_from_hf,
    svd_factors,
)
from boost_jax.models.decoder import abstract_model, reference_logits  # noqa: E402
from boost_jax.models.init import flatten  # noqa: E402
from boost_jax.testing import rel_err  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            attn_implementation="eager")


def hf_model(seed: int = 0, **overrides):
    """A tiny fp32 LlamaForCausalLM in eval mode with every weight redrawn (norms != 1)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.float().eval()


def tokens(vocab: int = 512) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(2, 16), dtype=np.int32)


def hf_logits(model, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(toks.astype(np.int64))).logits.numpy()


def logits(cfg, params, toks: np.ndarray) -> np.ndarray:
    return np.asarray(reference_logits(cfg, params, jnp.asarray(toks)))


def assert_layout(cfg, params):
    _, defs = abstract_model(cfg)
    flat = flatten(params)
    assert set(flat) == set(defs)
    for path, d in defs.items():
        assert flat[path].shape == d.shape, path
        assert flat[path].dtype == np.float32, path


@pytest.mark.parametrize("overrides", [
    dict(),  # GQA, untied head
    dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0),  # MHA, tied
], ids=["gqa_untied", "mha_tied"])
def test_imported_logits_match_hf(overrides):
    model = hf_model(**overrides)
    cfg, params = load_hf(model)
    assert cfg.arch == "dense" and cfg.n_kv_heads == model.config.num_key_value_heads
    assert cfg.tie_embeddings == ("head" not in params) == model.config.tie_word_embeddings
    assert cfg.rope_theta == overrides.get("rope_theta", 10000.0)
    assert_layout(cfg, params)
    toks = tokens()
    assert rel_err(logits(cfg, params, toks), hf_logits(model, toks)) <= 1e-5


def test_load_from_directory(tmp_path):
    model = hf_model(seed=1)
    model.save_pretrained(tmp_path)
    cfg_mem, mem = load_hf(model)
    cfg_dir, disk = load_hf(str(tmp_path))
    assert cfg_dir == cfg_mem
    flat_mem, flat_disk = flatten(mem), flatten(disk)
    assert set(flat_mem) == set(flat_disk)
    for path, value in flat_mem.items():
        np.testing.assert_array_equal(flat_disk[path], value, err_msg=str(path))
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint"):
        load_hf(tmp_path / "missing")


def truncate(w: np.ndarray, r: int) -> np.ndarray:
    u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def test_svd_factors():
    w = np.random.default_rng(0).normal(size=(64, 176)).astype(np.float32)
    a, b = svd_factors(w, 64)
    assert a.shape == (64, 64) and b.shape == (64, 176) and a.dtype == np.float32
    assert rel_err(a @ b, w) <= 1e-5
    for r in (1, 7, 30):
        a, b = svd_factors(w, r)
        assert a.shape == (64, r) and b.shape == (r, 176)
        assert rel_err(a.astype(np.float64) @ b, truncate(w, r)) <= 1e-5
        np.testing.assert_allclose(np.linalg.norm(a, axis=0), np.linalg.norm(b, axis=1),
                                   rtol=1e-5)  # balanced: sqrt(S) on both sides
    with pytest.raises(ValueError):
        svd_factors(w, 65)


def truncated_dense(params: dict, ra: int, rm: int) -> dict:
    """The dense params with each of the seven projections of every layer replaced by its
    best rank-r approximation (r = min(rank, smaller side))."""
    out = {k: v for k, v in params.items() if k != "blocks"}
    src = params["blocks"]

    def trunc(w, r):  # [L, d_in, m, d_out] or [L, d_in, d_out], per layer and member
        if w.ndim == 3:
            return np.stack([truncate(layer, min(r, *layer.shape)) for layer in w])
        return np.stack([trunc(w[:, :, i], r) for i in range(w.shape[2])], axis=2)

    out["blocks"] = {
        "attn_norm": src["attn_norm"], "mlp_norm": src["mlp_norm"],
        "qkv": {"w_q": trunc(src["qkv"]["w_q"], ra), "w_kv": trunc(src["qkv"]["w_kv"], ra)},
        "o": {"w": trunc(src["o"]["w"], ra)},
        "gate_up": {"w_gu": trunc(src["gate_up"]["w_gu"], rm)},
        "down": {"w": trunc(src["down"]["w"], rm)},
    }
    return jax_ready(out)


def jax_ready(params: dict) -> dict:
    return {k: jax_ready(v) if isinstance(v, dict) else np.asarray(v, np.float32)
            for k, v in params.items()}


@pytest.mark.parametrize("ranks", [dict(rank=8), dict(attn_rank=40, mlp_rank=12)],
                         ids=["rank8", "attn40_mlp12"])
def test_svd_lowrank_equals_truncated_dense(ranks):
    cfg, params = load_hf(hf_model(seed=2))
    new_cfg, lr = lowrank_from_dense(cfg, params, arch="svd", **ranks)
    ra = ranks.get("attn_rank", ranks.get("rank"))
    rm = ranks.get("mlp_rank", ranks.get("rank"))
    assert (new_cfg.arch, new_cfg.attn_rank, new_cfg.mlp_rank) == ("svd", ra, rm)
    assert new_cfg.d_model == cfg.d_model and new_cfg.n_kv_heads == cfg.n_kv_heads
    assert_layout(new_cfg, lr)
    toks = tokens()
    want = logits(cfg, truncated_dense(params, ra, rm), toks)
    assert rel_err(logits(new_cfg, lr, toks), want) <= 1e-5
    # the truncation really changes the model (the check above is not vacuous)
    assert rel_err(want, logits(cfg, params, toks)) > 1e-3


def test_cola_init_and_unsupported_arch():
    cfg, params = load_hf(hf_model(seed=3, tie_word_embeddings=True))
    new_cfg, lr = lowrank_from_dense(cfg, params, arch="cola")
    assert new_cfg.arch == "cola" and new_cfg.attn_rank == new_cfg.mlp_rank == cfg.d_model // 4
    assert_layout(new_cfg, lr)
    assert np.all(np.isfinite(logits(new_cfg, lr, tokens())))
    with pytest.raises(ConfigError, match="lax"):
        lowrank_from_dense(cfg, params, arch="lax")
    with pytest.raises(ConfigError, match="dense"):
        lowrank_from_dense(new_cfg, lr, arch="svd")
    with pytest.raises(ConfigError):  # Model validation: rank must be below d_model
        lowrank_from_dense(cfg, params, arch="svd", rank=cfg.d_model)


@pytest.mark.parametrize("bad", [
    dict(attention_bias=True), dict(mlp_bias=True), dict(hidden_act="gelu"),
    dict(head_dim=32), dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
], ids=["attention_bias", "mlp_bias", "gelu", "head_dim", "rope_scaling"])
def test_unrepresentable_configs(bad):
    hf_cfg = transformers.LlamaConfig(**{**TINY, **bad})
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(hf_cfg)
    assert "\n" not in str(err.value)


def test_config_overrides():
    hf_cfg = transformers.LlamaConfig(**TINY)
    cfg = model_config_from_hf(hf_cfg, init_std=0.01)
    assert cfg.init_std == 0.01 and cfg.norm_eps == 1e-5 and cfg.d_ff == 176
    assert dataclasses.replace(cfg, arch="svd").attn_rank == cfg.d_model // 4


def test_missing_torch_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[test\]"'):
        load_hf("anything")
