"""The performance model: its communication is what the compiled step sends, its FLOPs are the
analytic count, its structure follows the plan, and it reproduces the paper's rows."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from boost_jax.analysis.comm import layer_collectives
from boost_jax.analysis.flops import train_flops_per_token
from boost_jax.analysis.hardware import PROFILES
from boost_jax.analysis.paper import ARCHITECTURES, WEAK_SCALING, compare
from boost_jax.analysis.perf_model import Efficiency, data_parallel_time, predict
from boost_jax.compiled.step_report import build_report
from boost_jax.config import Config, Data, Model, Parallel, Train
from boost_jax.testing import tiny

PLANS = [("dense", "fullrank"), ("cola", "vanilla"), ("cola", "btp")]
BATCH, SEQ = 8, 16
H100 = PROFILES["h100_sxm"]


#: a covering set (every plan, every mesh: TP=2, TP=4, TP=2 x PP=2; btp on each); the other
#: plan and mesh pairs, and TP=4 x PP=2, run with -m slow
COVERING = {("cola", "btp", 2, 1), ("cola", "btp", 4, 1), ("cola", "btp", 2, 2),
            ("cola", "vanilla", 2, 1), ("dense", "fullrank", 2, 2)}


@pytest.mark.parametrize("arch, plan, tensor, pipe", [
    pytest.param(*case, marks=[] if case in COVERING else [pytest.mark.slow])
    for case in ((arch, plan, tensor, pipe) for tensor, pipe in ((2, 1), (4, 1), (2, 2), (4, 2))
                 for arch, plan in PLANS)])
def test_predicted_communication_is_what_the_compiled_step_sends(arch, plan, tensor, pipe):
    """Per step and mesh axes (tensor, pipe, data), and per layer and token where the layers
    are a loop: the model's volumes equal the collectives read from the compiled HLO."""
    model = tiny(arch, n_layers=2 * pipe)
    parallel = Parallel(data=8 // (tensor * pipe), tensor=tensor, pipe=pipe, tp_plan=plan,
                        microbatches=pipe)
    rep = build_report(Config(model, parallel, Train(batch_size=BATCH, seq_len=SEQ), Data()))
    pred = predict(model, parallel, BATCH, SEQ, H100, dtype="float32")
    assert pred.comm_elements == pytest.approx(rep["measured"]["steps"], rel=1e-12)
    axes = {"tensor"} | ({"pipe"} if pipe > 1 else set()) | ({"data"} if tensor * pipe < 8
                                                               else set())
    assert set(pred.comm_elements) >= axes
    fwd, bwd = layer_collectives(model, parallel, "float32")
    assert rep["measured"]["looped"] == 2
    assert rep["measured"]["layer_fwd"] == sum(e for e, _ in fwd)
    assert rep["measured"]["layer_bwd"] == sum(e for e, _ in bwd)


@pytest.mark.parametrize("options", [
    dict(data=2, tensor=4, zero=3, grad_accum=2),
    dict(data=2, pipe=2, tensor=2, microbatches=2, zero=1, grad_accum=2)], ids=str)
def test_predicted_data_parallel_traffic_is_the_compiled_one(options):
    """FSDP and ZeRO-1 with accumulation: the model's per-axis volumes are the step's."""
    parallel = Parallel(**options)
    model = tiny("cola", n_layers=2 * parallel.pipe)
    rep = build_report(Config(model, parallel, Train(batch_size=BATCH, seq_len=SEQ), Data()))
    pred = predict(model, parallel, BATCH, SEQ, H100, dtype="float32")
    assert pred.comm_elements == pytest.approx(rep["measured"]["steps"], rel=1e-12)
    assert pred.breakdown["dp"] > 0


def test_zero_stages_in_the_model():
    """ZeRO-1 moves the all-reduce's bytes (same DP time), FSDP adds the per-layer gathers;
    both split the model state, and accumulation keeps one micro-step's activations."""
    m = Model(arch="cola", size="7b")
    layouts = {z: Parallel(data=8, tensor=1, tp_plan="none", zero=z) for z in (0, 1, 3)}
    total = {z: sum(data_parallel_time(m, p, H100, Efficiency())) for z, p in layouts.items()}
    assert total[1] == pytest.approx(total[0], rel=0.02)
    assert total[3] > 1.4 * total[0]
    runs = {z: predict(m, p, 64, 4096, H100) for z, p in layouts.items()}
    state = {z: r.memory["model_state"] for z, r in runs.items()}
    assert state[3] < state[1] < state[0]
    accum = predict(m, Parallel(data=8, tensor=1, tp_plan="none", grad_accum=4), 64, 4096, H100)
    assert accum.memory["activations"] == pytest.approx(runs[0].memory["activations"] / 4)
    assert accum.model_flops == runs[0].model_flops


