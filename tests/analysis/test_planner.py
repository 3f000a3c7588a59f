"""The auto-planner: every layout it returns is a valid config that fits its budget, ranked by
predicted time; it is at least as fast as the paper's layouts; and what it returns fits in the
compiled step's memory."""

import dataclasses

import gin
import pytest

from boost_jax.analysis.hardware import PROFILES
from boost_jax.analysis.paper import ARCHITECTURES, WEAK_SCALING, configs
from boost_jax.analysis.planner import Problem, candidates, emit_gin, evaluate, plan
from boost_jax.compiled import plan_verify
from boost_jax.config import Config, Data, Model, Parallel, Train
from boost_jax.gin_io import load_config, parse_gin
from boost_jax.testing import tiny

A100 = PROFILES["a100_80gb_4gpu"]


def _problem(size="13b", arch="cola", gpus=8, batch=4, seq=4096, **kw) -> Problem:
    return Problem(Model(arch=arch, size=size), gpus, batch, seq, A100, **kw)


def test_every_layout_is_a_valid_config_within_budget_ranked_fastest_first():
    problem = _problem()
    result = plan(problem)
    assert result.seconds < 30 and result.layouts and result.over_memory
    # FSDP x pipeline is a layout like the others (every enumerated candidate is valid here)
    assert any(lay.parallel.zero == 3 and lay.parallel.pipe > 1
               for lay in result.layouts + result.over_memory)
    train = Train(batch_size=4, seq_len=4096, dtype="bfloat16")
    for lay in result.layouts:
        Config(problem.model, lay.parallel, train, Data())  # raises if invalid
        assert lay.parallel.num_devices == 8 and lay.parallel.tensor <= 4
        assert lay.memory == sum(lay.prediction.memory.values())
        assert lay.memory * (1 + problem.headroom) <= problem.budget
    times = [round(lay.step_s, 9) for lay in result.layouts]  # ties: less memory first
    assert times == sorted(times)
    assert all(lay.memory * (1 + problem.headroom) > problem.budget
               for lay in result.over_memory)
    best = result.layouts[0]
    assert best.tokens_per_s == pytest.approx(4 * 4096 / best.step_s)
    assert 0 < best.mfu(A100) < 1 and best.binding
    # enumerated = invalid + predicted: nothing silently dropped
    assert result.enumerated == (sum(result.invalid.values()) + len(result.layouts)
                                 + len(result.over_memory))


def test_the_enumeration_follows_arch_node_and_zero_rules():
    dense = list(candidates(_problem(arch="dense", gpus=16)))
    assert {c["tp_plan"] for c in dense} == {"none", "fullrank"}
    assert max(c["tensor"] for c in dense) == 4  # inside a 4-GPU node
    assert {c["remat"] for c in dense} == {"none", "full"}
    wide = list(candidates(_problem(arch="dense", gpus=16, cross_node_tensor=True)))
    assert max(c["tensor"] for c in wide) == 16
    low = list(candidates(_problem(gpus=4)))
    assert {c["tp_plan"] for c in low if c["tensor"] > 1} == {"btp", "vanilla"}
    assert all(c["zero"] == 0 for c in low if c["data"] == 1)
    assert {c.get("pipeline_schedule", "gpipe") for c in low} == {"gpipe", "circular"}


@pytest.mark.parametrize("row", WEAK_SCALING + ARCHITECTURES, ids=lambda r: r.name)
@pytest.mark.parametrize("method", ["boost", "fullrank"])
def test_the_planner_is_at_least_as_fast_as_the_papers_layout(row, method):
    model, paper = configs(row, method)
    problem = Problem(model, row.gpus, row.batch, 4096, A100, gpus_per_node=4)
    result = plan(problem)
    paper_layout = evaluate(problem, paper)
    best = result.layouts[0].step_s
    if paper_layout.memory * (1 + problem.headroom) <= problem.budget:
        assert best <= paper_layout.step_s * (1 + 1e-9)
    else:  # pruned (no memory headroom): 1B full rank is the one row where that costs time
        assert best <= paper_layout.step_s * (1.01 if (row.name, method) == ("1B TP1",
                                                                             "fullrank") else 1)


