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
