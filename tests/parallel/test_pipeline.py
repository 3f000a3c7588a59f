"""Pipeline parallelism (GPipe, circular) x data x tensor parallelism against the single-device
model: loss and every gradient; what crosses the pipe axis."""

import functools
import math

import jax
import pytest

from boost_jax.analysis import hlo
from boost_jax.compiled.step_report import build_report, compile_step
from boost_jax.config import Config, Data, Parallel, Train
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import SINGLE, loss_and_grads, rel_err, tiny, tree_rel_err

PLANS = {"cola": "btp", "dense": "fullrank"}


@functools.cache
def _reference(arch):
    model = tiny(arch, n_layers=4)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs = jax.random.randint(jax.random.key(1), (8, 16), 0, model.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (8, 16), 0, model.vocab_size)
    return model, params, inputs, targets, loss_and_grads(model, SINGLE, params, inputs, targets)


def _check(arch, mesh, schedule, repeats, microbatches, remat="none", **options):
    model, params, inputs, targets, (ref_loss, ref_grads) = _reference(arch)
    data, pipe, tensor = mesh
    parallel = Parallel(data=data, pipe=pipe, tensor=tensor, tp_plan=PLANS[arch],
                        pipeline_schedule=schedule, pipeline_repeats=repeats,
                        microbatches=microbatches, remat=remat, **options)
    loss, grads = loss_and_grads(model, parallel, params, inputs, targets)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert tree_rel_err(grads, ref_grads) <= 1e-5


def _cases():  # (data, pipe, tensor), schedule, repeats, microbatches; tiny has 4 layers
    for mesh in [(2, 2, 2), (1, 4, 2)]:
        for m in (1, 2, 4):
            yield mesh, "gpipe", 1, m
        repeats = 4 // mesh[1]
        for m in (2, 4) if repeats > 1 else (4,):
            if m >= mesh[1]:
                yield mesh, "circular", repeats, m


CASES = [(arch, *case) for arch in PLANS for case in _cases()]
DEFAULT = [("cola", (2, 2, 2), "gpipe", 1, 2), ("cola", (1, 4, 2), "gpipe", 1, 4),
           ("cola", (2, 2, 2), "circular", 2, 2), ("cola", (1, 4, 2), "gpipe", 1, 1),
           ("dense", (2, 2, 2), "gpipe", 1, 4), ("dense", (1, 4, 2), "circular", 1, 4),
           ("dense", (2, 2, 2), "circular", 2, 4)]


@pytest.mark.parametrize("arch, mesh, schedule, repeats, microbatches", DEFAULT)
def test_pipeline_matches_single_device(arch, mesh, schedule, repeats, microbatches):
    _check(arch, mesh, schedule, repeats, microbatches)


@pytest.mark.parametrize("remat", ["lowrank", "full"])
def test_remat_inside_stages(remat):
    _check("cola", (2, 2, 2), "circular", 2, 2, remat)


