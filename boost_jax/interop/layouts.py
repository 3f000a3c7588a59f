"""Per-layer, per-projection tensor layouts of exported models, and their safetensors files.

boost_jax stores a model's blocks stacked (``[L, ...]``) and its projections grouped (q/k/v
and gate/up share one ``A``; see models/projections.py). An exported checkpoint names every
tensor of every layer on its own, Hugging Face style, under ``model.layers.{i}.``. The
layouts differ only in how a projection ``y = sigma(x A) B`` is written:

* ``llama``: ``{module}.weight [out, in]`` (torch ``nn.Linear`` orientation), ``W = A @ B``
  multiplied out for ``svd`` (exact: no activation between the factors);
* ``svd_factored``: ``{module}.lowrank_a [in, r]`` and ``{module}.lowrank_b [r, out]``,
  ``y = x @ lowrank_a @ lowrank_b``;
* ``cola``: ``{module}.cola_a [in, r]`` and ``{module}.cola_b [r, out]``,
  ``y = silu(x @ cola_a) @ cola_b`` (the CoLA repository's ``ColaLayer``, interop/cola.py);
* ``lax``: the ``cola`` factors plus the latent crossing of LaX, ``{module}.lax_gate_w [r, r]``
  and ``lax_gate_b [r]`` (dense gate), ``lax_gate_dec [a, a]`` and ``lax_gate_enc [b, b]``
  (Kronecker gate, ``a * b = r``), ``lax_norm.weight``/``lax_norm.bias [r]`` (latent norm).

Factors and gates keep the ``x @ W`` orientation of boost_jax (as CoLA does); only the
``llama`` weights are transposed. Everything is float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from boost_jax.config import ConfigError, Model
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import flatten

LAYOUTS = ("llama", "svd_factored", "cola", "lax")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded checkpoints (read only)
LAYER = "model.layers.{i}."

# (name, module under model.layers.{i}, boost_jax group, member index in the group or None)
PROJECTIONS = (
    ("q", "self_attn.q_proj", "qkv", 0), ("k", "self_attn.k_proj", "qkv", 1),
    ("v", "self_attn.v_proj", "qkv", 2), ("o", "self_attn.o_proj", "o", None),
    ("gate", "mlp.gate_proj", "gate_up", 0), ("up", "mlp.up_proj", "gate_up", 1),
    ("down", "mlp.down_proj", "down", None),
)
# where a member's up factor B / dense weight lives: (parameter, index on its member axis)
_B_SLOT = {"q": ("b_q", 0), "k": ("b_kv", 0), "v": ("b_kv", 1), "gate": ("b_gu", 0),
           "up": ("b_gu", 1)}
_W_SLOT = {"q": ("w_q", 0), "k": ("w_kv", 0), "v": ("w_kv", 1), "gate": ("w_gu", 0),
           "up": ("w_gu", 1)}
FACTOR_NAMES = {"svd_factored": ("lowrank_a", "lowrank_b"), "cola": ("cola_a", "cola_b"),
                "lax": ("cola_a", "cola_b")}
CROSSING_NAMES = {"gate_w": "lax_gate_w", "gate_b": "lax_gate_b", "gate_enc": "lax_gate_enc",
                  "gate_dec": "lax_gate_dec", "norm_scale": "lax_norm.weight",
                  "norm_bias": "lax_norm.bias"}
_NORMS = (("attn_norm", "input_layernorm.weight"),
          ("mlp_norm", "post_attention_layernorm.weight"))


def split_projections(blocks: dict) -> dict[str, dict]:
    """Stacked, grouped block parameters -> ``{projection: {"w"|"a"|"b": [L, ...],
    "crossing": {name: [L, ...]}}}`` with ``w [L, in, out]``, ``a [L, in, r]``,
    ``b [L, r, out]`` (whichever the arch has)."""
    out = {}
    for name, _, group, member in PROJECTIONS:
        g, proj = blocks[group], {}
        if member is None:
            proj.update({k: g[k] for k in ("w", "a", "b") if k in g})
        else:
            if "a" in g:
                proj["a"] = g["a"][:, :, member]
            for key, (slot, j) in (("b", _B_SLOT[name]), ("w", _W_SLOT[name])):
                if slot in g:
                    proj[key] = g[slot][:, j] if key == "b" else g[slot][:, :, j]
        if "crossing" in g:
            proj["crossing"] = {k: v if member is None else v[:, member]
                                for k, v in g["crossing"].items()}
        out[name] = proj
    return out


def merge_projections(projs: dict[str, dict]) -> dict:
    """Inverse of :func:`split_projections` (norms not included)."""
    blocks: dict = {}
    for group in ("qkv", "o", "gate_up", "down"):
        members = [(n, m) for n, _, g, m in PROJECTIONS if g == group]
        g: dict = {}
        if members[0][1] is None:
            g.update(projs[members[0][0]])
        else:
            names = [n for n, _ in members]
            if "a" in projs[names[0]]:
                g["a"] = np.stack([projs[n]["a"] for n in names], axis=2)
            for key, slots in (("b", _B_SLOT), ("w", _W_SLOT)):
                if key not in projs[names[0]]:
                    continue
                for slot in dict.fromkeys(slots[n][0] for n in names):
                    parts = [projs[n][key] for n in names if slots[n][0] == slot]
                    g[slot] = np.stack(parts, axis=1 if key == "b" else 2)
            if "crossing" in projs[names[0]]:
                g["crossing"] = {k: np.stack([projs[n]["crossing"][k] for n in names], axis=1)
                                 for k in projs[names[0]]["crossing"]}
        blocks[group] = g
    return blocks


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32))


def to_state_dict(cfg: Model, params: dict, layout: str) -> dict[str, np.ndarray]:
    """The flat ``{name: fp32 array}`` of ``params`` in ``layout`` (see the module docstring).

    ``model.embed_tokens.weight [V, d]``, ``model.norm.weight [d]``, ``lm_head.weight [V, d]``
    (untied only), per layer ``input_layernorm.weight``/``post_attention_layernorm.weight
    [d]`` and the seven projections.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    blocks = params["blocks"]
    sd = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = np.asarray(params["head"]).T
    projs = split_projections(blocks)
    for i in range(cfg.n_layers):
        pre = LAYER.format(i=i)
        for ours, theirs in _NORMS:
            sd[pre + theirs] = blocks[ours][i]
        for name, module, _, _ in PROJECTIONS:
            p, base = projs[name], f"{pre}{module}."
            if layout == "llama":
                w = p["w"][i] if "w" in p else (np.asarray(p["a"][i], np.float64)
                                                @ np.asarray(p["b"][i], np.float64))
                sd[base + "weight"] = np.asarray(w).T
                continue
            a_name, b_name = FACTOR_NAMES[layout]
            sd[base + a_name], sd[base + b_name] = p["a"][i], p["b"][i]
            for key, value in p.get("crossing", {}).items():
                sd[base + CROSSING_NAMES[key]] = value[i]
    return {k: _f32(v) for k, v in sd.items()}


