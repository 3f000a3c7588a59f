"""The training loop: restore-or-init, jitted steps, logging, eval, checkpoints, signals.

Flow: mesh -> dataset -> sharded model + optimizer -> restore the newest intact checkpoint (or
initialise from the seed) -> compile the step ahead of time -> loop. Metrics of step ``n`` are
read back after step ``n + 1`` has been dispatched, so the host never stalls the device.
SIGTERM/SIGINT stop the loop after the current step and write a checkpoint first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from boost_jax.analysis.flops import peak_flops, train_flops_per_token
from boost_jax.config import Config, ConfigError
from boost_jax.data.pipeline import eval_batches, open_dataset_on_all, train_iterator
from boost_jax.parallel.mesh import local_batch_rows, make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.train.checkpoint import Checkpointer
from boost_jax.train.metrics import MetricsWriter, progress_line
from boost_jax.train.optim import Optimizer, make_optimizer
from boost_jax.train.step import (
    abstract_state,
    compile_train_step,
    from_checkpoint_layout,
    init_state,
    make_eval_step,
    to_checkpoint_layout,
)


@dataclasses.dataclass
class Summary:
    """What a run did (returned by :func:`run`)."""

    start_step: int
    step: int
    final_loss: float | None
    eval_loss: float | None
    interrupted_by: int | None  # signal number, if a signal stopped the run
    checkpoint_dir: str
    metrics_file: str

    @property
    def eval_ppl(self) -> float | None:
        return None if self.eval_loss is None else math.exp(self.eval_loss)


class _Stop:
    """Records SIGTERM/SIGINT so the loop can checkpoint and leave cleanly."""

    def __init__(self):
        self.signum: int | None = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def _check_resume(meta: dict, config: Config) -> None:
    """Refuse a checkpoint of another model; warn about changes that alter the run."""
    saved = meta.get("config", {})
    model = saved.get("Model")
    now = config.to_dict()
    if model is not None and model != now["Model"]:
        diff = sorted(k for k in model if model[k] != now["Model"].get(k))
        raise ConfigError(f"the checkpoint was written for another model (Model.{diff[0]}="
                          f"{model[diff[0]]!r}, now {now['Model'][diff[0]]!r}); use a new "
                          "--workdir")
    for group, keys in (("Train", ("seed", "batch_size", "seq_len", "schedule_steps")),
                        ("Data", ("path", "tokenizer", "packing", "packing_bins"))):
        for k in keys:
            old, new = saved.get(group, {}).get(k), now[group][k]
            if old is not None and old != new:
                logging.warning("resuming with %s.%s=%r (the checkpoint used %r): the run will "
                                "not match an uninterrupted one", group, k, new, old)
    old_h = saved.get("Train", {}).get("schedule_steps") or saved.get("Train", {}).get("steps")
    if old_h is not None and old_h != config.train.horizon:
        logging.warning("the learning-rate schedule now decays over %d steps (it was %d); set "
                        "Train.schedule_steps to keep one schedule across runs",
                        config.train.horizon, old_h)


def _global_batch(local: dict, model: ShardedModel, global_batch: int) -> dict:
    return {k: jax.make_array_from_process_local_data(model.batch_sharding, v,
                                                      (global_batch, v.shape[1]))
            for k, v in local.items()}


def _write_config(workdir: Path, config: Config) -> None:
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    (workdir / "config.gin").write_text(gin.config_str())


class _Reporter:
    """Reads a step's metrics back from the device and logs them with step time, throughput
    and MFU (the time of step n is the gap between the completions of steps n-1 and n)."""

    def __init__(self, writer: MetricsWriter, total: int, log_every: int, tokens: int,
                 flops_per_device: float, peak: float | None):
        self.writer, self.total, self.log_every = writer, total, log_every
        self.tokens, self.flops, self.peak = tokens, flops_per_device, peak
        self.last_done, self.last_loss = time.perf_counter(), None

    def __call__(self, step: int, metrics: dict) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        dt, self.last_done = now - self.last_done, now
        values.update(step_time=dt, tokens_per_sec=self.tokens / dt,
                      tflops_per_device=self.flops / dt / 1e12,
                      mfu=None if self.peak is None else self.flops / dt / self.peak)
        self.last_loss = values["loss"]
        self.writer.write(step, values)
        if step % self.log_every == 0 or step == self.total:
            logging.info(progress_line(step, self.total, values))


def _restore_or_init(ckpt: Checkpointer, model: ShardedModel, opt: Optimizer, config: Config,
                     train_it) -> tuple[dict, int]:
    restored = ckpt.restore_latest(abstract_state(model, opt, canonical=True),
                                   check_meta=lambda saved: _check_resume(saved, config))
    if restored is not None:
        state, meta = from_checkpoint_layout(model, opt, restored[0]), restored[1]
        train_it.set_state(meta["data_state"])
        start = int(jax.device_get(state["step"]))
        logging.info("resumed from %s at step %d", ckpt.directory / str(start), start)
        return state, start
    m = config.model
    n_params = sum(math.prod(d.shape) for d in model.defs.values())
    logging.info("initialised %s/%s (%s parameters) from seed %d", m.arch, m.size,
                 f"{n_params:,}", config.train.seed)
    return init_state(model, opt, config.train.seed), 0


def run(config: Config, workdir: str | Path, devices: Sequence[jax.Device] | None = None,
        checkpoint_async: bool = True) -> Summary:
    """Train (or resume training) ``config`` in ``workdir``; see the module docstring."""
    t_start = time.perf_counter()
    workdir = Path(workdir).absolute()
    m_cfg, t_cfg = config.model, config.train
    pi, pc = jax.process_index(), jax.process_count()
    mesh = make_mesh(config.parallel, devices)
    dataset = open_dataset_on_all(config.data)
    if dataset.vocab_size > m_cfg.vocab_size:
        raise ConfigError(f"Model.vocab_size={m_cfg.vocab_size} is smaller than the vocabulary "
                          f"of the dataset's tokenizer ({dataset.vocab_size})")
    model = ShardedModel(m_cfg, config.parallel, mesh, jnp.dtype(t_cfg.dtype))
    opt = make_optimizer(t_cfg)
    rows = local_batch_rows(mesh, t_cfg.batch_size)
    train_it = train_iterator(dataset, t_cfg.seq_len, t_cfg.batch_size, t_cfg.seed, rows,
                              config.data.worker_count)
    evals = [_global_batch(b, model, t_cfg.batch_size) for b in
             eval_batches(dataset, t_cfg.seq_len, t_cfg.batch_size, t_cfg.eval_batches, rows)]
    if pi == 0:
        workdir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(workdir / "checkpoints", t_cfg.keep_checkpoints, checkpoint_async)
    meta = {"config": config.to_dict(), "process_count": pc,
            "worker_count": config.data.worker_count}  # + "data_state" at every save
    state, start = _restore_or_init(ckpt, model, opt, config, train_it)
    if pi == 0:
        _write_config(workdir, config)
    writer = MetricsWriter(workdir, start, enabled=pi == 0)

    t0 = time.perf_counter()
    step_fn = compile_train_step(model, opt, t_cfg.batch_size, t_cfg.seq_len,
                                 config.data.packing == "document")
    eval_fn = make_eval_step(model)
    tokens = t_cfg.batch_size * t_cfg.seq_len
    device_kind = mesh.devices.flat[0].device_kind
    logging.info("compiled the train step in %.1f s; %d steps of %d tokens on a %s mesh of %s",
                 time.perf_counter() - t0, t_cfg.steps, tokens, dict(mesh.shape), device_kind)
    peak = peak_flops(device_kind, t_cfg.dtype, t_cfg.peak_tflops)
    report = _Reporter(writer, t_cfg.steps, t_cfg.log_every, tokens,
                       train_flops_per_token(m_cfg, t_cfg.seq_len) * tokens / mesh.size, peak)

    def evaluate(step: int) -> float | None:
        if not evals:
            return None
        loss = float(np.mean([jax.device_get(eval_fn(state["params"], b)) for b in evals]))
        writer.write(step, {"eval_loss": loss, "eval_ppl": math.exp(loss)}, prefix="eval")
        logging.info("eval at step %d: loss %.4f, perplexity %.2f", step, loss, math.exp(loss))
        return loss

    # metrics of step n are read after step n+1 is dispatched: the host never stalls the device
    step, pending, eval_loss = start, None, None
    with _Stop() as stop:
        while step < t_cfg.steps and stop.signum is None:
            batch = _global_batch(next(train_it), model, t_cfg.batch_size)
            state, metrics = step_fn(state, batch)
            step += 1
            if pending is not None:
                report(*pending)
            pending = (step, metrics)
            if step % t_cfg.checkpoint_every == 0 and step < t_cfg.steps:
                ckpt.save(step, to_checkpoint_layout(model, opt, state),
                          {**meta, "data_state": train_it.get_state()})
            if step % t_cfg.eval_every == 0 and step < t_cfg.steps:
                report(*pending)
                pending, eval_loss = None, evaluate(step)
        if pending is not None:
            report(*pending)
        interrupted = stop.signum
    ckpt.save(step, to_checkpoint_layout(model, opt, state),
              {**meta, "data_state": train_it.get_state()}, wait=True)
    if interrupted is not None:
        logging.warning("stopped by signal %d after step %d; checkpoint saved -- rerun the same "
                        "command to resume", interrupted, step)
    elif step > start or eval_loss is None:
        eval_loss = evaluate(step)
    ckpt.close()
    writer.close()
    summary = Summary(start, step, report.last_loss, eval_loss, interrupted,
                      str(ckpt.directory), str(writer.path))
    if pi == 0:
        ppl = "n/a" if summary.eval_ppl is None else f"{summary.eval_ppl:.2f}"
        loss = "n/a" if summary.final_loss is None else f"{summary.final_loss:.4f}"
        logging.info("done: steps %d->%d, final train loss %s, eval perplexity %s, %.0f s",
                     start, step, loss, ppl, time.perf_counter() - t_start)
        logging.info("checkpoints: %s", summary.checkpoint_dir)
        logging.info("metrics: %s (TensorBoard: %s)", summary.metrics_file,
                     workdir / "tensorboard")
    return summary