def test_in_loop_reductions_are_priced_as_overlapped():
    """Without accumulation the layers' gradient reductions run in the backward loop: all but
    the last layer's hide under compute (``dp_overlap`` of them); with accumulation the one
    reduction after the loop is exposed whole; ``dp_overlap=0`` exposes everything."""
    m = Model(arch="cola", size="7b")
    per_layer, accum = (Parallel(data=8, tensor=1, tp_plan="none", grad_accum=k)
                        for k in (1, 4))
    after, in_loop = data_parallel_time(m, per_layer, H100, Efficiency())
    assert in_loop > 10 * after  # the embedding, head and norms after the loop
    exposed = predict(m, per_layer, 64, 4096, H100).breakdown["dp"]
    assert exposed == pytest.approx(after + in_loop / m.n_layers)
    serial = predict(m, per_layer, 64, 4096, H100, Efficiency(dp_overlap=0.0))
    assert serial.breakdown["dp"] == pytest.approx(after + in_loop)
    assert data_parallel_time(m, accum, H100, Efficiency()) == (
        pytest.approx(after + in_loop), 0.0)
    assert predict(m, accum, 64, 4096, H100).breakdown["dp"] == pytest.approx(after + in_loop)


def test_flops_breakdown_and_memory_follow_the_plan():
    m = Model(arch="cola", size="7b")
    runs = {plan: predict(m, Parallel(data=1, tensor=4, tp_plan=plan), 4, 4096, H100)
            for plan in ("vanilla", "btp")}
    dense = predict(dataclasses.replace(m, arch="dense"),
                    Parallel(data=1, tensor=4, tp_plan="fullrank"), 4, 4096, H100)
    share = 4 * 4096 / 4
    assert runs["btp"].model_flops == train_flops_per_token(m, 4096) * share
    assert dense.model_flops > 2 * runs["btp"].model_flops  # the low-rank FLOP advantage
    # vanilla all-reduces full-width outputs: far more TP time than btp's latents
    assert runs["vanilla"].breakdown["tp"] > 4 * runs["btp"].breakdown["tp"]
    assert runs["btp"].step_s < dense.step_s < runs["vanilla"].step_s
    assert math.isclose(runs["btp"].step_s, sum(runs["btp"].breakdown.values()))
    # lowrank remat: recompute counted as hardware FLOPs only, activations shrink
    remat = predict(m, Parallel(data=1, tensor=4, remat="lowrank"), 4, 4096, H100)
    assert remat.model_flops == runs["btp"].model_flops < remat.hardware_flops
    assert remat.memory["activations"] < runs["btp"].memory["activations"] / 2