def crossing_keys(cfg: Model) -> tuple[str, ...]:
    """The LaX crossing parameters of ``cfg`` (none for other archs)."""
    if cfg.arch != "lax":
        return ()
    gate = {"identity": (), "dense": ("gate_w", "gate_b"),
            "kronecker": ("gate_enc", "gate_dec")}[cfg.lax_gate]
    return gate + (("norm_scale", "norm_bias") if cfg.lax_latent_norm else ())


def from_state_dict(cfg: Model, sd: dict[str, np.ndarray], layout: str,
                    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> dict:
    """Inverse of :func:`to_state_dict`: canonical fp32 params of ``cfg`` (a ``llama`` layout
    only for a dense ``cfg``). Names ending in one of ``ignore`` are skipped; a missing or
    unexpected tensor, or one of the wrong shape, is a :class:`ConfigError`."""
    left = {k: v for k, v in sd.items() if not k.endswith(ignore)}

    def take(name: str) -> np.ndarray:
        if name not in left:
            raise ConfigError(f"the checkpoint has no tensor {name!r} (is it a {layout} "
                              "layout of this config?)")
        return np.asarray(left.pop(name), np.float32)

    params = {"embed": take("model.embed_tokens.weight"),
              "final_norm": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        params["head"] = take("lm_head.weight").T
    else:
        left.pop("lm_head.weight", None)  # a tied head saved anyway is the embedding again
    layers: list[dict] = []
    for i in range(cfg.n_layers):
        pre, layer = LAYER.format(i=i), {}
        for ours, theirs in _NORMS:
            layer[ours] = take(pre + theirs)
        for name, module, _, _ in PROJECTIONS:
            base, proj = f"{pre}{module}.", {}
            if layout == "llama":
                proj["w"] = take(base + "weight").T
            else:
                a_name, b_name = FACTOR_NAMES[layout]
                proj["a"], proj["b"] = take(base + a_name), take(base + b_name)
                cross = {k: take(base + CROSSING_NAMES[k]) for k in crossing_keys(cfg)}
                if cross:
                    proj["crossing"] = cross
            layer[name] = proj
        layers.append(layer)
    if left:
        extra = sorted(left)
        bias = [k for k in extra if k.endswith(".bias") and "lax_norm" not in k]
        what = "bias tensors, which boost_jax projections do not have" if bias else \
            "tensors this config does not have"
        raise ConfigError(f"the checkpoint holds {len(extra)} {what}: "
                          f"{', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}")
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    blocks = merge_projections({n: stacked[n] for n, *_ in PROJECTIONS})
    for ours, _ in _NORMS:
        blocks[ours] = stacked[ours]
    params["blocks"] = blocks
    check_params(cfg, params)
    return params


def check_params(cfg: Model, params: dict) -> None:
    """``params`` has exactly the parameters and shapes of ``cfg`` (else a ConfigError)."""
    _, defs = abstract_model(cfg)
    flat = flatten(params)
    if set(flat) != set(defs):
        odd = sorted(set(flat) ^ set(defs))
        raise ConfigError(f"parameters do not match the config: {'/'.join(odd[0])} "
                          f"{'missing' if odd[0] in defs else 'unexpected'}")
    for path, d in defs.items():
        if tuple(flat[path].shape) != d.shape:
            raise ConfigError(f"parameter {'/'.join(path)} has shape {flat[path].shape}, "
                              f"the config needs {d.shape}")


def save_safetensors(sd: dict[str, np.ndarray], path: Path, metadata: dict | None = None
                     ) -> None:
    """Write ``sd`` with ``safetensors.numpy`` (no torch); ``format: pt`` is what
    ``transformers`` expects in the header."""
    from safetensors.numpy import save_file

    save_file(sd, str(path), metadata={"format": "pt", **(metadata or {})})
    path.chmod(0o644)  # safetensors writes it owner-only


def load_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` (or of the shards its index lists) in
    ``directory``, as fp32 numpy arrays (read through the flax backend, which knows bf16)."""
    from safetensors import safe_open

    directory = Path(directory)
    if (directory / WEIGHTS_FILE).is_file():
        files = [directory / WEIGHTS_FILE]
    elif (directory / WEIGHTS_INDEX).is_file():
        index = json.loads((directory / WEIGHTS_INDEX).read_text())
        files = [directory / f for f in dict.fromkeys(index["weight_map"].values())]
    else:
        raise ConfigError(f"{directory} has no {WEIGHTS_FILE} (or {WEIGHTS_INDEX}); only "
                          "safetensors checkpoints are read")
    out = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                out[name] = np.asarray(f.get_tensor(name), np.float32)
    return out



def llama_fields(cfg: Model, hidden_act: str = "silu", max_positions: int = 2048,
                 bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The ``LlamaConfig`` fields of ``cfg`` (every exported ``config.json`` starts here)."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": hidden_act, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": max_positions, "initializer_range": cfg.init_std,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
        "use_cache": True,
    }


def model_from_fields(fields: dict, **overrides) -> Model:
    """A :class:`Model` (``size='custom'``) from ``config.json`` fields (LlamaConfig
    defaults for absent ``rms_norm_eps``/``rope_theta``/``initializer_range``);
    ``overrides`` are further Model fields (``arch``, ranks, ...). Raises ConfigError."""
    from types import SimpleNamespace

    from boost_jax.interop.hf import model_config_from_hf

    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size")
    missing = [k for k in need if k not in fields]
    if missing:
        raise ConfigError(f"config.json has no {', '.join(missing)}")
    ns = SimpleNamespace(**{"rms_norm_eps": 1e-6, "rope_theta": 10000.0, **fields})
    return model_config_from_hf(ns, init_std=float(fields.get("initializer_range", 0.02)),
                                **overrides)
