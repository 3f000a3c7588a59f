"""``plan --verify`` where the ``gpu_compile`` extra is installed (CI's newest stack, jax >=
0.12; skipped with the reason elsewhere): a layout compiled at full shape by XLA's GPU compiler
for the planned GPUs (analysis/plan_verify.py ``check_layout_on_gpu``), the performance model's
memory per device within 10 % of the compiled program's and its communication the formula's.

The layouts are two of the paper's rows (analysis/paper.py, BOOST's layout: CoLA under ``btp``,
the rows' batch, microbatches and remat, seq 4096, bf16, cuDNN attention) for its A100s, at
reduced depth -- two layers per pipeline stage -- and full width: 13B TP4xPP2 (``remat='none'``,
one microbatch: the activations of every pipeline iteration and the layer loop's copy,
analysis/perf_model.py) and 30B TP4xPP4 (``remat='full'``, four microbatches: the parameters
and optimizer state dominate). Measured on 2026-11-28 (jax 0.12.0.1), GiB per device, model /
compiled: 13B 14.37 / 15.21 (0.945), 30B 4.63 / 4.84 (0.957); the full-depth rows:
docs/paper.md."""

from __future__ import annotations

import dataclasses

import pytest

from boost_jax.analysis import plan_verify
from boost_jax.analysis.hardware import PROFILES

#: what a second JAX can change: CI's newest stack runs these (the only stack with the extra)
pytestmark = pytest.mark.jax_sensitive

HARDWARE = "a100_80gb_4gpu"  # the paper's GPUs, 4 per node


def test_a_profile_without_a_target_spec_says_so():
    assert plan_verify.gpu_target_missing("no_such_gpu") == (
        "no XLA target spec for --hardware=no_such_gpu")
    assert set(plan_verify.GPU_TARGETS) == set(PROFILES)


@pytest.mark.parametrize("row, layers", [("13b", 4), ("30b", 8)])
def test_a_paper_row_compiled_for_its_a100s_agrees_with_the_model(row, layers):
    if (why := plan_verify.gpu_target_missing(HARDWARE)) is not None:
        pytest.skip(why)
    from boost_jax.analysis.planner import Problem, evaluate
    from boost_jax.bench.memory import row_config

    config = row_config(row, "bfloat16", "boost", "cudnn")
    model = dataclasses.replace(config.model, n_layers=layers)
    par, t = config.parallel, config.train
    problem = Problem(model, par.num_devices, t.batch_size, t.seq_len, PROFILES[HARDWARE])
    check = plan_verify.check_layout_on_gpu(problem, evaluate(problem, par),
                                            plan_verify.GPU_TARGETS[HARDWARE])
    assert check["compiled_memory_mib"] < PROFILES[HARDWARE].hbm_bytes / 2**20
    assert check["flags"] == [], check
    assert abs(check["memory_error"]) <= plan_verify.GPU_TOLERANCE