def test_cudnn_attention_workspace_is_counted_with_flash_attention_only():
    """cuDNN's attention backward workspace (which a compile without a GPU sizes 0): its fp32
    dQ accumulator and softmax sum for one layer of a microbatch, heads split by the tensor
    axis under btp, replicated under vanilla; none with XLA's attention."""
    m = Model(arch="cola", size="7b")  # 32 heads of 128
    btp, van = (predict(m, Parallel(data=1, tensor=4, tp_plan=p), 4, 4096, H100).memory
                for p in ("btp", "vanilla"))
    tokens = 4 * 4096
    assert btp["cudnn_workspace"] == tokens * (32 // 4) * (128 + 1) * 4
    assert van["cudnn_workspace"] == tokens * 32 * (128 + 1) * 4
    xla = predict(m, Parallel(data=1, tensor=4), 4, 4096, H100, flash_attention=False)
    assert "cudnn_workspace" not in xla.memory


def test_pipeline_bubble_and_inter_node_links():
    m = Model(arch="cola", size="13b")
    hw = PROFILES["a100_80gb_4gpu"]
    gpipe = predict(m, Parallel(data=1, tensor=4, pipe=2, microbatches=2), 4, 4096, hw)
    more = predict(m, Parallel(data=1, tensor=4, pipe=2, microbatches=4), 4, 4096, hw)
    assert 0 < more.breakdown["bubble"] < gpipe.breakdown["bubble"]
    slow_net = dataclasses.replace(hw, inter_bw=hw.inter_bw / 10)
    assert predict(m, Parallel(data=1, tensor=4, pipe=2, microbatches=2), 4, 4096,
                   slow_net).breakdown["pp"] > gpipe.breakdown["pp"]
    # a TP group larger than a node goes over the network
    wide = Parallel(data=1, tensor=8, tp_plan="btp")
    assert (predict(m, wide, 4, 4096, slow_net).breakdown["tp"]
            > predict(m, wide, 4, 4096, hw).breakdown["tp"])


def test_paper_rows_within_the_acceptance_bounds():
    """BOOST and full-rank TP within 15 % of every measured row, vanilla within 25 %, BOOST vs
    full rank inside the paper's 1.46-1.91x for 3B-30B (global constants only)."""
    rows = compare(WEAK_SCALING + ARCHITECTURES, PROFILES["a100_80gb_4gpu"], Efficiency())
    assert len(rows) == 8
    for r in rows:
        for method, bound in (("boost", 0.15), ("fullrank", 0.15), ("vanilla", 0.25)):
            assert abs(r[method]["error"]) <= bound, (r["row"], method, r[method])
    for r in rows[1:5]:
        assert 1.46 <= r["speedup_vs_fullrank"]["predicted"] <= 1.91, r


def test_the_7b_row_accumulates_like_the_trainer():
    """The paper's 7B row (4 accumulated micro-batches of 1 sequence) is modelled as the
    trainer runs it: ``Parallel.grad_accum=4``, one micro-batch's activations alive."""
    from boost_jax.analysis.paper import configs

    row = next(r for r in WEAK_SCALING if r.name == "7B TP4")
    model, parallel = configs(row, "boost")
    assert (parallel.grad_accum, parallel.microbatches, parallel.pipe) == (4, 1, 1)
    whole = dataclasses.replace(parallel, grad_accum=1)
    a, b = (predict(model, p, row.batch, 4096, H100) for p in (parallel, whole))
    assert a.memory["activations"] == pytest.approx(b.memory["activations"] / 4)


def test_bench_model_paper_json():
    out = subprocess.run([sys.executable, "-m", "boost_jax.bench", "model", "--paper",
                          "--json", "--eff_override=comm=0.6"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["efficiency"]["comm"] == 0.6
    assert [r["row"] for r in result["weak_scaling"]] == ["1B TP1", "3B TP2", "7B TP4",
                                                           "13B TP4xPP2", "30B TP4xPP4"]
    assert {r["arch"] for r in result["architectures"]} == {"svd", "cola", "lax"}


def test_paper_rows_ignore_the_runs_gin_bindings():
    """The paper's layouts are fixed: a run's ``--gin_param`` (here a 2-layer model and FSDP)
    does not reach them (bench step predicts them beside a run's own shape)."""
    from boost_jax.analysis.paper import configs
    from boost_jax.gin_io import load_config, parse_gin

    row = next(r for r in WEAK_SCALING if r.pipe > 1)
    before = configs(row, "boost")
    parse_gin(bindings=["Model.n_layers=2", "Parallel.zero=3"])
    assert load_config().model.n_layers == 2  # the binding is live
    assert configs(row, "boost") == before


def test_the_fitted_constants_are_recovered_from_times_they_made():
    """Guards analysis/calibrate.py's fit: full-rank "measured" times made by the model itself
    with attention=0.30, memory=0.70 are fitted back from the shipped constants to within
    0.5 %, on two rows (as few as the two constants need)."""
    import dataclasses

    from boost_jax.analysis.calibrate import fit
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.paper import WEAK_SCALING, configs
    from boost_jax.analysis.perf_model import Efficiency, predict

    hw, truth = PROFILES["a100_80gb_4gpu"], Efficiency(attention=0.30, memory=0.70)
    rows = []
    for row in (WEAK_SCALING[0], WEAK_SCALING[3]):
        model, parallel = configs(row, "fullrank")
        made = predict(model, parallel, row.batch, 4096, hw, truth).step_s
        rows.append(dataclasses.replace(row, measured={**row.measured, "fullrank": made}))
    got = fit(rows, hw)
    assert abs(got.attention / 0.30 - 1) < 5e-3 and abs(got.memory / 0.70 - 1) < 5e-3, got
    assert got.comm == Efficiency().comm  # the others stay as shipped
