"""The data-parallel layouts (``Parallel.zero`` 0 / 1 / 3) and gradient accumulation: the train
step's gradients equal the single-device model's, the state is split as promised, and every
data-axis collective of the compiled step is the one analysis/comm.py predicts."""

import collections
import functools

import jax
import jax.numpy as jnp
import pytest

from boost_jax.analysis.hlo import collectives, users
from boost_jax.compiled.step_report import build_report, compile_step
from boost_jax.config import Config, Data, Parallel, Train
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import SINGLE, loss_and_grads, rel_err, tiny, tree_rel_err

BATCH, SEQ = 8, 16


@functools.cache
def _problem(arch):
    model = tiny(arch)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, model.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, model.vocab_size)
    return model, params, inputs, targets, loss_and_grads(model, SINGLE, params, inputs, targets)


@pytest.mark.parametrize("arch, options", [
    ("cola", dict(zero=1)),
    pytest.param("cola", dict(zero=3, grad_accum=2), marks=pytest.mark.jax_sensitive),
    ("lax", dict(zero=3, remat="lowrank")),
    pytest.param("cola", dict(tp_plan="vanilla", zero=3), marks=pytest.mark.slow),
    pytest.param("dense", dict(tp_plan="fullrank", zero=1, grad_accum=2),
                 marks=pytest.mark.slow),
], ids=str)
def test_zero_stages_match_single_device(arch, options):
    """The step's gradients (reduce-scattered slices under ZeRO, as the optimizer sees them)
    equal the single-device model's."""
    model, params, inputs, targets, (ref_loss, ref_grads) = _problem(arch)
    parallel = Parallel(**{"data": 2, "tensor": 4, "tp_plan": "btp", **options})
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert tree_rel_err(grads, ref_grads) <= 1e-5


def _state_bytes(parallel, part):
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import init_state

    model = ShardedModel(tiny("cola"), parallel, make_mesh(parallel))
    state = init_state(model, make_optimizer(Train()), seed=0)[part]
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(state))


@pytest.mark.jax_sensitive
def test_zero1_splits_the_optimizer_state_and_fsdp_the_parameters():
    """Per device: ZeRO-1 holds 1/data of the moments; FSDP 1/(data x tensor) of the
    parameters (a few small leaves with no dimension divisible by data stay whole)."""
    dp = dict(data=8, tensor=1, tp_plan="none")
    assert _state_bytes(Parallel(**dp, zero=1), "opt_state") <= \
        _state_bytes(Parallel(**dp), "opt_state") / 8 * 1.05
    whole = sum(jnp.dtype(jnp.float32).itemsize * jax.numpy.size(p) for p in
                jax.tree.leaves(_problem("cola")[1]))
    fsdp = _state_bytes(Parallel(data=2, tensor=4, zero=3), "params")
    assert fsdp <= whole / 8 * 1.05
    assert _state_bytes(Parallel(data=2, tensor=4, zero=1), "params") >= whole / 4 * 0.95


@functools.cache
def _compiled(zero, grad_accum):
    parallel = Parallel(data=2, tensor=4, zero=zero, grad_accum=grad_accum)
    config = Config(tiny("cola"), parallel, Train(batch_size=BATCH, seq_len=SEQ), Data())
    model, _, compiled = compile_step(config)
    return build_report(config, compiled=compiled, mesh=model.mesh), compiled.as_text()


def _report(zero, grad_accum):
    return _compiled(zero, grad_accum)[0]


@pytest.mark.parametrize("zero, grad_accum", [
    (0, 1), (0, 2), (1, 1), pytest.param(1, 2, marks=pytest.mark.jax_sensitive),
    pytest.param(3, 1, marks=pytest.mark.jax_sensitive), (3, 2)])
