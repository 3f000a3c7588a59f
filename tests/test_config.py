"""Config validation: every bad input is a one-line ConfigError naming the binding."""

import pytest

from boost_jax.config import ConfigError, Data, Model, Parallel, Train
from boost_jax.gin_io import load_config, parse_gin


def _err(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(arch="moe"), "Model.arch='moe'"),
    (dict(size="5b"), "Model.size='5b'"),
    (dict(size="tiny", rank=64), "Model.attn_rank=64 must satisfy 0 < rank < Model.d_model=64"),
    (dict(size="tiny", mlp_rank=100), "Model.mlp_rank=100"),
    (dict(size="tiny", n_heads=5), "Model.n_heads=5 does not divide Model.d_model=64"),
    (dict(size="tiny", n_heads=4, n_kv_heads=3), "Model.n_kv_heads=3 does not divide"),
    (dict(size="tiny", lax_gate="conv"), "Model.lax_gate='conv'"),
    (dict(size="custom"), "Model.d_model=None must be a positive integer"),
])
def test_bad_model(kwargs, needle):
    assert needle in _err(lambda: Model(**kwargs))


def test_dense_allows_any_rank_field():
    # rank limits apply to low-rank archs only
    assert Model(arch="dense", size="tiny", rank=64).d_model == 64


def test_presets_and_overrides():
    m = Model(size="7b")
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.attn_rank, m.mlp_rank) == \
        (4096, 32, 32, 11008, 1024, 1024)
    m = Model(size="60m")
    assert (m.attn_rank, m.only_lr_act, m.tie_embeddings) == (128, False, False)
    m = Model(size="tiny", d_model=128, attn_rank=8)
    assert (m.d_model, m.attn_rank, m.mlp_rank) == (128, 8, 32)  # mlp rank defaults to d/4
    assert Model(size="tiny", n_heads=16).n_kv_heads == 16  # preset kv heads only with its heads


def test_bad_parallel_and_train():
    assert "needs a tensor-parallel plan" in _err(lambda: Parallel(tensor=4, tp_plan="none"))
    assert "Parallel.pipeline_schedule='1f1b'" in _err(
        lambda: Parallel(pipeline_schedule="1f1b"))
    assert "needs Parallel.pipeline_schedule='circular'" in _err(
        lambda: Parallel(pipeline_repeats=2))
    assert "Parallel.zero=2 is not one of 0, 1, 3" in _err(lambda: Parallel(zero=2))
    assert Parallel(zero=3, pipe=2).zero == 3  # FSDP x pipeline (tests/parallel/test_zero.py)
    assert "set Parallel.grad_accum instead" in _err(lambda: Parallel(microbatches=2))
    assert "Parallel.grad_accum=0 must be a positive integer" in _err(
        lambda: Parallel(grad_accum=0))
    assert "needs pipeline stages" in _err(
        lambda: Parallel(pipeline_schedule="circular", pipeline_repeats=2))
    assert "Parallel.tp_plan='megatron'" in _err(lambda: Parallel(tp_plan="megatron"))
    assert "Parallel.rmsnorm='local'" in _err(lambda: Parallel(rmsnorm="local"))
    assert "Parallel.norm_payload='int8'" in _err(lambda: Parallel(norm_payload="int8"))
    assert "Train.dtype='fp16'" in _err(lambda: Train(dtype="fp16"))
    assert "Train.warmup_steps=50" in _err(lambda: Train(steps=40, warmup_steps=50))
    assert Train(steps=40, schedule_steps=80, warmup_steps=50).horizon == 80
    assert "Data.eval_fraction" in _err(lambda: Data(eval_fraction=0.9))


def test_batch_must_divide_data():
    parse_gin(bindings=["Train.batch_size=10", "Parallel.data=4"])
    assert "Train.batch_size=10 is not divisible by Parallel.data=4" in _err(load_config)


@pytest.mark.parametrize("model, parallel, needle", [
    (dict(n_heads=4, n_kv_heads=4, d_model=64), dict(tensor=8, data=1, tp_plan="btp"),
     "Parallel.tensor=8 does not divide Model.n_heads=4"),
    (dict(n_kv_heads=2), dict(tensor=4, tp_plan="btp"),
     "Parallel.tensor=4 does not divide Model.n_kv_heads=2"),
    (dict(d_ff=178), dict(tensor=4, tp_plan="btp"), "does not divide Model.d_ff=178"),
    (dict(vocab_size=510), dict(tensor=4, tp_plan="btp"), "does not divide Model.vocab_size=510"),
    (dict(d_ff=178, arch="dense"), dict(tensor=4, tp_plan="fullrank"),
     "does not divide Model.d_ff=178"),
    (dict(rank=10), dict(tensor=4, tp_plan="vanilla"), "does not divide Model.attn_rank=10"),
    (dict(mlp_rank=18), dict(tensor=4, tp_plan="vanilla"), "does not divide Model.mlp_rank=18"),
    (dict(arch="cola"), dict(tensor=4, tp_plan="fullrank"),
     "Parallel.tp_plan='fullrank' runs Model.arch in dense, not 'cola'"),
    (dict(arch="dense"), dict(tensor=4, tp_plan="btp"), "use 'fullrank' for dense"),
    (dict(arch="dense"), dict(tensor=4, tp_plan="vanilla"), "use 'fullrank' for dense"),
])
def test_bad_tensor_parallel_layouts(model, parallel, needle):
    from boost_jax.config import Config

    m = Model(size="tiny", **model)
    assert needle in _err(lambda: Config(m, Parallel(**parallel), Train(), Data()))


