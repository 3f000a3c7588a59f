"""Elastic restarts: ``Train.micro_batch_size`` fixes what one data replica runs per micro-step,
so a resume on another number of data replicas keeps the global batch (the trajectory) and the
per-device memory; ``Parallel.grad_accum`` follows (config.py ``Config._derive_grad_accum``)."""

import jax
import jax.numpy as jnp
import pytest

from boost_jax.config import Config, ConfigError, Data, Parallel, Train
from boost_jax.gin_io import load_config, operative_gin, parse_gin
from boost_jax.optim import make_optimizer
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.testing import rel_err, tiny
from boost_jax.train.loop import run
from boost_jax.train.step import compile_train_step
from tests.train.test_trainer import _config, _losses

EIGHT = Parallel(data=4, tensor=2, tp_plan="btp")  # 8 devices
FOUR = Parallel(data=2, tensor=2, tp_plan="btp")  # the restart on half of them


def test_the_accumulation_follows_the_micro_batch():
    def accum(parallel, batch=16, micro=2):
        return Config(tiny(), parallel, Train(batch_size=batch, micro_batch_size=micro),
                      Data()).parallel.grad_accum

    assert (accum(EIGHT), accum(FOUR), accum(Parallel(data=1, tensor=2))) == (2, 4, 8)
    assert accum(Parallel(data=2, tensor=2, grad_accum=4)) == 4  # the same value: allowed
    with pytest.raises(ConfigError, match=r"Parallel.grad_accum=2 contradicts "
                       r"Train.micro_batch_size=2 \(which makes it 4\)"):
        accum(Parallel(data=2, tensor=2, grad_accum=2))
    with pytest.raises(ConfigError, match=r"Train.micro_batch_size=3 does not divide the batch "
                       r"of a data shard \(Train.batch_size / Parallel.data = 4\)"):
        accum(EIGHT, micro=3)
    with pytest.raises(ConfigError, match="Train.micro_batch_size=0 must be a positive"):
        Train(micro_batch_size=0)


def test_the_run_config_file_runs_on_another_data_degree(tmp_path):
    """A run's config.gin leaves the derived accumulation unbound: rerun with another
    Parallel.data, it derives its own instead of contradicting the micro-batch."""
    import gin

    cfg = Config(tiny(), EIGHT, Train(batch_size=16, micro_batch_size=2), Data())
    text = operative_gin(cfg)
    assert "# Parallel.grad_accum = 2  #" in text and "Train.micro_batch_size = 2  #" in text
    (tmp_path / "config.gin").write_text(text)
    gin.clear_config()
    try:
        parse_gin([str(tmp_path / "config.gin")], ["Parallel.data=2"])
        again = load_config()
    finally:
        gin.clear_config()
    assert (again.parallel.data, again.parallel.grad_accum) == (2, 4)


def _temp_bytes(parallel: Parallel, micro: int | None, batch: int = 16, seq: int = 256) -> int:
    config = Config(tiny(), parallel, Train(batch_size=batch, seq_len=seq,
                                            micro_batch_size=micro), Data())
    devices = jax.devices()[:parallel.num_devices]
    model = ShardedModel(config.model, config.parallel, make_mesh(config.parallel, devices),
                         jnp.float32)
    step = compile_train_step(model, make_optimizer(config.train, model), batch, seq)
    return step.memory_analysis().temp_size_in_bytes


def test_a_restart_on_half_the_devices_keeps_the_per_device_memory():
    """The compiled step's temporaries (activations, per device): 8 devices and 4 with the
    same micro-batch are within 5% of each other; 4 devices that keep the accumulation (no
    micro-batch set) hold twice the rows, and far more."""
    eight, four = _temp_bytes(EIGHT, micro=2), _temp_bytes(FOUR, micro=2)
    assert abs(four - eight) <= 0.05 * eight, (eight, four)
    grown = _temp_bytes(Parallel(data=2, tensor=2, tp_plan="btp", grad_accum=2), micro=None)
    assert grown > 1.5 * eight, (eight, grown)


def test_a_run_on_8_devices_resumed_on_4_gives_the_same_losses(tiny_data, tmp_path,
                                                               monkeypatch):
    """CoLA/tiny under BTP, global batch 8, Train.micro_batch_size=1: 6 steps on 8 devices
    (data 4 x tensor 2, 2 micro-steps) against 3 steps there, then resumed on 4 devices (data 2
    x tensor 2, 4 micro-steps): the same losses (fp32, <= 1e-5), the first 3 bit for bit; the
    evaluation too, which runs in micro-batches of the same rows per replica (2 on 4
    devices)."""
    from boost_jax.train import loop

    cfg = dict(micro_batch_size=1, schedule_steps=6, checkpoint_every=3, eval_every=6)
    full, split = tmp_path / "full", tmp_path / "split"
    ref = run(_config(tiny_data, 6, EIGHT, **cfg), full, jax.devices())
    run(_config(tiny_data, 3, EIGHT, **cfg), split, jax.devices())
    smaller = _config(tiny_data, 6, FOUR, **cfg)
    assert smaller.parallel.grad_accum == 4
    put, rows = loop._global_batch, []
    monkeypatch.setattr(loop, "_global_batch", lambda local, model, n: (
        rows.append(n), put(local, model, n))[1])
    resumed = run(smaller, split, jax.devices()[:4])
    assert sorted(set(rows)) == [2, 8]  # eval micro-batches: 2 rows (1 per replica); steps: 8
    assert (resumed.start_step, resumed.step) == (3, 6)
    a, b = _losses(full), _losses(split)
    assert sorted(b) == list(range(1, 7))
    assert [a[k] for k in (1, 2, 3)] == [b[k] for k in (1, 2, 3)]
    assert rel_err([b[k] for k in (4, 5, 6)], [a[k] for k in (4, 5, 6)]) <= 1e-5
    assert abs(resumed.eval_loss - ref.eval_loss) <= 1e-5 * ref.eval_loss
