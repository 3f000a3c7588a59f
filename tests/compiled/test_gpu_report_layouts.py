"""The train step compiled by XLA's GPU compiler for 8 H100s in one host, in the layouts and
plans beside tests/compiled/test_gpu_report.py's btp steps (a file of its own, so that CI's two
workers compile the two files' steps side by side): full-rank Megatron TP under ZeRO 1, and
vanilla low-rank TP under FSDP with gradient accumulation, each checked for (a) the traffic
against the formula, (b) the data-axis reductions' overlap and (c) no fp32 parameter traffic.
Compiled with the launchers' XLA flags; needs what that file needs (CI's newest stack)."""

from __future__ import annotations

import pytest

from boost_jax.config import Config, Data, Model, Parallel, Train
from tests.compiled.test_gpu_report import (
    LAYERS,
    SEQ,
    _layer_reductions,
    _missing,
    fp32_parameter_traffic,
)

pytestmark = pytest.mark.jax_sensitive


def test_the_launchers_do_not_pipeline_all_gathers():
    """The launchers' XLA flags leave ``xla_gpu_enable_pipelined_all_gather`` off: with it on,
    XLA ran every layer's tensor all-reduces twice under gradient accumulation -- on the tiny
    btp step with ``Parallel.grad_accum=2`` compiled here, 912,768 elements per step against
    the formula's 481,152 (+3 MiB of temporaries), on the paper's 7B TP4 step for A100s twice
    the formula's traffic and 11.2 GiB of temporaries instead of 7.5 (gpu_settings.py; docs,
    "Compiling for a GPU cluster without one")."""
    from boost_jax import gpu_settings

    options = gpu_settings.compiler_options()
    assert "xla_gpu_enable_pipelined_all_gather" not in options
    assert options.get("xla_gpu_enable_pipelined_all_reduce") == "true"


@pytest.mark.parametrize(("plan", "zero", "accum"), [("fullrank", 1, 1), ("vanilla", 3, 2)])
def test_b_under_zero_1_and_fsdp(plan, zero, accum):
    """(a), (b) and (c), 1 x 8: full-rank TP (the dense model) under ZeRO 1, and vanilla
    low-rank TP (CoLA) under FSDP with two accumulation micro-steps. The traffic equals the
    formula; each data-axis reduce-scatter of the layers' gradients is asynchronous with
    compute scheduled under it (7 in and out of the layer loop under ZeRO 1; 22 under FSDP,
    in each micro-step's backward loop), and FSDP's per-layer all-gathers are asynchronous too;
    no fp32 collective of a parameter's size moves but the gradients' reductions and ZeRO 1's
    gather of the updated fp32 slices: (c) seen failing on the FSDP step compiled in fp32 (its
    per-layer gathers then fp32). XLA itself moves a cast that follows a gather before it: with
    parallel/data_casts.py's cast-then-gather made a gather-then-cast, the GPU program still
    gathers bf16."""
    if (why := _missing()) is not None:
        pytest.skip(why)
    from boost_jax.compiled.gpu_report import compile_for_gpu, gpu_report

    arch = "dense" if plan == "fullrank" else "cola"
    config = Config(Model(size="tiny", n_layers=LAYERS, arch=arch),
                    Parallel(data=2, tensor=4, tp_plan=plan, attention="cudnn", zero=zero,
                             grad_accum=accum),
                    Train(dtype="bfloat16", batch_size=8, seq_len=SEQ),
                    Data(packing="document", max_segments=15))
    built = compile_for_gpu(config, "h100_sxm", "1x8")
    assert gpu_report(config, "h100_sxm", "1x8", compiled=built)["check"] == []
    hlo = built.compiled.as_text()
    assert fp32_parameter_traffic(built.model, hlo) == []
    layers, sched = _layer_reductions(built.model, hlo)
    scatters = [c for c in layers if c.op == "reduce-scatter"]
    assert scatters and sum(c.count for c in scatters) >= LAYERS
    assert all(sched[c.name].asynchronous and sched[c.name].overlapped > 0 for c in scatters)
    gathers = [c for c in layers if c.op == "all-gather"]
    assert bool(gathers) == (zero == 3)
    assert all(sched[c.name].asynchronous for c in gathers)
