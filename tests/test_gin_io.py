"""Gin text in and out: the operative config reproduces a run's config; every field is
described."""

import dataclasses

import gin

from boost_jax.config import Model, Parallel, Train
from boost_jax.gin_io import GROUPS, describe_fields, load_config, operative_gin, parse_gin


def test_the_operative_config_reproduces_the_config(tmp_path):
    parse_gin(bindings=["Model.arch='svd'", "Model.size='tiny'", "Model.mlp_rank=8",
                        "Train.learning_rate=1", "Parallel.remat='lowrank'",
                        "Data.tokenizer='bpe:512'"])
    config = load_config()
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)
    path = tmp_path / "config.gin"
    path.write_text(operative_gin(config))
    gin.clear_config()
    parse_gin(files=[str(path)])
    assert load_config() == config
    text = path.read_text()
    assert "Model.d_model = 64  # hidden size" in text  # presets resolved, every field
    bindings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(bindings) == sum(len(dataclasses.fields(c)) for c in GROUPS.values())


def test_every_field_is_described():
    rows = describe_fields()
    assert len(rows) == sum(len(dataclasses.fields(c)) for c in GROUPS.values())
    assert all(meaning.strip() for *_, meaning in rows)
    assert {r[3] for r in rows} == {"must match", "changes the trajectory", "may change"}
    by_name = {r[0]: r for r in rows}
    assert by_name["Train.eval_batches"][1:3] == ("int", "4")
    assert by_name["Model.rank"][1:3] == ("int | None", "None")
    assert by_name["Parallel.tp_plan"][2] == repr(Parallel().tp_plan)
    assert by_name["Model.arch"][2] == repr(Model.arch)
    assert by_name["Train.learning_rate"][2] == repr(Train.learning_rate)