def test_data_axis_traffic_is_the_formula(zero, grad_accum):
    """comm_report --check: every collective of the step (tensor, data, the scalars) equals
    the analytic formula, for each zero stage with and without accumulation."""
    rep = _report(zero, grad_accum)
    assert rep["check"] == []
    assert rep["measured"]["steps"]["data"] > 0


def test_zero1_sends_one_all_reduce_worth():
    """ZeRO-1's reduce-scatter + all-gather put what the all-reduce did on the wire, and only
    on ``data`` (the tensor axis is untouched)."""
    plain, zero1 = _report(0, 1), _report(1, 1)
    assert zero1["per_axis"]["data"]["wire_bytes"] == plain["per_axis"]["data"]["wire_bytes"]
    assert zero1["per_axis"]["tensor"] == plain["per_axis"]["tensor"]
    ops = {(r["op"], r["where"]) for r in zero1["collectives"] if r["axes"] == "data"}
    assert ops >= {("reduce-scatter", "layer"), ("all-gather", "optimizer")}


def test_accumulation_reduces_over_data_once():
    """K micro-steps, one gradient reduction: the data-axis bytes of K=2 are those of K=1
    (whose layers are reduced one by one in the loop: more collectives, the same bytes)."""
    once, per_layer = _report(0, 2)["per_axis"]["data"], _report(0, 1)["per_axis"]["data"]
    for key in ("elements", "bytes", "wire_bytes"):
        assert once[key] == per_layer[key]


def _data_reductions(rep):
    return [r for r in rep["collectives"] if r["axes"] == "data"
            and r["op"] in ("all-reduce", "reduce-scatter") and r["shape"] != []]