@pytest.mark.parametrize("parallel, model, needle", [
    (dict(pipe=2, tensor=1, tp_plan="none", data=1), dict(n_layers=3),
     "Model.n_layers=3 is not divisible by Parallel.pipe x pipeline_repeats = 2"),
    (dict(pipe=2, tensor=1, tp_plan="none", data=1, pipeline_schedule="circular",
          pipeline_repeats=2, microbatches=2), dict(n_layers=6),
     "Model.n_layers=6 is not divisible by Parallel.pipe x pipeline_repeats = 4"),
    (dict(pipe=2, tensor=1, tp_plan="none", data=2, microbatches=3), {},
     "Parallel.microbatches=3 does not divide the batch of a data shard"),
    (dict(pipe=2, tensor=1, tp_plan="none", data=2, microbatches=4, grad_accum=2), {},
     "Parallel.microbatches=4 does not divide the batch of a data shard's pipeline pass"),
    (dict(tensor=1, tp_plan="none", data=2, grad_accum=3), {},
     "Parallel.grad_accum=3 does not divide the batch of a data shard"),
    (dict(pipe=4, tensor=1, tp_plan="none", data=1, pipeline_schedule="circular",
          pipeline_repeats=2, microbatches=2), dict(n_layers=8),
     "needs Parallel.microbatches >= Parallel.pipe"),
    (dict(pipe=2, tensor=1, tp_plan="none", data=1), dict(arch="lax"),
     "Model.arch='lax' is not supported with pipeline parallelism"),
])
def test_bad_pipeline_layouts(parallel, model, needle):
    from boost_jax.config import Config

    cfg = lambda: Config(Model(size="tiny", **model), Parallel(**parallel),  # noqa: E731
                         Train(batch_size=8), Data())
    assert needle in _err(cfg)


def test_pipe_must_divide_a_pass_tokens():
    """Each stage embeds and runs the head on 1/pipe of a pipeline pass's tokens."""
    from boost_jax.config import Config

    parallel = Parallel(pipe=2, tensor=1, tp_plan="none", data=8)  # one row of 7 tokens
    assert "Parallel.pipe=2 does not divide the 7 tokens" in _err(
        lambda: Config(Model(size="tiny"), parallel, Train(batch_size=8, seq_len=7), Data()))
    Config(Model(size="tiny"), parallel, Train(batch_size=8, seq_len=8), Data())


def test_unknown_gin_binding():
    assert "Model' doesn't have a parameter named 'depth'" in _err(
        lambda: parse_gin(bindings=["Model.depth=3"]))
    assert "No configurable matching 'Modle'" in _err(lambda: parse_gin(bindings=["Modle.arch=1"]))
    assert "gin file 'no/such/file.gin' not found (looked in ., configs)" == _err(
        lambda: parse_gin(files=["no/such/file.gin"], search_paths=["configs"]))


def test_a_misspelt_binding_gets_the_names_it_may_mean():
    """Issue 49: gin's error about an unknown group or field ends with the closest names (or
    where every binding is listed). Seen failing on the old parse_gin (gin's text alone)."""
    assert _err(lambda: parse_gin(bindings=["Modle.arch=1"])).endswith(" Did you mean Model?")
    assert _err(lambda: parse_gin(bindings=["Train.stpes=3"])).endswith(
        " Did you mean Train.steps?")
    assert _err(lambda: parse_gin(bindings=["Parallel.tensr=2"])).endswith(
        " Did you mean Parallel.tensor?")
    assert _err(lambda: parse_gin(bindings=["Train.zzzz=3"])).endswith(
        " python -m boost_jax.train --print_config lists every binding.")


def test_gin_files_are_found_under_the_search_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.gin").write_text("Train.steps = 11\n")
    parse_gin(files=["sub/x.gin"], search_paths=[str(tmp_path)])
    assert load_config().train.steps == 11


def test_gin_bindings_reach_config():
    parse_gin(bindings=["Model.arch='svd'", "Model.size='tiny'", "Train.steps=7",
                        "Parallel.data=2"])
    cfg = load_config()
    assert (cfg.model.arch, cfg.model.d_model, cfg.train.steps, cfg.parallel.data) == \
        ("svd", 64, 7, 2)
