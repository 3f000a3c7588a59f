"""Export layouts (interop/formats.py, layouts.py, cola.py): exact round trips, logit parity
with transformers' LlamaForCausalLM and with a torch model in the CoLA repository's layout."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import ConfigError
from boost_jax.interop.cola import cola_state_dict, import_cola
from boost_jax.interop.formats import export_model, load_export, resolve_layout
from boost_jax.interop.layouts import load_safetensors, save_safetensors
from boost_jax.models.decoder import abstract_model, reference_logits
from boost_jax.models.init import flatten, unflatten
from boost_jax.testing import rel_err, tiny

TOKENS = np.random.default_rng(0).integers(0, 512, size=(2, 16), dtype=np.int32)


def random_params(cfg, seed=0) -> dict:
    """Every parameter of ``cfg`` drawn at random (norm scales around 1), fp32 numpy."""
    _, defs = abstract_model(cfg)
    rng = np.random.default_rng(seed)
    flat = {p: (1.0 if "norm" in p[-1] else 0.0) + 0.1 * rng.standard_normal(d.shape)
            for p, d in defs.items()}
    return unflatten({p: v.astype(np.float32) for p, v in flat.items()})


def logits(cfg, params) -> np.ndarray:
    return np.asarray(reference_logits(cfg, params, jnp.asarray(TOKENS)))


def assert_params_equal(a: dict, b: dict) -> None:
    fa, fb = flatten(a), flatten(b)
    assert set(fa) == set(fb)
    for path, value in fa.items():
        assert fb[path].dtype == np.float32
        np.testing.assert_array_equal(fb[path], value, err_msg=str(path))


MHA = dict(n_kv_heads=8)  # the CoLA repository has no grouped-query attention


@pytest.mark.parametrize("cfg, fmt, keep, layout", [
    (tiny("dense"), "auto", False, "llama"),
    (tiny("svd", only_lr_act=False, tie_embeddings=True), "hf", True, "svd_factored"),
    (tiny("cola", **MHA), "auto", False, "cola"),
    (tiny("cola", **MHA, only_lr_act=False, tie_embeddings=True), "cola", False, "cola"),
    (tiny("lax", lax_gate="dense", lax_latent_norm=True), "auto", False, "lax"),
    (tiny("lax", lax_gate="kronecker"), "lax", True, "lax"),
], ids=["dense", "svd_factors_tied", "cola", "cola_gate_silu_tied", "lax_dense_norm",
        "lax_kronecker"])
def test_round_trip_is_exact(tmp_path, cfg, fmt, keep, layout):
    params = random_params(cfg)
    result = export_model(cfg, params, tmp_path / "out", fmt, keep)
    assert result.layout == layout and not (tmp_path / ".out.partial").exists()
    back_cfg, back = load_export(tmp_path / "out")
    for field in ("arch", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                  "tie_embeddings", "norm_eps", "rope_theta", "init_std"):
        assert getattr(back_cfg, field) == getattr(cfg, field), field
    if cfg.is_lowrank:
        assert (back_cfg.attn_rank, back_cfg.mlp_rank, back_cfg.only_lr_act) == \
            (cfg.attn_rank, cfg.mlp_rank, cfg.only_lr_act)
    if cfg.arch == "lax":
        assert (back_cfg.lax_gate, back_cfg.lax_latent_norm) == \
            (cfg.lax_gate, cfg.lax_latent_norm)
    assert_params_equal(params, back)


def test_cola_names_orientation_and_config(tmp_path):
    cfg = tiny("cola", **MHA)
    params = random_params(cfg)
    sd = cola_state_dict(cfg, params)
    d, r, ff = cfg.d_model, cfg.attn_rank, cfg.d_ff
    assert sd["model.layers.1.self_attn.k_proj.cola_a"].shape == (d, r)
    assert sd["model.layers.1.self_attn.k_proj.cola_b"].shape == (r, d)
    assert sd["model.layers.0.mlp.down_proj.cola_a"].shape == (ff, r)
    assert sd["lm_head.weight"].shape == (cfg.vocab_size, d)
    np.testing.assert_array_equal(sd["model.layers.1.self_attn.v_proj.cola_a"],
                                  params["blocks"]["qkv"]["a"][1, :, 2])
    np.testing.assert_array_equal(sd["model.layers.0.mlp.up_proj.cola_b"],
                                  params["blocks"]["gate_up"]["b_gu"][0, 1])
    assert len(sd) == 3 + cfg.n_layers * (2 + 7 * 2)  # embed, norm, head; norms, factors
    export_model(cfg, params, tmp_path / "cola")
    config = json.loads((tmp_path / "cola" / "config.json").read_text())
    assert config["architectures"] == ["ColaForCausalLM"] and config["model_type"] == "cola"
    assert (config["rank"], config["only_lr_act"], config["lr_act_type"]) == (r, True, "silu")


def test_import_cola_repository_config_defaults(tmp_path):
    """A config like the CoLA repository's cola_configs/*.json (no rope_theta, kv heads or
    eps): ColaConfig's defaults apply."""
    cfg = tiny("cola", **MHA, rank=8, norm_eps=1e-6, only_lr_act=False)
    params = random_params(cfg)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["ColaForCausalLM"], "model_type": "cola", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 8,
        "num_hidden_layers": 2, "vocab_size": 512, "rank": 8, "only_lr_act": False}))
    save_safetensors(cola_state_dict(cfg, params), tmp_path / "model.safetensors")
    got_cfg, got = import_cola(tmp_path)
    assert (got_cfg.attn_rank, got_cfg.mlp_rank, got_cfg.n_kv_heads) == (8, 8, 8)
    assert (got_cfg.rope_theta, got_cfg.norm_eps, got_cfg.only_lr_act) == (1e4, 1e-6, False)
    assert_params_equal(params, got)


