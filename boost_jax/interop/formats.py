"""Export a boost_jax model to a directory other tools load; read such a directory back.

``--format`` picks what the directory holds (``auto`` picks by arch):

==========  ===================  =========================================================
format      arch                 directory
==========  ===================  =========================================================
``hf``      dense, svd           ``LlamaForCausalLM``: ``model.safetensors`` with
                                 ``{module}.weight [out, in]`` (svd: ``A @ B`` multiplied
                                 out, exact); with ``keep_factors`` (svd only) the factored
                                 ``boost_svd`` layout (``lowrank_a [in, r]``,
                                 ``lowrank_b [r, out]``) instead
``cola``    cola                 the CoLA repository's ``ColaForCausalLM`` (interop/cola.py)
``lax``     lax                  the ``boost_lax`` layout: CoLA factors + crossing gates and
                                 latent norm (interop/layouts.py)
==========  ===================  =========================================================

An svd model has LLaMA's SwiGLU MLP, so its ``hf`` export is a plain ``LlamaForCausalLM``
(``hidden_act: "silu"``). cola and lax have a SiLU between the factors, which no
``LlamaForCausalLM`` can express: ``--format=hf`` refuses them.

Every directory also holds ``config.json`` (a ``LlamaConfig`` plus the layout's fields),
``generation_config.json`` (bos/eos) and the tokenizer: ``tokenizer.json`` +
``tokenizer_config.json`` (``PreTrainedTokenizerFast``) for a byte-level BPE, or
``tokenizer.model`` + ``tokenizer_config.json`` (``LlamaTokenizer``) for a SentencePiece model;
neither adds BOS/EOS, as in training (documents are separated by EOS only).

Directories are written beside the output as ``.<out>.partial`` and renamed into place when
complete (boost_jax/publish.py); an existing output is only replaced with ``overwrite`` and
only if it holds an exported model. safetensors is written with ``safetensors.numpy`` (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from boost_jax import publish
from boost_jax.config import ConfigError, Model
from boost_jax.data import tokenizer as tokenizers
from boost_jax.interop import cola
from boost_jax.interop.layouts import (
    WEIGHTS_FILE,
    from_state_dict,
    llama_fields,
    load_safetensors,
    model_from_fields,
    save_safetensors,
    to_state_dict,
)
from boost_jax.models.projections import LAX_NORM_EPS

FORMATS = ("auto", "hf", "cola", "lax")
SVD_MODEL_TYPE, LAX_MODEL_TYPE = "boost_svd", "boost_lax"  # our own factored layouts
_ARCH_FORMAT = {"dense": "hf", "svd": "hf", "cola": "cola", "lax": "lax"}


@dataclasses.dataclass(frozen=True)
class Exported:
    """What :func:`export_model` wrote: the directory, its layout, tensors and bytes."""

    path: Path
    layout: str
    tensors: int
    nbytes: int
    tokenizer: str | None


def resolve_layout(cfg: Model, fmt: str = "auto", keep_factors: bool = False) -> str:
    """The layout (interop/layouts.py) of ``cfg`` exported as ``fmt``; ConfigError (one line)
    for a format the arch cannot take."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format={fmt!r} is not one of {', '.join(FORMATS)}")
    arch = cfg.arch
    fmt = _ARCH_FORMAT[arch] if fmt == "auto" else fmt
    if keep_factors and arch == "dense":
        raise ConfigError("--keep_factors needs a low-rank model; a dense model has no factors")
    if fmt == "hf":
        if arch in ("cola", "lax"):
            raise ConfigError(f"--format=hf cannot hold Model.arch={arch!r}: its SiLU between "
                              "the factors is not expressible as a LlamaForCausalLM; use "
                              f"--format={arch} (or --format=auto)")
        return "svd_factored" if arch == "svd" and keep_factors else "llama"
    if fmt == "cola":
        cola.check_cola_exportable(cfg)
        return "cola"
    if arch != "lax":
        raise ConfigError(f"--format=lax needs a lax model, this one is Model.arch={arch!r}; "
                          f"use --format={_ARCH_FORMAT[arch]}")
    return "lax"


