"""What each plan sends, read from the compiled train step: exact collectives per layer, and the
communication report's check against SPEC §6.2's formulas."""

import functools
import json
import math
import subprocess
import sys

import pytest

from boost_jax.compiled.step_report import build_report, check
from boost_jax.config import Config, Data, Parallel, Train
from boost_jax.testing import tiny

BATCH, SEQ = 8, 16
TOKENS = BATCH // 2 * SEQ  # per data shard (data=2)


@functools.cache
def _report(arch, plan, **options):
    model = tiny(arch)
    parallel = Parallel(data=2, tensor=4, tp_plan=plan, **options)
    return build_report(Config(model, parallel, Train(batch_size=BATCH, seq_len=SEQ), Data()))


def _layer_widths(rep, direction):
    """Per-token widths of the tensor-axis collectives of one layer, sorted."""
    widths = []
    for r in rep["collectives"]:
        if r["where"] == "layer" and r["direction"] == direction and r["axes"] == "tensor":
            assert r["op"] == "all-reduce", r  # no other collective inside the layers
            widths += [math.prod(r["shape"]) // TOKENS] * r["instances"]
    return sorted(widths)


def test_btp_online_four_fused_all_reduces_each_way():
    r = tiny("cola").attn_rank
    rep = _report("cola", "btp", rmsnorm="online")
    assert _layer_widths(rep, "fwd") == [r, r, 2 * r + 1, 3 * r + 1]
    assert _layer_widths(rep, "bwd") == [r, r, 2 * r, 3 * r]
    assert rep["check"] == []


def test_btp_sync_adds_the_statistic_collectives():
    r = tiny("cola").attn_rank
    rep = _report("cola", "btp", rmsnorm="sync")
    assert _layer_widths(rep, "fwd") == [1, 1, r, r, 2 * r, 3 * r]
    assert _layer_widths(rep, "bwd") == [1, 1, r, r, 2 * r, 3 * r]
    assert rep["check"] == []


def test_vanilla_all_reduces_full_width_outputs():
    m = tiny("cola")
    rep = _report("cola", "vanilla")
    assert _layer_widths(rep, "fwd") == sorted([m.d_model, 2 * m.d_kv, m.d_model, 2 * m.d_ff,
                                                m.d_model])
    assert _layer_widths(rep, "bwd") == sorted([m.d_model] * 3 + [m.d_ff])
    assert rep["check"] == []


@functools.cache
def _vanilla_lax_report(gate, norm, dtype="float32", **options):
    """vanilla with LaX's crossing ``(gate, latent norm)``, 3 layers: block 0 runs before the
    layer loop, blocks 1-2 in it."""
    model = tiny("lax", n_layers=3, lax_gate=gate, lax_latent_norm=norm)
    parallel = Parallel(data=2, tensor=4, tp_plan="vanilla", **options)
    train = Train(batch_size=BATCH, seq_len=SEQ, dtype=dtype)
    return build_report(Config(model, parallel, train, Data()))


def _layer_ops(rep, direction):
    """``(op, per-token width)`` of every tensor-axis collective of one layer, sorted."""
    return sorted((r["op"], math.prod(r["shape"]) // TOKENS) for r in rep["collectives"]
                  for _ in range(r["instances"]) if r["where"] == "layer"
                  and r["direction"] == direction and r["axes"] == "tensor")


@pytest.mark.parametrize("gate, norm", [  # the gate alone mixing is under -m slow
    ("kronecker", True), pytest.param("kronecker", False, marks=pytest.mark.slow),
    ("identity", True), ("identity", False)])
def test_vanilla_lax_gathers_each_latent_it_crosses_whole(gate, norm):
    """vanilla's own all-reduces, plus -- for a crossing that mixes the latent -- one
    all-gather of each projection's latent forward and f's all-reduce of it backward."""
    m = tiny("lax")
    latents = [] if (gate, norm) == ("identity", False) else [
        3 * m.attn_rank, m.attn_rank, 2 * m.mlp_rank, m.mlp_rank]
    fwd = [m.d_model, 2 * m.d_kv, m.d_model, 2 * m.d_ff, m.d_model]
    bwd = [m.d_model] * 3 + [m.d_ff] + latents
    rep = _vanilla_lax_report(gate, norm)
    assert _layer_ops(rep, "fwd") == sorted([("all-reduce", w) for w in fwd] +
                                            [("all-gather", w) for w in latents])
    assert _layer_ops(rep, "bwd") == sorted(("all-reduce", w) for w in bwd)
    assert rep["check"] == []


def test_vanilla_lax_ungrouped_full_remat_bfloat16_check():
    """One gather per projection without grouping too; ``full`` remat replays the gathers;
    bf16 latents are gathered in bf16."""
    rep = _vanilla_lax_report("kronecker", True, "bfloat16", grouping=False, remat="full")
    assert rep["check"] == []
    assert rep["measured"]["layer_fwd_bytes"] == 2 * rep["measured"]["layer_fwd"]


def test_fullrank_megatron():
    d = tiny("dense").d_model
    rep = _report("dense", "fullrank")
    assert _layer_widths(rep, "fwd") == [d, d]
    assert _layer_widths(rep, "bwd") == [d, d]
    assert rep["check"] == []


@pytest.mark.parametrize("arch, plan, options", [
    ("svd", "btp", dict(grouping=False)), ("lax", "btp", {}),
    ("dense", "fullrank", dict(grouping=False)), ("svd", "vanilla", dict(grouping=False)),
    ("cola", "btp", dict(rmsnorm="sync", grouping=False)),
    ("cola", "btp", dict(rmsnorm="sync", grouping=False, remat="full")),
    ("cola", "btp", dict(norm_payload="float32", remat="full")),
])
def test_report_check_other_variants(arch, plan, options):
    assert _report(arch, plan, **options)["check"] == []


@pytest.mark.parametrize("payload, remat, stat", [("lanes", "full", 3 * 4),
                                                   ("compute", "none", 1)])
def test_report_check_in_bfloat16(payload, remat, stat):
    """bf16: the fused all-reduces carry the statistic as 3 bf16 lanes per rank (``lanes``,
    the default: ``3 p`` elements) or as one rounded element (``compute``), all in bf16."""
    r = tiny("cola").attn_rank
    rep = build_report(Config(tiny("cola"), Parallel(data=2, tensor=4, remat=remat,
                                                     norm_payload=payload),
                              Train(batch_size=BATCH, seq_len=SEQ, dtype="bfloat16"), Data()))
    assert rep["check"] == []
    assert _layer_widths(rep, "fwd") == [r, r, 2 * r + stat, 3 * r + stat]
    assert {c["dtype"] for c in rep["collectives"]
            if c["where"] == "layer" and c["axes"] == "tensor"} == {"bf16"}
    # the layers' gradients, reduced over data in the backward loop, sum in fp32
    assert {c["dtype"] for c in rep["collectives"]
            if c["where"] == "layer" and c["axes"] == "data"} == {"f32"}
    assert rep["measured"]["layer_fwd_bytes"] == 2 * rep["measured"]["layer_fwd"]


def test_data_axis_is_one_fp32_gradient_reduction_per_step():
    """Over data: each layer's gradients all-reduced in fp32 once, in the backward layer loop
    (one run per layer), the embedding's, head's and norms' once after it, the loss, and the
    global norm's scalar over every axis with the two stop flags riding in it (``[3]``): no
    collective of its own for the agreed stop."""
    rep = _report("cola", "btp", rmsnorm="online")
    data = [r for r in rep["collectives"] if "data" in r["axes"].split(",")]
    assert {(r["op"], r["runs"], r["where"], r["dtype"]) for r in data} == {
        ("all-reduce", tiny("cola").n_layers, "layer", "f32"),
        ("all-reduce", 1, "optimizer", "f32")}
    scalars = sorted((r["axes"], r["shape"]) for r in data if r["shape"] in ([], [3]))
    assert scalars == [("data", []), ("data,tensor", [3])]  # loss; grad norm + stop flags
    assert rep["measured"]["steps"]["data"] == rep["predicted"]["steps"]["data"]


def test_packed_rows_add_only_the_token_count_over_data():
    """Segment ids stay on their data shard: the layers send what they send unpacked; the
    step adds one scalar all-reduce over data (the non-padding token count)."""
    rep = build_report(Config(tiny("cola"), Parallel(data=2, tensor=4, tp_plan="btp"),
                              Train(batch_size=BATCH, seq_len=SEQ), Data(packing="document")))
    plain = _report("cola", "btp")
    assert rep["check"] == []
    for way in ("fwd", "bwd"):
        assert _layer_widths(rep, way) == _layer_widths(plain, way)
    scalars = [(r["axes"], r["dtype"], r["shape"]) for r in rep["collectives"]
               if r["shape"] in ([], [3])]
    assert sorted(scalars) == [("data", "f32", []), ("data", "s32", []),
                               ("data,tensor", "f32", [3])]


def test_check_reports_a_difference():
    from boost_jax.analysis.comm import Comm

    ok = Comm(1, 2, 3, 4, 2, {"tensor": 10.0, "data": 5.0})
    assert check(ok, ok) == []
    assert check(Comm(1.5, 2, 3, 4, 2, {"tensor": 10.0}), ok) == [
        "layer_fwd: measured 1.5, formula 1", "per step on data: measured 0, formula 5"]


def test_cli_check_json_and_dump(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "boost_jax.tools.comm_report", "--gin_param=Model.size='tiny'",
         "--gin_param=Train.batch_size=8", "--gin_param=Train.seq_len=16", "--check", "--json",
         f"--dump_hlo={tmp_path / 'step.hlo'}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    assert rep["config"]["tp_plan"] == "btp" and rep["check"] == []
    assert "all-reduce" in (tmp_path / "step.hlo").read_text()