@pytest.mark.parametrize("zero", [0, 1])
def test_layer_gradients_are_reduced_inside_the_backward_loop(zero):
    """Without accumulation each layer's gradient is reduced over data in the backward layer
    loop (all-reduce at stage 0, reduce-scatter at 1), once per layer, and those collectives
    carry exactly the layer parameters (the embedding, head and norms after the loop)."""
    from boost_jax.analysis.comm import local_parameters

    rep, n_layers = _report(zero, 1), tiny("cola").n_layers
    op = "all-reduce" if zero == 0 else "reduce-scatter"
    looped = [r for r in _data_reductions(rep) if r["where"] == "layer"]
    assert looped and {(r["op"], r["direction"], r["runs"]) for r in looped} == {
        (op, "bwd", n_layers)}
    parallel = Parallel(data=2, tensor=4, zero=zero)
    layer_elements = sum(r["bytes"] // 4 * r["runs"] * r["instances"] for r in looped)
    assert layer_elements == local_parameters(tiny("cola"), parallel)[0]
    after = [r for r in _data_reductions(rep) if r["where"] != "layer"]
    assert after and all(r["runs"] == 1 for r in after)


@pytest.mark.parametrize("zero", [0, 1])
def test_accumulated_gradients_are_reduced_after_the_loop(zero):
    """With accumulation a layer's gradient is a sum over micro-steps: no data reduction in
    any loop, each gradient reduced once, by the optimizer."""
    reductions = _data_reductions(_report(zero, 2))
    assert reductions and {(r["where"], r["runs"]) for r in reductions} == {("optimizer", 1)}


@pytest.mark.parametrize("zero", [0, 1])
def test_layer_reductions_are_off_the_critical_path(zero):
    """Each in-loop reduction only feeds the stacked gradient buffer the loop writes out (as
    FSDP's reduce-scatters do): the next layer's backward does not wait on it."""
    op = "all-reduce" if zero == 0 else "reduce-scatter"
    hlo = _compiled(zero, 1)[1]
    over_data = {c.name: c for c in collectives(hlo, (2, 1, 4), ("data", "pipe", "tensor"))
                 if c.axes == ("data",) and c.trips}
    found = {name: readers for name, readers in users(hlo, op).items() if name in over_data}
    assert sum(over_data[name].combined for name in found) >= 10  # the tiny CoLA block has 11
    for name, readers in found.items():
        assert readers and all("dynamic-update-slice" in r for r in readers), (name, readers)


def test_fsdp_reduce_scatters_each_layer_inside_the_backward_loop():
    """FSDP: each layer's gradients are reduce-scattered in the backward layer loop (one per
    parameter per layer), gathered in the forward one and again by the recomputation."""
    rep = _report(3, 1)
    # in the layer loop, or in the pipeline loop where a stage's group is one layer
    layer = [r for r in rep["collectives"] if r["axes"] == "data" and r["where"] != "optimizer"]
    n_layers = tiny("cola").n_layers
    scatters = [r for r in layer if r["op"] == "reduce-scatter"]
    gathers = [r for r in layer if r["op"] == "all-gather"]
    assert scatters and all(r["direction"] == "bwd" and r["runs"] == n_layers
                            for r in scatters)
    assert sum(r["instances"] for r in gathers) == 2 * sum(r["instances"] for r in scatters)
    assert {r["direction"] for r in gathers} == {"fwd", "bwd"}


def test_fsdp_layer_reductions_are_off_the_critical_path():
    """In the backward layer loop, each layer's reduce-scatter only feeds the stacked gradient
    buffer the loop writes out: nothing the next layer's backward computes waits on it, so a
    GPU's latency-hiding scheduler can run it under that compute."""
    found = users(_compiled(3, 1)[1], "reduce-scatter")
    assert len(found) >= 10  # one per layer parameter (the tiny CoLA block has 11)
    for name, readers in found.items():
        assert readers and all("dynamic-update-slice" in r for r in readers), (name, readers)


# --- FSDP x pipeline parallelism -----------------------------------------------------------
FSDP_PP = dict(data=2, pipe=2, tensor=2, tp_plan="btp", zero=3)


@functools.cache
def _fsdp_pp_report(schedule, repeats, microbatches):
    parallel = Parallel(**FSDP_PP, pipeline_schedule=schedule, pipeline_repeats=repeats,
                        microbatches=microbatches)
    config = Config(tiny("cola", n_layers=4), parallel, Train(batch_size=BATCH, seq_len=SEQ),
                    Data())
    return build_report(config)


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2)])
def test_fsdp_with_pipeline_matches_single_device(schedule, repeats):
    """PP2 x DP2 x TP2 with each stage's parameters split over data: the loss and every
    gradient (reduce-scattered shards, as the optimizer sees them) of the single device."""
    model = tiny("cola", n_layers=4)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    _, _, inputs, targets, _ = _problem("cola")
    ref_loss, ref_grads = loss_and_grads(model, SINGLE, params, inputs, targets)
    parallel = Parallel(**FSDP_PP, pipeline_schedule=schedule, pipeline_repeats=repeats,
                        microbatches=2)
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert tree_rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2)])
def test_fsdp_with_pipeline_gathers_per_layer_in_the_stage_loop(schedule, repeats):
    """Each layer's parameters are all-gathered over data inside the stage's layer loop, in
    every pipeline iteration that runs it (forward, and again by the recomputation) and its
    gradient reduce-scattered there: (R M + S - 1) / R times the stage's parameters per step
    each, as analysis/comm.py predicts (comm_report --check clean)."""
    from boost_jax.analysis.comm import local_parameters

    rep = _fsdp_pp_report(schedule, repeats, 2)
    assert rep["check"] == []
    # in the layer loop, or in the pipeline loop where a stage's group is one layer
    layer = [r for r in rep["collectives"] if r["axes"] == "data" and r["where"] != "optimizer"]
    iterations = repeats * 2 + 2 - 1
    runs = iterations * 4 // (2 * repeats)  # iterations x layers per stage and repeat
    assert layer and {r["runs"] for r in layer} == {runs}
    stage_params = local_parameters(tiny("cola", n_layers=4), Parallel(**FSDP_PP))[0]
    moved = collections.Counter()
    for r in layer:
        moved[r["op"], r["direction"]] += r["bytes"] // 4 * r["runs"] * r["instances"]
    per_step = iterations * stage_params // repeats
    assert moved == {("all-gather", "fwd"): per_step, ("all-gather", "bwd"): per_step,
                     ("reduce-scatter", "bwd"): per_step}