def test_import_cola_refuses_what_boost_jax_lacks(tmp_path):
    cfg = tiny("cola", **MHA)
    export_model(cfg, random_params(cfg), tmp_path / "c")
    sd = load_safetensors(tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())

    def attempt(state, **fields):
        path = tmp_path / "case"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config, **fields}))
        save_safetensors(state, path / "model.safetensors")
        with pytest.raises(ConfigError) as err:
            import_cola(path)
        assert "\n" not in str(err.value)
        return str(err.value)

    biased = {**sd, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    assert "bias" in attempt(biased)
    assert "attention_bias" in attempt(sd, attention_bias=True)
    missing = {k: v for k, v in sd.items() if "layers.1.mlp.up_proj.cola_b" not in k}
    assert "up_proj.cola_b" in attempt(missing)
    assert "num_key_value_heads" in attempt(sd, num_key_value_heads=4)
    assert "lr_act_type" in attempt(sd, lr_act_type="gelu")
    assert "model_type" in attempt(sd, model_type="llama")
    assert "shape" in attempt(sd, rank=8)
    with pytest.raises(ConfigError, match="no config.json"):
        import_cola(tmp_path / "nothing")


@pytest.mark.parametrize("cfg, fmt, keep, match", [
    (tiny("cola"), "hf", False, "--format=cola"),
    (tiny("lax"), "hf", False, "--format=lax"),
    (tiny("cola"), "auto", False, "grouped-query"),
    (tiny("cola", **MHA, attn_rank=8), "cola", False, "one rank"),
    (tiny("svd"), "cola", False, "needs a cola model"),
    (tiny("svd"), "lax", False, "--format=hf"),
    (tiny("dense"), "hf", True, "no factors"),
    (tiny("dense"), "onnx", False, "not one of"),
], ids=["hf_cola", "hf_lax", "cola_gqa", "cola_two_ranks", "cola_svd", "lax_svd",
        "factors_dense", "unknown"])
def test_formats_an_arch_cannot_take(cfg, fmt, keep, match):
    with pytest.raises(ConfigError, match=match) as err:
        resolve_layout(cfg, fmt, keep)
    assert "\n" not in str(err.value)


def test_output_is_refused_or_replaced_whole(tmp_path):
    cfg = tiny("dense")
    params = random_params(cfg)
    out = tmp_path / "out"
    export_model(cfg, params, out)
    with pytest.raises(ConfigError, match="--overwrite"):
        export_model(cfg, params, out)
    other = random_params(cfg, seed=1)
    export_model(cfg, other, out, overwrite=True)
    assert_params_equal(other, load_export(out)[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial or old left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="never replaced"):
        export_model(cfg, params, tmp_path / "mine", overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        export_model(cfg, params, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    export_model(cfg, params, tmp_path / "empty")  # an empty directory is taken


# --- parity with torch implementations --------------------------------------------------

def _torch_logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()


def _llama(directory):
    import torch
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("overrides", [
    dict(),  # GQA, untied
    dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0),  # MHA, tied
], ids=["gqa_untied", "mha_tied"])
def test_hf_import_export_round_trip(tmp_path, overrides):
    """HF -> load_hf -> export -> LlamaForCausalLM: the same logits as both ends."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from boost_jax.interop.hf import load_hf

    torch.manual_seed(0)
    hf_cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  attn_implementation="eager")
    source = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**hf_cfg, **overrides}))
    with torch.no_grad():
        for name, p in source.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.08 * torch.randn_like(p))
    cfg, params = load_hf(source.float().eval())
    export_model(cfg, params, tmp_path / "out")
    exported = _llama(tmp_path / "out")
    assert exported.config.tie_word_embeddings == cfg.tie_embeddings
    assert exported.config.num_key_value_heads == cfg.n_kv_heads
    got = _torch_logits(exported)
    assert rel_err(got, logits(cfg, params)) <= 1e-5
    assert rel_err(got, _torch_logits(source)) <= 1e-5


def test_svd_multiplied_out_logits(tmp_path):
    """svd keeps LLaMA's SwiGLU: multiplied out, it is a plain LlamaForCausalLM. An export of
    the bilinear MLP svd once had (``hidden_act: "linear"``) is refused on reading."""
    pytest.importorskip("torch")
    cfg = tiny("svd")
    params = random_params(cfg)
    export_model(cfg, params, tmp_path / "out")
    model = _llama(tmp_path / "out")
    assert model.config.hidden_act == "silu"
    assert rel_err(_torch_logits(model), logits(cfg, params)) <= 1e-5
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps({**config, "hidden_act": "linear"}))
    with pytest.raises(ConfigError, match="bilinear MLP"):
        load_export(tmp_path / "out")


@pytest.mark.parametrize("only_lr_act, tied", [
    (True, False), pytest.param(False, True, marks=pytest.mark.slow)],
    ids=["bilinear_untied", "silu_gate_tied"])
def test_cola_layout_runs_in_a_torch_cola_model(tmp_path, only_lr_act, tied):
    """The exported state dict loads strictly into a LlamaForCausalLM whose projections are
    CoLA layers (``silu(x @ cola_a) @ cola_b``, MLP gate activation per only_lr_act), as the
    CoLA repository builds ColaForCausalLM, and gives our logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    class ColaLinear(torch.nn.Module):
        def __init__(self, d_in, d_out, rank):
            super().__init__()
            self.cola_a = torch.nn.Parameter(torch.zeros(d_in, rank))
            self.cola_b = torch.nn.Parameter(torch.zeros(rank, d_out))

        def forward(self, x):
            return torch.nn.functional.silu(x @ self.cola_a) @ self.cola_b

    cfg = tiny("cola", **MHA, only_lr_act=only_lr_act, tie_embeddings=tied)
    params = random_params(cfg, seed=int(tied))
    out = tmp_path / "cola"
    export_model(cfg, params, out)
    config = transformers.LlamaConfig(**{
        k: v for k, v in json.loads((out / "config.json").read_text()).items()
        if k not in ("architectures", "model_type", "boost_jax")})
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                old = getattr(parent, name)
                setattr(parent, name, ColaLinear(old.in_features, old.out_features,
                                                 config.rank))
        if config.only_lr_act:
            layer.mlp.act_fn = torch.nn.Identity()
    state = load_file(str(out / "model.safetensors"))
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    assert rel_err(_torch_logits(model.float().eval()), logits(cfg, params)) <= 1e-5
