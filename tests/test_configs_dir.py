"""Every gin file in configs/ parses into a valid Config (golden checks for a few values)."""

from pathlib import Path

import pytest

from boost_jax.gin_io import load_config, parse_gin

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.gin"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_file_is_valid(path):
    parse_gin(files=[str(path)])
    cfg = load_config()
    assert cfg.train.batch_size % cfg.parallel.data == 0


def test_default_gin_is_the_code_default():
    code_default = load_config()
    parse_gin(files=[str(CONFIGS_DIR / "default.gin")])
    assert load_config() == code_default


def test_golden_values():
    parse_gin(files=[str(CONFIGS_DIR / "cola_60m_c4.gin")])
    cfg = load_config()
    assert (cfg.model.d_model, cfg.model.attn_rank, cfg.model.only_lr_act) == (512, 128, False)
    assert (cfg.train.learning_rate, cfg.train.warmup_steps, cfg.train.dtype) == \
        (6e-3, 2000, "bfloat16")


#: size -> (lr, steps, warm-up; hidden, layers, d_ff, rank, only_lr_act), read from
#: alvin-zyl/CoLA at 91ff0d1: scripts/cola_scripts/cola<size>.sh (LR, STEPS, WU) and
#: cola_configs/cola_<size>.json (only_lr_act absent from 350m and 1b: their default, True)
COLA = {"60m": (6e-3, 10_000, 2_000, 512, 8, 1376, 128, False),
        "130m": (3e-3, 20_000, 2_000, 768, 12, 2048, 256, False),
        "350m": (3e-3, 60_000, 6_000, 1024, 24, 2736, 256, True),
        "1b": (2e-3, 100_000, 10_000, 2048, 24, 5461, 512, True)}

#: --batch_size (BZ) of scripts/cola_scripts/cola<size>.sh: the rows of one GPU's micro-batch
BZ = {"60m": 256, "130m": 256, "350m": 64, "1b": 32}


@pytest.mark.parametrize("size", COLA)
def test_the_cola_recipes_are_the_authors_scripts(size):
    """configs/cola/cola_<size>.gin: the authors' hyperparameters and model, on their rows
    (one padded document of at most 256 tokens each, 512 a step, bf16)."""
    parse_gin(files=[str(CONFIGS_DIR / "cola" / f"cola_{size}.gin")])
    cfg = load_config()
    m, t = cfg.model, cfg.train
    assert (t.learning_rate, t.steps, t.warmup_steps, m.d_model, m.n_layers, m.d_ff,
            m.attn_rank, m.only_lr_act) == COLA[size]
    assert (m.arch, m.vocab_size, m.tie_embeddings, m.mlp_rank) == ("cola", 32000, False,
                                                                    m.attn_rank)
    assert (t.batch_size, t.seq_len, t.dtype, t.weight_decay, t.grad_clip, t.min_lr_ratio,
            t.eval_every) == (512, 256, "bfloat16", 0.01, 0.5, 0.1, 1000)
    assert cfg.data.packing == "pad"
    assert (t.warmup_from_zero, t.decay_norms, t.loss_group_rows) == (True, True, BZ[size])


#: mzf666/LORO-main at 4da57b6: scripts/loro_c4/llama_<size>.sh (rank, freq, --lr,
#: --num_training_steps, --warmup_steps, --batch_size) and configs/llama_<size>.json
LORO = {"60m": (128, 500, 1e-2, 10_000, 1_000, 256, 512, 1376),
        "130m": (256, 500, 1e-2, 20_000, 2_000, 128, 768, 2048),
        "350m": (256, 500, 1e-2, 60_000, 2_000, 64, 1024, 2736),
        "1b": (512, 200, 5e-3, 100_000, 10_000, 32, 2048, 5461)}


@pytest.mark.parametrize("size", LORO)
def test_the_loro_recipes_are_the_authors_scripts(size):
    """configs/loro/loro_<size>.gin: the authors' LORO runs (svd LLaMA, Xavier factors, no
    weight decay, no clipping) on the papers' rows."""
    parse_gin(files=[str(CONFIGS_DIR / "loro" / f"loro_{size}.gin")])
    cfg = load_config()
    m, t = cfg.model, cfg.train
    assert (m.attn_rank, t.loro_exact_every, t.learning_rate, t.steps, t.warmup_steps,
            t.loss_group_rows, m.d_model, m.d_ff) == LORO[size]
    assert (m.arch, m.lowrank_init, m.vocab_size, m.tie_embeddings, m.mlp_rank) == (
        "svd", "loro", 32000, False, m.attn_rank)
    assert (t.optimizer, t.weight_decay, t.grad_clip, t.warmup_from_zero, t.batch_size,
            t.seq_len, t.dtype) == ("loro", 0.0, 0.0, True, 512, 256, "bfloat16")
    assert cfg.data.packing == "pad"
