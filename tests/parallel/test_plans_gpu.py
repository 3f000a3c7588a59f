"""Every tensor-parallel plan that fits one GPU, run on the GPU (marker `gpu`; skipped with the
reason elsewhere): loss and every gradient of the train step's gradient function against the
fp32 reference computed on the CPU from the same weights and batch.

bf16, with XLA's and with cuDNN's attention (packed rows included): the loss within 2e-2 and
each gradient's ``||a - b|| / ||b||`` within the suite's bf16 tolerance (4e-2,
tests/parallel/test_plans.py) or, where the same plan's bf16 program on the CPU is itself
further from fp32 (measured beside it: LaX's 2-layer tiny model, 0.056 on jax 0.12), no more
than 1.25x that: the GPU's bf16 program is no worse than the CPU's, which the suite accepts.
fp32 at matmul precision ``highest`` within 5e-5 (BOOST's fp32 tolerance for the online-RMSNorm
recovery): the GPU's fp32 path differs from the CPU's by rounding only. Each test prints its
errors (``pytest -rP``)."""

import jax
import numpy as np
import pytest

from boost_jax.config import Parallel
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import loss_and_grads, norm_rel_err, rel_err, tiny, tree_rel_err
from tests.gpu import gpu_device

pytestmark = pytest.mark.gpu
#: bf16 gradients against fp32 (the suite's, tests/parallel/test_plans.py), fp32 against fp32
BF16_TOL, FP32_TOL = 4e-2, 5e-5
#: the GPU's bf16 error may reach this multiple of the CPU bf16 program's own
CPU_SLACK = 1.25
#: (arch, plan) at TP=1: the baselines and BTP for every low-rank arch
CASES = [("dense", "fullrank"), ("svd", "vanilla"), ("cola", "vanilla"), ("svd", "btp"),
         ("cola", "btp"), ("lax", "btp")]


@pytest.fixture(scope="module")
def gpu():
    return gpu_device()


def _problem(arch: str, packed: bool = False):
    # 2 heads of 32: cuDNN's flash attention takes head dims that are multiples of 8 up to 128
    model = tiny(arch, n_heads=2, n_kv_heads=2)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    rng = np.random.default_rng()  # fresh inputs every run
    inputs = rng.integers(0, model.vocab_size, (4, 64), dtype=np.int32)
    packing = None
    if packed:
        ids = np.repeat(np.array([[1] * 20 + [2] * 30 + [3] * 10 + [0] * 4]), 4, axis=0)
        pos = np.concatenate([np.arange(20), np.arange(30), np.arange(10), np.zeros(4, int)])
        packing = {"segment_ids": ids.astype(np.int32),
                   "positions": np.repeat(pos[None], 4, axis=0).astype(np.int32)}
    return model, params, inputs, np.roll(inputs, -1, axis=1), packing


def _reference(model, plan, params, inputs, targets, packing):
    return loss_and_grads(model, Parallel(data=1, tensor=1, tp_plan=plan, attention="xla"),
                          params, inputs, targets, "float32", packing=packing,
                          devices=jax.devices("cpu"))


def _check_bf16(name, got, ref, cpu_bf16):
    """``got`` (the GPU's bf16 loss and gradients) against ``ref`` (fp32, CPU), allowing what
    ``cpu_bf16`` (the same plan in bf16 on the CPU) is off by."""
    err = tree_rel_err(got[1], ref[1], norm_rel_err)
    cpu = tree_rel_err(cpu_bf16[1], ref[1], norm_rel_err)
    loss = rel_err(got[0], ref[0])
    print(f"{name}: bf16 on the GPU vs fp32: loss {loss:.2e}, worst gradient {err:.4f} "
          f"(bf16 on the CPU: {cpu:.4f})")
    assert loss <= 2e-2, name
    assert err <= max(BF16_TOL, CPU_SLACK * cpu), name


@pytest.mark.parametrize("arch,plan", CASES)
def test_bf16_plan_on_the_gpu_matches_the_fp32_reference(gpu, arch, plan):
    model, params, inputs, targets, _ = _problem(arch)
    ref = _reference(model, plan, params, inputs, targets, None)
    cpu = loss_and_grads(model, Parallel(data=1, tensor=1, tp_plan=plan, attention="xla"),
                         params, inputs, targets, "bfloat16", devices=jax.devices("cpu"))
    for attention in ("xla", "cudnn"):
        got = loss_and_grads(model, Parallel(data=1, tensor=1, tp_plan=plan,
                                             attention=attention),
                             params, inputs, targets, "bfloat16", devices=[gpu])
        _check_bf16(f"{arch} {plan} {attention}", got, ref, cpu)


def test_bf16_packed_rows_with_cudnn_match_the_fp32_reference(gpu):
    """Packed rows (three documents and padding per row) through cuDNN's segment-masked path."""
    model, params, inputs, targets, packing = _problem("cola", packed=True)
    ref = _reference(model, "btp", params, inputs, targets, packing)
    cpu = loss_and_grads(model, Parallel(data=1, tensor=1, tp_plan="btp", attention="xla"),
                         params, inputs, targets, "bfloat16", packing=packing,
                         devices=jax.devices("cpu"))
    for attention in ("xla", "cudnn"):
        got = loss_and_grads(model, Parallel(data=1, tensor=1, tp_plan="btp",
                                             attention=attention),
                             params, inputs, targets, "bfloat16", packing=packing,
                             devices=[gpu], max_segments=4)
        _check_bf16(f"packed cola btp {attention}", got, ref, cpu)


@pytest.mark.parametrize("arch,plan", [("cola", "btp"), ("dense", "fullrank")])
def test_fp32_plan_on_the_gpu_matches_the_cpu(gpu, arch, plan):
    model, params, inputs, targets, _ = _problem(arch)
    ref = _reference(model, plan, params, inputs, targets, None)
    with jax.default_matmul_precision("highest"):
        got = loss_and_grads(model, Parallel(data=1, tensor=1, tp_plan=plan, attention="xla"),
                             params, inputs, targets, "float32", devices=[gpu])
    err = max(rel_err(got[0], ref[0]), tree_rel_err(got[1], ref[1]))
    print(f"{arch} {plan}: fp32 (highest) on the GPU vs the CPU: {err:.2e}")
    assert err <= FP32_TOL
