"""The CoLA repository's ``ColaForCausalLM`` checkpoint layout: export and import.

Facts taken from the CoLA code (github.com/alvin-zyl/CoLA; read in its public forks
olokevin/CoLA and NamrataRShivagunde/CoLA, same files):

* ``cola/cola_layer.py`` -- ``ColaLayer(in, out, rank, bias, lr_act=True, lr_act_type)``:
  parameters ``cola_a [in, r]`` and ``cola_b [r, out]`` (``x @ W`` orientation, not torch's
  ``[out, in]``) and an optional ``bias [out]``; ``forward = act(x @ cola_a) @ cola_b (+ bias)``.
* ``cola/modeling_cola.py`` -- every one of q/k/v/o and gate/up/down is a ``ColaLayer`` with
  ``config.rank``, ``bias=config.attention_bias`` / ``config.mlp_bias`` and
  ``lr_act_type=config.hidden_act`` (so SiLU on every latent); ``ColaMLP`` computes
  ``down(act(gate(x)) * up(x))``, or ``down(gate(x) * up(x))`` when ``config.only_lr_act``;
  k/v are built ``num_heads * head_dim`` wide (no grouped-query attention); the rest is
  LLaMA: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm`` /
  ``post_attention_layernorm`` (RMSNorm), ``model.norm``, ``lm_head`` (tied through
  ``tie_word_embeddings``), rotate-half RoPE.
* ``cola/configuration_cola.py`` -- ``ColaConfig(LlamaConfig)``, ``model_type='cola'``, adds
  ``rank`` (default ``hidden_size // 4``), ``lr_act_type`` (default ``hidden_act``) and
  ``only_lr_act`` (default True); ``rms_norm_eps`` defaults to 1e-6.
* ``cola_configs/cola_60m.json`` -- a config.json: ``architectures: ["ColaForCausalLM"]``,
  ``model_type: "cola"``, the LLaMA sizes, ``rank``, ``only_lr_act``.

boost_jax's ``cola`` arch is the same model: ``only_lr_act`` means the same, the per-member
SiLU is the same, and norms, RoPE and head agree with LLaMA. What does not carry over: CoLA
has one ``rank`` (boost_jax has ``attn_rank`` and ``mlp_rank``), no grouped-query attention,
and optional biases (boost_jax has none); such models are refused with a one-line
:class:`ConfigError` in either direction.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from boost_jax.config import ConfigError, Model
from boost_jax.interop.layouts import (
    from_state_dict,
    llama_fields,
    load_safetensors,
    model_from_fields,
    to_state_dict,
)

COLA_REPO = "github.com/alvin-zyl/CoLA"
COLA_MODELING = "cola/modeling_cola.py"  # ColaAttention, ColaMLP, ColaForCausalLM
COLA_CONFIGURATION = "cola/configuration_cola.py"  # ColaConfig: rank, lr_act_type, only_lr_act
COLA_MODEL_TYPE = "cola"
COLA_ARCHITECTURE = "ColaForCausalLM"


def check_cola_exportable(cfg: Model) -> None:
    """Raise a one-line ConfigError unless ``cfg`` is a model ``ColaForCausalLM`` can hold."""
    if cfg.arch != "cola":
        raise ConfigError(f"--format=cola needs a cola model, this one is "
                          f"Model.arch={cfg.arch!r}")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ConfigError(f"the CoLA repository has no grouped-query attention (its k/v are "
                          f"num_heads wide) but Model.n_kv_heads={cfg.n_kv_heads} < "
                          f"Model.n_heads={cfg.n_heads}")
    if cfg.attn_rank != cfg.mlp_rank:
        raise ConfigError(f"the CoLA repository has one rank for every projection but "
                          f"Model.attn_rank={cfg.attn_rank} != Model.mlp_rank={cfg.mlp_rank}")


def cola_config(cfg: Model, max_positions: int = 2048, bos_id: int | None = None,
                eos_id: int | None = None) -> dict:
    """The ``config.json`` of ``cfg`` as a ``ColaConfig``."""
    check_cola_exportable(cfg)
    return {"architectures": [COLA_ARCHITECTURE], "model_type": COLA_MODEL_TYPE,
            **llama_fields(cfg, "silu", max_positions, bos_id, eos_id),
            "rank": cfg.attn_rank, "lr_act_type": "silu", "only_lr_act": cfg.only_lr_act}


def cola_state_dict(cfg: Model, params: dict) -> dict[str, np.ndarray]:
    """``ColaForCausalLM``'s state dict of a boost_jax cola model (fp32): per layer
    ``self_attn.{q,k,v,o}_proj.cola_a [in, r]``/``cola_b [r, out]``, the same under
    ``mlp.{gate,up,down}_proj``, the two norms; ``model.embed_tokens.weight [V, d]``,
    ``model.norm.weight [d]`` and ``lm_head.weight [V, d]`` unless tied."""
    check_cola_exportable(cfg)
    return to_state_dict(cfg, params, "cola")


def cola_model_config(fields: dict) -> Model:
    """The boost_jax cola :class:`Model` of a CoLA ``config.json`` (ColaConfig defaults for
    absent fields); ConfigError for what boost_jax cannot represent."""
    kind = fields.get("model_type")
    if kind != COLA_MODEL_TYPE:
        raise ConfigError(f"config.json has model_type={kind!r}, not {COLA_MODEL_TYPE!r} "
                          f"(a {COLA_ARCHITECTURE} checkpoint of {COLA_REPO})")
    act = fields.get("lr_act_type") or fields.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"lr_act_type={act!r} is not supported (boost_jax's cola uses SiLU)")
    heads = fields.get("num_attention_heads")
    kv_heads = fields.get("num_key_value_heads") or heads
    if kv_heads != heads:  # CoLA's own model cannot run it either (k/v are num_heads wide)
        raise ConfigError(f"num_key_value_heads={kv_heads} != num_attention_heads={heads}: "
                          "CoLA's k/v projections are num_heads wide")
    d = fields.get("hidden_size", 0)
    rank = fields.get("rank") or d // 4
    return model_from_fields(fields, arch="cola", attn_rank=rank, mlp_rank=rank,
                             only_lr_act=bool(fields.get("only_lr_act", True)))


def import_cola(directory: str | Path) -> tuple[Model, dict]:
    """A CoLA checkpoint directory (``config.json`` + ``model.safetensors``, as
    ``ColaForCausalLM.save_pretrained`` writes it) -> ``(cfg, params)``: a boost_jax cola
    :class:`Model` and its fp32 params in the canonical layout (models/decoder.py).

    Raises ConfigError (one line) for a missing directory or file, a config boost_jax cannot
    represent, bias tensors, or missing, extra or misshapen tensors."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} holds no config.json (not a saved {COLA_ARCHITECTURE})")
    try:
        fields = json.loads((directory / "config.json").read_text())
    except ValueError as err:
        raise ConfigError(f"{directory / 'config.json'} is not JSON ({err})") from None
    cfg = cola_model_config(fields)
    return cfg, from_state_dict(cfg, load_safetensors(directory), "cola")
