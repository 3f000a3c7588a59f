"""Import Hugging Face LLaMA checkpoints and initialise low-rank models from dense ones.

:func:`load_hf` turns a ``transformers.LlamaForCausalLM`` (in memory or saved with
``save_pretrained``) into a dense :class:`~boost_jax.config.Model` and its parameters, as fp32
numpy arrays in the nested-dict layout of :mod:`boost_jax.models.decoder` (kernels in ``x @ W``
orientation, block parameters stacked on a leading layer axis ``L``). The model's RoPE uses the
same rotate-half convention as Hugging Face, so q/k weights are only transposed, never permuted.

:func:`lowrank_from_dense` factors every projection of a dense model with a truncated SVD
(:func:`svd_factors`) to initialise an ``svd`` or ``cola`` model.

torch and transformers are imported lazily: only :func:`load_hf` needs them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from boost_jax.config import ConfigError, Model

LOWRANK_ARCHS = ("svd", "cola")
_INSTALL_HINT = ("load_hf needs torch and transformers: pip install -e \".[test]\" (transformers) "
                 "and torch, e.g. its CPU build: pip install torch --index-url "
                 "https://download.pytorch.org/whl/cpu")


def _rope_theta(hf_config: Any) -> float:
    """RoPE base; rejects any rope scaling. transformers 5 keeps both in ``rope_parameters``."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = dict(rope or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"rope scaling {kind!r} is not supported (only the default RoPE)")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ConfigError("the Hugging Face config has no rope_theta")
    return float(theta)


def model_config_from_hf(hf_config: Any, **overrides) -> Model:
    """A dense :class:`Model` (``size='custom'``) with the dimensions of a ``LlamaConfig``.

    ``overrides`` are further :class:`Model` fields (e.g. ``init_std``). Raises
    :class:`ConfigError` for what the decoder cannot represent: biases, rope scaling, a head
    dim other than ``hidden_size / num_attention_heads``, an activation other than SiLU.
    """
    c = hf_config
    if getattr(c, "attention_bias", False):
        raise ConfigError("attention_bias=True is not supported (projections have no bias)")
    if getattr(c, "mlp_bias", False):
        raise ConfigError("mlp_bias=True is not supported (projections have no bias)")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None)
    if head_dim is not None and head_dim * heads != c.hidden_size:
        raise ConfigError(f"head_dim={head_dim} is not hidden_size/num_attention_heads="
                          f"{c.hidden_size}/{heads}")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    fields = dict(arch="dense", size="custom", d_model=c.hidden_size,
                  n_layers=c.num_hidden_layers, n_heads=heads, n_kv_heads=kv_heads,
                  d_ff=c.intermediate_size, vocab_size=c.vocab_size,
                  tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                  norm_eps=float(c.rms_norm_eps), rope_theta=_rope_theta(c))
    return Model(**{**fields, **overrides})


def _import_hf():
    try:
        import torch
        import transformers
    except ImportError as err:
        raise ImportError(f"{_INSTALL_HINT} ({err})") from err
    return torch, transformers


def load_hf(model_or_path: Any) -> tuple[Model, dict]:
    """Dense config and fp32 numpy params from a Hugging Face LLaMA causal LM.

    Args:
      model_or_path: a ``transformers.LlamaForCausalLM`` or a directory written by its
        ``save_pretrained``.
    Returns:
      ``(cfg, params)``: ``embed [V, d]``, ``final_norm [d]``, ``head [d, V]`` (untied only)
      and under ``blocks`` (leading ``[L]``): ``attn_norm``/``mlp_norm [L, d]``,
      ``qkv/w_q [L, d, 1, d]``, ``qkv/w_kv [L, d, 2, d_kv]`` (k, v), ``o/w [L, d, d]``,
      ``gate_up/w_gu [L, d, 2, d_ff]`` (gate, up), ``down/w [L, d_ff, d]``.
    """
    torch, transformers = _import_hf()
    model = model_or_path
    if isinstance(model_or_path, str | os.PathLike):
        path = os.fspath(model_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no Hugging Face checkpoint directory at {path!r}")
        major = int(transformers.__version__.split(".")[0])
        dtype_kw = "dtype" if major >= 5 else "torch_dtype"
        model = transformers.LlamaForCausalLM.from_pretrained(path, **{dtype_kw: torch.float32})
    cfg = model_config_from_hf(model.config)

    def np32(t) -> np.ndarray:
        return t.detach().to(device="cpu", dtype=torch.float32).numpy().copy()

    def stack(fn) -> np.ndarray:
        return np.stack([fn(layer) for layer in model.model.layers])

    def kernel(linear) -> np.ndarray:  # HF [out, in] -> [in, out]
        return np32(linear.weight).T

    blocks = {
        "attn_norm": stack(lambda b: np32(b.input_layernorm.weight)),
        "qkv": {
            "w_q": stack(lambda b: kernel(b.self_attn.q_proj)[:, None]),
            "w_kv": stack(lambda b: np.stack([kernel(b.self_attn.k_proj),
                                              kernel(b.self_attn.v_proj)], axis=1)),
        },
        "o": {"w": stack(lambda b: kernel(b.self_attn.o_proj))},
        "mlp_norm": stack(lambda b: np32(b.post_attention_layernorm.weight)),
        "gate_up": {"w_gu": stack(lambda b: np.stack([kernel(b.mlp.gate_proj),
                                                      kernel(b.mlp.up_proj)], axis=1))},
        "down": {"w": stack(lambda b: kernel(b.mlp.down_proj))},
    }
    params = {"embed": np32(model.model.embed_tokens.weight), "blocks": blocks,
              "final_norm": np32(model.model.norm.weight)}
    if not cfg.tie_embeddings:
        params["head"] = kernel(model.lm_head)
    return cfg, params


def svd_factors(w: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced truncated SVD: ``w [d_in, d_out] ~= A @ B``.

    ``A = U_r sqrt(S_r)`` is ``[d_in, r]`` and ``B = sqrt(S_r) V_r^T`` is ``[r, d_out]``; the
    SVD runs in float64 and the factors are returned in fp32. ``A @ B`` is the best rank-``r``
    approximation of ``w`` (Eckart-Young), and ``w`` itself at ``r = min(d_in, d_out)``.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"svd_factors needs a matrix, got shape {w.shape}")
    if not 1 <= rank <= min(w.shape):
        raise ValueError(f"rank={rank} must be in [1, {min(w.shape)}] for shape {w.shape}")
    u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    root = np.sqrt(s[:rank])
    a = u[:, :rank] * root[None, :]
    b = root[:, None] * vt[:rank]
    return a.astype(np.float32), b.astype(np.float32)


def _factors(w: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`svd_factors`, zero-padded to ``rank`` when ``rank > min(w.shape)`` (exact)."""
    k = min(rank, *w.shape)
    a, b = svd_factors(w, k)
    if k < rank:
        a = np.pad(a, ((0, 0), (0, rank - k)))
        b = np.pad(b, ((0, rank - k), (0, 0)))
    return a, b


def _factor_layers(w: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``w [L, d_in, d_out]`` -> ``A [L, d_in, r]``, ``B [L, r, d_out]``."""
    pairs = [_factors(layer, rank) for layer in np.asarray(w)]
    return np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs])