def test_pipeline_with_zero1_and_accumulation():
    """Two accumulated pipeline passes, gradients reduce-scattered over data (and the
    embedding's all-reduced over pipe) -- still the single-device gradients."""
    _check("cola", (2, 2, 2), "gpipe", 1, 2, zero=1, grad_accum=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch, mesh, schedule, repeats, microbatches", CASES)
def test_pipeline_full_matrix(arch, mesh, schedule, repeats, microbatches):
    _check(arch, mesh, schedule, repeats, microbatches)


@functools.cache
def _compiled(arch, **parallel):
    """``(config, mesh, compiled train step)`` of the tiny 4-layer model, batch 8 x 16."""
    config = Config(tiny(arch, n_layers=4), Parallel(**parallel),
                    Train(batch_size=8, seq_len=16), Data())
    model, _, compiled = compile_step(config)
    return config, model.mesh, compiled


@functools.cache
def _report(arch, **parallel):
    config, mesh, compiled = _compiled(arch, **parallel)
    return build_report(config, compiled=compiled, mesh=mesh)


@pytest.mark.parametrize("arch", list(PLANS))
def test_pipe_axis_moves_the_residual_shard(arch):
    """One permute per iteration each way, of a microbatch's residual: T d / p under btp."""
    m = tiny(arch)
    rep = _report(arch, data=2, pipe=2, tensor=2, tp_plan=PLANS[arch], microbatches=2)
    assert rep["check"] == []
    permutes = [r for r in rep["collectives"] if r["op"] == "collective-permute"]
    assert {r["axes"] for r in permutes} == {"pipe"}
    tokens = 8 // 2 // 2 * 16  # per microbatch
    d_local = m.d_model // 2 if arch == "cola" else m.d_model
    assert {tuple(r["shape"]) for r in permutes} == {(8 // 2 // 2, 16, d_local)}
    assert {r["bytes"] for r in permutes} == {tokens * d_local * 4}
    iterations = 2 + 2 - 1
    assert sum(r["runs"] * r["instances"] for r in permutes) == 2 * iterations


def test_stages_share_the_embedding_and_the_head():
    """Each of the S stages embeds, normalises and runs the head and the loss on its 1/S of a
    data shard's T tokens: the head's dots (forward, and the backward pass's two) process T/S
    tokens per device -- over the stages the head runs once -- and so do the tensor-axis
    boundary collectives, while the pipe axis carries the all-gather of the embedded chunks
    and the reduce-scatter of the final residuals (and their transposes) with the predicted
    bytes (the report's check is clean)."""
    m = tiny("cola")
    options = dict(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=2)
    rep = _report("cola", **options)  # the compile of test_pipe_axis_moves_the_residual_shard
    assert rep["check"] == []
    tokens, stages = 8 // 2 * 16, 2
    chunk, vocab, d_local = tokens // stages, m.vocab_size // 2, m.d_model // 2
    # models/boundaries.py head_logits: the forward einsum and its custom VJP's two
    specs = ("bsd,dv->bsv", "bsv,dv->bsd", "bsd,bsv->dv")
    head = [x for x in hlo.dots(_compiled("cola", **options)[2].as_text())
            if any(spec in x.op_name for spec in specs)]
    assert [math.prod(x.shape) for x in head if specs[0] in x.op_name] == [chunk * vocab]
    assert sum(x.flops for x in head) == 3 * 2 * chunk * m.d_model * vocab
    step = [r for r in rep["collectives"] if r["where"] == "step"
            and r["op"] != "collective-permute"]
    assert {tuple(r["shape"][:2]) for r in step if r["axes"] == "tensor"} == {(1, chunk)}
    pipe = sorted((r["op"], r["direction"], tuple(r["shape"]), r["bytes"])
                  for r in step if r["axes"] == "pipe" for _ in range(r["instances"]))
    gathered, scattered = (1, tokens, d_local), (1, chunk, d_local)
    assert pipe == sorted((op, way, shape, tokens * d_local * 4) for way in ("fwd", "bwd")
                          for op, shape in (("all-gather", gathered),
                                            ("reduce-scatter", scattered)))


@pytest.mark.parametrize("layout", [
    {}, {"zero": 3}, {"pipeline_schedule": "circular", "pipeline_repeats": 2}],
    ids=["gpipe", "fsdp", "circular"])
def test_stage_parameters_are_not_kept_per_iteration(layout):
    """``full`` remat: two more pipeline iterations (microbatches 2 -> 4) add less compiled
    temporary memory than one copy of the stage's parameters (FSDP: of its ``1 / data``
    shard) -- the stage's layers are not kept for the backward pass once per iteration.
    GPipe uses the stage's layers as they are (the slice it took in every iteration held
    19 GiB per device at the paper's 30B TP4xPP4 shape, ``bench memory``). The circular
    schedule and FSDP take repeat ``rep``'s layers in every iteration, each layer sliced inside
    its checkpointed block (``Decoder.run_blocks``' ``repeat``); the circular schedule's slice
    taken in the iteration kept +521 KB for two more iterations here, against a 361 KB
    stage."""
    from boost_jax.analysis.comm import local_parameters
    from boost_jax.compiled.step_report import compile_step

    model = tiny("cola", n_layers=4, d_model=128, d_ff=512)  # parameters outweigh activations
    temp = {}
    for m in (2, 4):
        parallel = Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=m,
                            remat="full", **layout)
        config = Config(model, parallel, Train(batch_size=8, seq_len=16), Data())
        temp[m] = compile_step(config)[2].memory_analysis().temp_size_in_bytes
    stage_bytes = 4 * local_parameters(model, parallel)[0]
    if layout.get("zero") == 3:
        stage_bytes //= parallel.data  # FSDP's stage: its 1 / data shard of the layers
    assert temp[4] - temp[2] < stage_bytes, (temp, stage_bytes)


def test_fsdp_under_a_pipeline_holds_less_than_without_it():
    """FSDP (``zero=3``) under GPipe holds less per device (arguments + outputs + temporaries
    of the compiled step) than the same layout without it (``zero=1``, which keeps the fp32
    parameters whole): its layers are gathered inside the layer loop and sliced inside each
    checkpointed block, never kept per pipeline iteration. A shape whose stage parameters
    outweigh its activations, with 9 iterations (8 microbatches, 2 stages): slicing the
    sharded stage in the iteration (kept for the backward pass once per iteration) held 13.5
    MB here against ZeRO 1's 10.8 MB (6.4 MB now); at the paper's 30B TP4xPP4 row compiled for
    A100s, 20.4 GiB against 15.1 GiB without FSDP (docs/BENCHMARKS.md)."""
    from boost_jax.compiled.plan_verify import compiled_memory
    from boost_jax.compiled.step_report import compile_step

    model = tiny("cola", n_layers=4, d_model=256, d_ff=1024)
    held = {}
    for zero in (1, 3):
        parallel = Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=8,
                            remat="full", zero=zero)
        config = Config(model, parallel, Train(batch_size=16, seq_len=16), Data())
        held[zero] = compiled_memory(compile_step(config)[2])
    assert held[3] < held[1], held