def test_memory_bound_layouts_say_so_and_emit_gin_round_trips():
    problem = _problem()
    result = plan(problem)
    assert any(lay.binding.startswith("memory ") for lay in result.layouts)
    text = emit_gin(result.layouts[0], problem)
    gin.clear_config()
    parse_gin(bindings=[line for line in text.splitlines() if not line.startswith("#")])
    config = load_config()
    assert config.parallel == result.layouts[0].parallel
    assert (config.model, config.train.batch_size, config.train.seq_len) == (
        problem.model, 4, 4096)


def test_no_layout_fits_a_too_small_device():
    small = dataclasses.replace(A100, hbm_bytes=1e9)
    result = plan(Problem(Model(size="7b"), 4, 4, 4096, small))
    assert not result.layouts and result.over_memory


def _budgeted(arch: str, devices: int) -> Problem:
    """A tiny problem whose budget is the median layout's memory: the lean half fits."""
    base = Problem(tiny(arch), devices, 16, 32, A100, dtype="float32", flash_attention=False)
    mems = sorted(lay.memory for lay in plan(base).layouts)
    hw = dataclasses.replace(A100, hbm_bytes=mems[len(mems) // 2] / base.memory_fraction)
    return dataclasses.replace(base, hardware=hw)


def _check_within_budget(problem: Problem, top: int):
    import jax

    result = plan(problem)
    assert result.over_memory, "the budget prunes nothing"
    for lay in result.layouts[:top]:
        check = plan_verify.check_layout(problem, lay, jax.devices())
        assert check["compiled_memory_mib"] * 2**20 <= problem.budget, check
        assert abs(check["memory_error"]) <= plan_verify.TOLERANCE, check
        assert not check["flags"], check


def test_returned_layouts_fit_in_the_compiled_memory():
    """The pin: the planner's best layout's compiled peak (CPU, small shapes) is within the
    budget, and the model's memory within 15 % of it."""
    _check_within_budget(_budgeted("cola", 2), top=1)


@pytest.mark.slow
@pytest.mark.parametrize("arch, devices", [("cola", 8), ("dense", 8), ("svd", 4)])
def test_returned_layouts_fit_in_the_compiled_memory_more(arch, devices):
    _check_within_budget(_budgeted(arch, devices), top=3)


@pytest.mark.slow
def test_verify_agrees_on_the_small_shapes_of_13b():
    checks = plan_verify.verify(_problem(), top=3)
    assert len(checks) == 3
    for c in checks:
        assert not c["flags"], c


def test_small_model_keeps_the_architecture():
    m = plan_verify.small_model(Model(arch="lax", size="13b"))
    assert (m.arch, m.d_model, m.n_layers) == ("lax", 256, 4)
    assert plan_verify.small_model(tiny("svd")) == tiny("svd")
    assert Parallel  # the layouts are real Parallel objects


def test_the_paper_layouts_beside_the_planners_choice():
    """``plan --paper`` (docs/guides/plan.md's table): on one GPU the 1B BOOST layout of the
    paper is the planner's choice; the full-rank one is over the budget with its headroom, so
    the planner accumulates instead, a little slower."""
    from boost_jax.analysis.paper import compare_with_planner
    from boost_jax.commands.plan import format_paper

    boost, full = compare_with_planner(WEAK_SCALING[:1], A100)
    assert boost["choice"].describe() == boost["paper"].describe() and not boost["over"]
    assert full["over"] and full["choice"].parallel.grad_accum == 2
    assert full["choice"].step_s > full["paper"].step_s
    table = format_paper([boost, full]).splitlines()
    assert len(table) == 4 and table[2].startswith("| 1B TP1 | boost | data=1 pipe=1")