def config_json(cfg: Model, layout: str, max_positions: int = 2048,
                bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The ``config.json`` of ``cfg`` in ``layout``."""
    ids = dict(max_positions=max_positions, bos_id=bos_id, eos_id=eos_id)
    if layout == "cola":
        return cola.cola_config(cfg, **ids)
    if layout == "llama":  # dense or svd: SwiGLU
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                **llama_fields(cfg, "silu", **ids)}
    ranks = {"attn_rank": cfg.attn_rank, "mlp_rank": cfg.mlp_rank,
             "only_lr_act": cfg.only_lr_act}
    if layout == "svd_factored":
        return {"architectures": ["BoostSvdForCausalLM"], "model_type": SVD_MODEL_TYPE,
                **llama_fields(cfg, "silu", **ids), **ranks, "lr_act_type": "identity"}
    return {"architectures": ["BoostLaxForCausalLM"], "model_type": LAX_MODEL_TYPE,
            **llama_fields(cfg, "silu", **ids), **ranks, "lr_act_type": "silu",
            "lax_gate": cfg.lax_gate, "lax_latent_norm": cfg.lax_latent_norm,
            "lax_norm_eps": LAX_NORM_EPS}


def tokenizer_files(tok: tokenizers.Tokenizer, directory: Path, max_positions: int
                    ) -> tuple[int | None, int | None]:
    """Write ``tok`` so ``AutoTokenizer.from_pretrained(directory)`` loads it; returns its
    ``(bos_id, eos_id)``. No BOS or EOS is added on encoding, as in training."""
    common = {"model_max_length": max_positions, "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False}
    if tok.kind == "hf":
        shutil.copyfile(tok.path, directory / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizers.EOT,
                  **common}
        special = {"eos_token": tokenizers.EOT}
    else:
        sp = tok.sp
        piece = {name: sp.id_to_piece(i) for name, i in (
            ("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id()))
            if i >= 0}
        shutil.copyfile(tok.path, directory / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", **piece, "legacy": False, **common}
        special = piece
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "special_tokens_map.json", special)
    bos = tok.bos_id if tok.bos_id is not None and tok.bos_id >= 0 else None
    return bos, tok.eos_id


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / WEIGHTS_FILE).is_file()


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an output that is a file, a non-empty directory (unless ``overwrite`` and it
    holds an export) or in a place that cannot be written; ConfigError (one line)."""
    refused = publish.refusal(out, _is_export, overwrite)
    if refused is None:
        return
    if refused.reason == publish.FILE:
        raise ConfigError(f"--out={out} exists and is not a directory; choose another --out")
    if refused.reason == publish.FOREIGN:
        raise ConfigError(f"--out={out} is a directory holding other files, not an "
                          "exported model; choose another --out (never replaced, even "
                          "with --overwrite)")
    if refused.reason == publish.TAKEN:
        raise ConfigError(f"--out={out} already holds an exported model; pass "
                          "--overwrite to replace it")
    raise ConfigError(f"cannot create --out={out}: {refused.parent} is not a writable "
                      "directory")


def export_model(cfg: Model, params: dict, out: str | Path, fmt: str = "auto",
                 keep_factors: bool = False, tokenizer: tokenizers.Tokenizer | None = None,
                 overwrite: bool = False, max_positions: int = 2048,
                 provenance: dict | None = None) -> Exported:
    """Write ``(cfg, params)`` (canonical fp32 params) to the directory ``out`` in format
    ``fmt`` (see the module docstring), with ``tokenizer``'s files when given.
    ``max_positions`` becomes ``max_position_embeddings`` (RoPE itself has no limit);
    ``provenance`` is recorded under ``boost_jax`` in config.json. Raises ConfigError (one
    line) before writing anything when the format or the output is refused."""
    out = Path(out)
    layout = resolve_layout(cfg, fmt, keep_factors)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than "
                          f"Model.vocab_size={cfg.vocab_size}")
    check_output(out, overwrite)
    state = to_state_dict(cfg, params, layout)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = publish.work_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        bos = eos = None
        if tokenizer is not None:
            bos, eos = tokenizer_files(tokenizer, work, max_positions)
        config = config_json(cfg, layout, max_positions, bos, eos)
        config["boost_jax"] = {"arch": cfg.arch, "layout": layout, **(provenance or {})}
        _write_json(work / "config.json", config)
        if eos is not None:
            _write_json(work / "generation_config.json",
                        {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos})
        save_safetensors(state, work / WEIGHTS_FILE, {"boost_jax_layout": layout})
        publish.publish(work, out, _is_export)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Exported(out, layout, len(state), sum(v.nbytes for v in state.values()),
                    tokenizer.kind if tokenizer is not None else None)


def load_export(directory: str | Path) -> tuple[Model, dict]:
    """Read an exported directory back: ``(cfg, params)`` in the canonical layout.

    Handles every layout :func:`export_model` writes: ``llama`` (a dense model; an svd model
    multiplied out comes back dense; ``hidden_act='linear'``, the bilinear MLP svd had before
    it kept SwiGLU, is refused), ``boost_svd``,
    ``cola`` (any CoLA checkpoint, :func:`~boost_jax.interop.cola.import_cola`) and
    ``boost_lax``. No torch needed."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} holds no config.json (not an exported model)")
    fields = json.loads((directory / "config.json").read_text())
    kind = fields.get("model_type")
    if kind == cola.COLA_MODEL_TYPE:
        return cola.import_cola(directory)
    ranks = {k: fields[k] for k in ("attn_rank", "mlp_rank", "only_lr_act") if k in fields}
    if kind == "llama":
        if fields.get("hidden_act") == "linear":
            raise ConfigError(f"{directory}: hidden_act='linear' (the bilinear MLP of an svd "
                              "model exported before svd kept LLaMA's SwiGLU) has no boost_jax "
                              "equivalent")
        cfg, layout = model_from_fields(fields), "llama"
    elif kind == SVD_MODEL_TYPE:
        cfg, layout = model_from_fields(fields, arch="svd", **ranks), "svd_factored"
    elif kind == LAX_MODEL_TYPE:
        lax = {k: fields[k] for k in ("lax_gate", "lax_latent_norm") if k in fields}
        cfg, layout = model_from_fields(fields, arch="lax", **ranks, **lax), "lax"
    else:
        raise ConfigError(f"{directory}: model_type={kind!r} is not one boost_jax exports "
                          f"(llama, cola, {SVD_MODEL_TYPE}, {LAX_MODEL_TYPE})")
    return cfg, from_state_dict(cfg, load_safetensors(directory), layout)
