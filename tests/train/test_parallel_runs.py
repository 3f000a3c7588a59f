"""Training runs across meshes: pipelined 3D parallelism (ZeRO-1) and FSDP with accumulation log
the losses of pure data parallelism, and checkpoints reshard onto other meshes and layouts
(a pipeline, FSDP)."""

import shutil

import jax
import pytest

from boost_jax.config import Parallel
from boost_jax.testing import rel_err, tiny
from boost_jax.train.loop import run
from tests.train.test_trainer import _config, _losses

DP8 = Parallel(data=8, tensor=1, tp_plan="none")
DP2_TP4 = Parallel(data=2, tensor=4, tp_plan="btp")


@pytest.fixture(scope="module")
def dp8_losses(tiny_data, tmp_path_factory):
    """20 steps of pure data parallelism: the reference curve."""
    workdir = tmp_path_factory.mktemp("dp8")
    run(_config(tiny_data, 20, DP8), workdir, jax.devices())
    return _losses(workdir)


@pytest.mark.parametrize("parallel", [
    Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=2, zero=1),
    Parallel(data=2, tensor=4, tp_plan="btp", zero=3, grad_accum=2),
], ids=["pipe2-tensor2-data2-zero1", "fsdp-tensor4-accum2"])
def test_parallel_layouts_log_the_losses_of_data_parallelism(tiny_data, tmp_path, dp8_losses,
                                                             parallel):
    """3D parallelism with ZeRO-1, and FSDP with tensor parallelism and accumulation: the
    losses of pure data parallelism, step for step, for 20 steps."""
    run(_config(tiny_data, 20, parallel), tmp_path / "run", jax.devices())
    a, b = dp8_losses, _losses(tmp_path / "run")
    assert sorted(b) == list(range(1, 21))
    assert rel_err([b[k] for k in range(1, 21)], [a[k] for k in range(1, 21)]) <= 1e-5


#: the resharding runs: 4 layers (a stage of 2 under the pipelines), a checkpoint at step 10
RESHARD = dict(schedule_steps=11, checkpoint_every=10, model=tiny("cola", n_layers=4))


@pytest.fixture(scope="module")
def dp2_tp4_run(tiny_data, tmp_path_factory):
    """11 steps on data=2 x tensor=4 (checkpoints 10 and 11): the uninterrupted run."""
    workdir = tmp_path_factory.mktemp("dp2_tp4")
    run(_config(tiny_data, 11, DP2_TP4, **RESHARD), workdir, jax.devices())
    return workdir


@pytest.mark.parametrize("target", [
    Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=2),
    Parallel(data=4, tensor=2, tp_plan="btp", zero=3),
    Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=2,
             pipeline_schedule="circular", pipeline_repeats=2),
], ids=["pipe2-tensor2-data2", "data4-tensor2-fsdp", "circular"])
def test_checkpoint_reshards_onto_another_mesh(tiny_data, tmp_path, dp2_tp4_run, target):
    """The data=2 x tensor=4 run's checkpoint 10, resumed on ``target``: step 11 as if
    uninterrupted."""
    shutil.copytree(dp2_tp4_run, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "11")
    summary = run(_config(tiny_data, 11, target, **RESHARD), tmp_path / "resumed",
                  jax.devices())
    assert (summary.start_step, summary.step) == (10, 11)
    assert rel_err(_losses(tmp_path / "resumed")[11], _losses(dp2_tp4_run)[11]) <= 1e-6
