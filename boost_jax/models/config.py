"""The ``Model`` config group: the decoder's architecture, dimensions and low-rank
options, its preset resolved (models/presets.py). Re-exported by :mod:`boost_jax.config`
beside the other groups."""

from __future__ import annotations

import dataclasses

from boost_jax.config_fields import FREE, MATCH, Derived
from boost_jax.config_fields import check as _check
from boost_jax.config_fields import config_field as _field
from boost_jax.models.presets import PRESETS

ARCHS = ("dense", "svd", "cola", "lax")
LAX_GATES = ("identity", "dense", "kronecker")
LOWRANK_INITS = ("cola", "loro")
LATENT_ACT_ARCHS = ("cola", "lax")  # a latent SiLU that only_lr_act lets replace the MLP's

@dataclasses.dataclass(frozen=True)
class Model(metaclass=Derived):
    """The decoder. ``size`` picks a preset (models/presets.py); any field set here wins.
    ``size='custom'`` starts from no preset (every dimension must then be given).

    ``rank`` sets both ``attn_rank`` (q, k, v, o) and ``mlp_rank`` (gate, up, down); unset ranks
    default to ``d_model // 4``.

    The MLP is SwiGLU for ``dense`` and ``svd`` (LORO's low-rank LLaMA); ``only_lr_act`` (CoLA's)
    lets cola's and lax's latent SiLU replace it. ``lax`` defaults to the authors' LaX-CoLA
    (Kronecker gate, latent LayerNorm); the identity/dense gates and no norm are this project's.
    """

    arch: str = _field("cola", "projections: dense | svd (B A x) | cola (B silu(A x)) | lax "
                       "(latent crossing)", MATCH)
    size: str = _field("small", "preset: " + " | ".join(PRESETS) + " | custom (no preset)", MATCH)
    d_model: int | None = _field(None, "hidden size (None: the preset's)", MATCH)
    n_layers: int | None = _field(None, "decoder blocks (None: the preset's)", MATCH)
    n_heads: int | None = _field(None, "attention heads (None: the preset's)", MATCH)
    n_kv_heads: int | None = _field(None, "key/value heads, grouped-query attention (None: the "
                                    "preset's, or n_heads)", MATCH)
    d_ff: int | None = _field(None, "MLP hidden size (None: the preset's)", MATCH)
    rank: int | None = _field(None, "sets attn_rank and mlp_rank together", MATCH)
    attn_rank: int | None = _field(None, "rank of the q, k, v, o factors (None: rank, else "
                                   "d_model // 4)", MATCH)
    mlp_rank: int | None = _field(None, "rank of the gate, up, down factors (None: rank, else "
                                  "d_model // 4)", MATCH)
    vocab_size: int | None = _field(None, "embedding rows, >= the tokenizer's vocabulary (None: "
                                    "the preset's)", MATCH)
    tie_embeddings: bool | None = _field(None, "share the input embedding with the output head "
                                         "(None: the preset's)", MATCH)
    only_lr_act: bool | None = _field(None, "cola/lax MLP: True = down(gate * up), False = "
                                      "down(silu(gate) * up) (None: the preset's); dense, svd: "
                                      "always the latter (None: False; svd refuses True)", MATCH)
    lax_gate: str = _field("kronecker", "LaX latent-crossing gate: kronecker (the LaX "
                           "authors') | identity | dense (this project's variants)", MATCH)
    lax_latent_norm: bool = _field(True, "LaX: LayerNorm over the r-wide latent after crossing "
                                   "(the authors'; False: this project's variant)", MATCH)
    lowrank_init: str = _field("cola", "init of the low-rank factors: cola (CoLA's std "
                               "(d_in+d_out)^-1/4 r^-1/4 on both) | loro (LORO's Xavier normal, "
                               "std sqrt(2/(d_in+r)) and sqrt(2/(r+d_out)))", FREE)
    rope_theta: float = _field(10000.0, "RoPE base frequency", MATCH)
    norm_eps: float = _field(1e-6, "RMSNorm epsilon", MATCH)
    init_std: float = _field(0.02, "initial std of embeddings and dense projections", FREE)

    @classmethod
    def derive(cls, v: dict) -> dict:
        """The preset's value of every dimension left None, the key/value heads (the preset's
        with its head count, else ``n_heads``) and the ranks (``rank``, else ``d_model //
        4``) -- :class:`~boost_jax.config_fields.Derived`."""
        v = dict(v)
        preset = {"only_lr_act": True, "tie_embeddings": False, **PRESETS.get(v["size"], {})}
        if v["arch"] not in LATENT_ACT_ARCHS:  # no latent activation to stand in for the SiLU
            preset["only_lr_act"] = False
        for field in ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size", "tie_embeddings",
                      "only_lr_act", "rank"):
            if v[field] is None and field in preset:
                v[field] = preset[field]
        if v["n_kv_heads"] is None:
            # a preset's kv-head count only applies when the head count is the preset's too
            same = "n_kv_heads" in preset and v["n_heads"] == preset["n_heads"]
            v["n_kv_heads"] = preset["n_kv_heads"] if same else v["n_heads"]
        d = v["d_model"]
        if isinstance(d, int) and d > 0:
            default_rank = v["rank"] if v["rank"] is not None else max(d // 4, 1)
            v["attn_rank"] = v["attn_rank"] or default_rank
            v["mlp_rank"] = v["mlp_rank"] or default_rank
        return v

    def __post_init__(self):
        _check(self.arch in ARCHS, f"Model.arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        _check(self.size in PRESETS or self.size == "custom",
               f"Model.size={self.size!r} is not a preset; choose from {', '.join(PRESETS)} "
               "or 'custom' (every dimension set explicitly)")
        _check(self.arch != "svd" or not self.only_lr_act, "Model.only_lr_act=True needs "
               "a latent activation to replace the MLP's SiLU (cola, lax); Model.arch='svd' "
               "has none, so its MLP is always down(silu(gate) * up): leave it unset")
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0,
                   f"Model.{name}={value!r} must be a positive integer")
        d = self.d_model
        _check(d % self.n_heads == 0,
               f"Model.n_heads={self.n_heads} does not divide Model.d_model={d}")
        _check(self.n_heads % self.n_kv_heads == 0,
               f"Model.n_kv_heads={self.n_kv_heads} does not divide Model.n_heads={self.n_heads}")
        _check(self.head_dim % 2 == 0, f"head dim {self.head_dim} must be even for RoPE")
        if self.is_lowrank:
            for name in ("attn_rank", "mlp_rank"):
                r = getattr(self, name)
                _check(isinstance(r, int) and 0 < r < d,
                       f"Model.{name}={r} must satisfy 0 < rank < Model.d_model={d}"
                       + (" (set by Model.rank)" if self.rank is not None else ""))
        _check(self.lax_gate in LAX_GATES,
               f"Model.lax_gate={self.lax_gate!r} is not one of {', '.join(LAX_GATES)}")
        _check(self.lowrank_init in LOWRANK_INITS, f"Model.lowrank_init={self.lowrank_init!r} "
               f"is not one of {', '.join(LOWRANK_INITS)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_lowrank(self) -> bool:
        return self.arch != "dense"

    @property
    def bilinear_mlp(self) -> bool:
        """The MLP is ``down(gate * up)``: the latent SiLU replaces the gate's (only_lr_act)."""
        return self.arch in LATENT_ACT_ARCHS and bool(self.only_lr_act)
