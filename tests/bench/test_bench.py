"""The benchmark commands end to end on small shapes (structure, never timings)."""

import json
import subprocess
import sys

import pytest

from boost_jax.bench.measure import ROWS, row_config
from boost_jax.config import Config, ConfigError, Data, Parallel, Train
from boost_jax.testing import tiny

TINY = ["--gin_param=Model.size='tiny'", "--gin_param=Train.batch_size=8",
        "--gin_param=Train.seq_len=16"]


def test_rows_pick_the_model_and_plan():
    config = Config(tiny("svd"), Parallel(data=2, tensor=4), Train(), Data())
    assert {r: (c.model.arch, c.parallel.tp_plan, g) for r in ROWS
            for c, g in [row_config(config, r)]} == {
        "fullrank": ("dense", "fullrank", False), "vanilla": ("svd", "vanilla", False),
        "btp": ("svd", "btp", False), "gspmd-megatron": ("dense", "fullrank", True),
        "gspmd-vanilla": ("svd", "vanilla", True), "gspmd-btp": ("svd", "btp", True)}
    with pytest.raises(ConfigError, match="unknown benchmark row 'btp2'"):
        row_config(config, "btp2")


def test_bench_step_writes_json_and_figures(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "boost_jax.bench", "step", *TINY, "--steps=2",
         "--plans=btp,gspmd-btp", "--gin_param=Train.peak_tflops=1.0",
         f"--out={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "btp / gspmd-btp: step time x" in out.stdout and "temp memory x" in out.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["devices"] == 8
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["btp", "gspmd-btp"]
    r = tiny("cola").attn_rank
    assert rows["btp"]["tp_elements_per_layer_token"] == 14 * r + 2  # online RMSNorm, fused
    assert rows["gspmd-btp"]["tp_elements_per_layer_token"] == 14 * r + 4
    assert rows["gspmd-btp"]["gspmd"] and not rows["btp"]["gspmd"]
    for r in rows.values():
        assert r["median_step_s"] > 0 and 0 < r["mfu"] and r["tp_collectives_per_step"] > 0
    for name in result["figures"]:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert len(result["figures"]) == 3


def test_bench_rejects_an_unknown_row():
    out = subprocess.run([sys.executable, "-m", "boost_jax.bench", "tp", *TINY,
                          "--plans=btp,megatron"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown benchmark row 'megatron'" in out.stderr


def test_bench_zero_layouts_json():
    """``bench zero``: FSDP holds the least state per device, ZeRO-1 puts the all-reduce's
    bytes on the wire, every layout's traffic is the formula."""
    out = subprocess.run([sys.executable, "-m", "boost_jax.bench", "zero", *TINY, "--steps=1",
                          "--layouts=0,1,3x2", "--json"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["zero"], r["grad_accum"]): r for r in json.loads(out.stdout)}
    assert list(rows) == [(0, 1), (1, 1), (3, 2)]
    assert all(r["check"] == [] for r in rows.values())
    assert rows[(1, 1)]["data_wire_mib"] == rows[(0, 1)]["data_wire_mib"]
    assert rows[(1, 1)]["opt_mib"] < rows[(0, 1)]["opt_mib"] / 1.8
    assert rows[(3, 2)]["params_mib"] < rows[(0, 1)]["params_mib"] / 1.8
    # without accumulation the layers' gradients are reduced in the backward loop
    assert rows[(0, 1)]["in_loop"] > 0.25 and rows[(3, 2)]["in_loop"] > 0.5


def test_bench_memory_for_a_gpu_compiles_each_config_once():
    """``bench memory --target``: the paper's rows x methods, a config two methods share (the
    1B row at TP=1: ``vanilla`` and ``btp`` are both plan ``none``) compiled and printed once."""
    from boost_jax.bench.memory import gpu_configs

    configs, skipped = gpu_configs(["1b", "3b"], ["fullrank", "vanilla", "boost"])
    assert [(c.model.size, c.model.arch, c.parallel.tp_plan) for c in configs] == [
        ("1b", "dense", "none"), ("1b", "cola", "none"), ("3b", "dense", "fullrank"),
        ("3b", "cola", "vanilla"), ("3b", "cola", "btp")]
    assert {c.parallel.attention for c in configs} == {"cudnn"} and skipped == []


def test_bench_memory_at_reduced_depth():
    """``bench memory --target --memory_layers=N``: each row with ``N`` decoder layers and its
    widths (the programs the memory model's constants are read from, docs/BENCHMARKS.md); a
    depth a pipelined row cannot split is named, not compiled."""
    from boost_jax.bench.memory import gpu_configs

    configs, skipped = gpu_configs(["3b", "13b"], ["boost"], layers=4)
    assert [(c.model.size, c.model.n_layers, c.model.d_model) for c in configs] == [
        ("3b", 4, 3072), ("13b", 4, 5120)]
    configs, skipped = gpu_configs(["3b", "13b"], ["boost"], layers=3)
    assert [c.model.size for c in configs] == ["3b"]
    assert len(skipped) == 1 and "13b boost layers=3" in skipped[0] and "divisible" in skipped[0]


def test_bench_memory_schedules_and_what_1f1b_would_hold():
    """``bench memory --target --schedules``: the pipelined rows under each schedule and
    microbatch count (a combination ``Config`` rejects is named, not compiled; a row without a
    pipeline once); the model's 1F1B figure holds ``min(M, S)`` microbatches' activations where
    GPipe holds ``M + S - 1`` and the layer loop's copy."""
    from boost_jax.analysis.perf_model import memory
    from boost_jax.bench.memory import gpu_configs

    configs, skipped = gpu_configs(["13b", "7b"], ["boost"], microbatches=[1, 2],
                                   schedules=["gpipe", "circular:2"])
    assert [(c.model.size, c.parallel.microbatches, c.parallel.pipeline_schedule,
             c.parallel.repeats) for c in configs] == [
        ("13b", 1, "gpipe", 1), ("13b", 2, "gpipe", 1), ("13b", 2, "circular", 2),
        ("7b", 1, "gpipe", 1)]
    assert len(skipped) == 1 and skipped[0].startswith("13b boost micro=1 circular:2")
    c = configs[0]  # 13B TP4xPP2, M = 1: GPipe holds 1 + 2 - 1 + 1 (the copy) passes, 1F1B 1
    m, p, t = c.model, c.parallel, c.train
    gpipe = memory(m, p, t.batch_size, t.seq_len)
    one = memory(m, p, t.batch_size, t.seq_len, in_flight=1)
    assert gpipe["model_state"] == one["model_state"] and gpipe["logits"] == one["logits"]
    assert gpipe["activations"] > 2.9 * one["activations"]


def test_bench_memory_refuses_a_bad_schedule_or_microbatch_count():
    """``--schedules`` / ``--memory_microbatches``: a bad value is one ConfigError naming it
    (the command's one line, exit 2), before anything compiles."""
    from boost_jax.bench.memory import parse_lists

    assert parse_lists([], []) == ([None], [""])
    assert parse_lists(["1", "4"], ["gpipe", "circular:2"]) == ([1, 4], ["gpipe", "circular:2"])
    for micro, schedules, needle in [(["x"], [], "'x' is not a positive integer"),
                                     (["0"], [], "'0' is not a positive"),
                                     ([], ["1f1b"], "'1f1b' is not gpipe or circular:R"),
                                     ([], ["circular"], "is not gpipe or circular:R"),
                                     ([], ["gpipe:2"], "is not gpipe or circular:R"),
                                     ([], ["circular:x"], "'x' is not a positive")]:
        with pytest.raises(ConfigError, match=needle):
            parse_lists(micro, schedules)


def test_bench_memory_rows_are_the_paper_layouts_and_compile():
    """``bench memory``: each row is the paper's BOOST layout (with FSDP over data=2: twice the
    batch), and a row reports compiled and modelled memory per device (a tiny pipelined FSDP
    config stands in for the compile: the paper rows need up to 32 devices)."""
    import jax

    from boost_jax.bench.memory import ROWS, measure_row, row_config
    from boost_jax.config import Config, Data, Parallel, Train
    from boost_jax.testing import tiny

    c13, f13 = row_config("13b"), row_config("13b_fsdp")
    assert (c13.parallel.tensor, c13.parallel.pipe, c13.parallel.data) == (4, 2, 1)
    assert (f13.parallel.data, f13.parallel.zero) == (2, 3)
    assert f13.train.batch_size == 2 * c13.train.batch_size and set(ROWS) >= {"30b_fsdp"}
    assert row_config("13b", microbatches=4).parallel.microbatches == 4  # --memory_microbatches
    assert row_config("7b", microbatches=4).parallel.microbatches == 1  # not pipelined
    small = Config(tiny("cola", n_layers=4), Parallel(data=2, pipe=2, tensor=2, zero=3,
                                                      microbatches=2),
                   Train(batch_size=8, seq_len=16, dtype="bfloat16"), Data())
    row = measure_row(small, jax.devices())
    assert row["devices"] == 8 and 0 < row["temp_gib"] < row["compiled_gib"]
    assert row["model_gib"] > 0 and row["model_flash_gib"] <= row["model_gib"]