# --- zero 0/1 under a pipeline ---------------------------------------------------------------
PP = dict(data=2, pipe=2, tensor=2, tp_plan="btp")


@functools.cache
def _pp_compiled(zero, schedule, repeats):
    parallel = Parallel(**PP, zero=zero, pipeline_schedule=schedule, pipeline_repeats=repeats,
                        microbatches=2)
    config = Config(tiny("cola", n_layers=4), parallel, Train(batch_size=BATCH, seq_len=SEQ),
                    Data())
    model, _, compiled = compile_step(config)
    return build_report(config, compiled=compiled, mesh=model.mesh), compiled.as_text()


def _pp_report(zero, schedule, repeats):
    return _pp_compiled(zero, schedule, repeats)[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_pipelined_layer_reductions_match_single_device(zero):
    """GPipe PP2 x DP2 x TP2, each layer's gradient reduced in the pipeline's last backward
    iteration: the loss and every gradient of the single device."""
    model = tiny("cola", n_layers=4)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    _, _, inputs, targets, _ = _problem("cola")
    ref_loss, ref_grads = loss_and_grads(model, SINGLE, params, inputs, targets)
    parallel = Parallel(**PP, zero=zero, microbatches=2)
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert tree_rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("zero", [0, 1])
def test_pipelined_layer_gradients_are_reduced_once_inside_the_backward_loop(zero):
    """GPipe without accumulation: each layer's gradient is reduced over data once per step
    (not once per microbatch), inside the backward layer loop of the pipeline's first
    iteration, the last one the backward pass runs; those reductions carry exactly the
    stage's layer parameters, and comm_report --check is clean."""
    from boost_jax.analysis.comm import local_parameters

    rep = _pp_report(zero, "gpipe", 1)
    assert rep["check"] == []
    op = "all-reduce" if zero == 0 else "reduce-scatter"
    looped = [r for r in _data_reductions(rep) if r["where"] == "layer"]
    layers_per_stage = 4 // 2
    assert looped and {(r["op"], r["direction"], r["runs"]) for r in looped} == {
        (op, "bwd", layers_per_stage)}
    stage_params = local_parameters(tiny("cola", n_layers=4), Parallel(**PP, zero=zero))[0]
    assert sum(r["bytes"] // 4 * r["runs"] * r["instances"] for r in looped) == stage_params
    # the embedding, head and norms (replicated over pipe too): once, after the loop
    after = [r for r in rep["collectives"] if "data" in r["axes"].split(",")
             and r["op"] in ("all-reduce", "reduce-scatter") and r["shape"] != []
             and r["where"] != "layer"]
    assert after and all(r["runs"] == 1 for r in after)
    # off the critical path: each feeds only the gradient buffer the layer loop writes out
    hlo = _pp_compiled(zero, "gpipe", 1)[1]
    over_data = {c.name for c in collectives(hlo, (2, 2, 2), ("data", "pipe", "tensor"))
                 if c.axes == ("data",) and c.trips}
    found = {name: readers for name, readers in users(hlo, op).items() if name in over_data}
    assert found
    for name, readers in found.items():
        assert readers and all("dynamic-update-slice" in r for r in readers), (name, readers)


def test_circular_schedule_reduces_after_the_loop():
    """The circular schedule (a stage's layer groups last used in different iterations)
    reduces each gradient once, after the pipeline loop."""
    reductions = _data_reductions(_pp_report(1, "circular", 2))
    assert reductions and {(r["where"], r["runs"]) for r in reductions} == {("optimizer", 1)}