def lowrank_from_dense(cfg: Model, params: dict, arch: str = "svd", rank: int | None = None,
                       attn_rank: int | None = None, mlp_rank: int | None = None
                       ) -> tuple[Model, dict]:
    """Initialise a low-rank model from a dense one by truncated SVD of every projection.

    Args:
      cfg, params: a dense model (e.g. from :func:`load_hf`), params in the nested layout.
      arch: ``svd`` or ``cola``.
      rank, attn_rank, mlp_rank: as the :class:`Model` fields (unset ranks: ``d_model // 4``).
    Returns:
      ``(lowrank_cfg, params)`` with the seven projections of every layer factored:
      ``qkv/a [L, d, 3, r_a]`` (q, k, v), ``qkv/b_q [L, 1, r_a, d]``,
      ``qkv/b_kv [L, 2, r_a, d_kv]``, ``o/a [L, d, r_a]``, ``o/b [L, r_a, d]``,
      ``gate_up/a [L, d, 2, r_m]``, ``gate_up/b_gu [L, 2, r_m, d_ff]``,
      ``down/a [L, d_ff, r_m]``, ``down/b [L, r_m, d]``; norms, embedding and head are copied.

    The MLP keeps the SiLU on the gate, as in the dense model (svd always does; for cola the
    new config sets ``only_lr_act=False``). For ``svd`` the result computes exactly the dense
    model with each projection replaced by its best rank-r approximation. For ``cola`` a SiLU
    sits between the factors, so the factorisation is only an initialisation, not an
    equivalent model. A rank larger than a projection's smaller side (e.g. ``d_kv`` under GQA)
    is met by zero-padding the factors: exact, but those latent directions start dead (zero
    gradient).
    """
    if cfg.arch != "dense":
        raise ConfigError(f"lowrank_from_dense needs a dense model, got Model.arch={cfg.arch!r}")
    if arch not in LOWRANK_ARCHS:
        raise ConfigError(f"arch={arch!r} cannot be initialised by SVD; choose from "
                          f"{', '.join(LOWRANK_ARCHS)}")
    new = dataclasses.replace(cfg, arch=arch, rank=rank, attn_rank=attn_rank,
                              mlp_rank=mlp_rank, only_lr_act=False)
    ra, rm = new.attn_rank, new.mlp_rank
    src = params["blocks"]
    w_q, w_kv = np.asarray(src["qkv"]["w_q"]), np.asarray(src["qkv"]["w_kv"])
    w_gu = np.asarray(src["gate_up"]["w_gu"])
    q, k, v = (_factor_layers(w, ra) for w in (w_q[:, :, 0], w_kv[:, :, 0], w_kv[:, :, 1]))
    gate, up = (_factor_layers(w_gu[:, :, i], rm) for i in range(2))
    o_a, o_b = _factor_layers(src["o"]["w"], ra)
    down_a, down_b = _factor_layers(src["down"]["w"], rm)
    blocks = {
        "attn_norm": np.asarray(src["attn_norm"], np.float32),
        "qkv": {"a": np.stack([q[0], k[0], v[0]], axis=2),
                "b_q": q[1][:, None],
                "b_kv": np.stack([k[1], v[1]], axis=1)},
        "o": {"a": o_a, "b": o_b},
        "mlp_norm": np.asarray(src["mlp_norm"], np.float32),
        "gate_up": {"a": np.stack([gate[0], up[0]], axis=2),
                    "b_gu": np.stack([gate[1], up[1]], axis=1)},
        "down": {"a": down_a, "b": down_b},
    }
    out = {name: np.asarray(value, np.float32) for name, value in params.items()
           if name != "blocks"}
    out["blocks"] = blocks
    return new, out
