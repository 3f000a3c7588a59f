"""The training loop: restore-or-init, jitted steps, logging, eval, checkpoints, signals.

Flow (:class:`_Run`, one method a step): mesh -> dataset -> sharded model + optimizer ->
restore the newest intact checkpoint (or initialise from the seed) -> compile the step ahead
of time -> train -> final checkpoint, eval and (``Train.sample_every``) greedy samples. Metrics
of step ``n`` are read back after step ``n + 1`` has been dispatched, so the host never stalls
the device; step time excludes eval, sample and checkpoint time. A step whose loss or
gradient norm is not finite is never applied (inside the jitted step); ``Train.nonfinite``
then stops the run without a final checkpoint or skips the step (at most ``Train.max_skips``
in a row).

Stopping is agreed: SIGTERM/SIGINT only set a flag, which the next dispatched step carries in
its gradient-norm all-reduce (train/step.py :func:`stop_flags`). Every process reads the
summed flags in the metrics of the same step ``n``, leaves the loop after step ``n + 1`` (at
most two steps after the signal), saves the same checkpoint and exits with the signal's code,
however many of them received it and when. A second signal ends the process at once, without
a checkpoint (train/signals.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import logging

from boost_jax.analysis.flops import peak_flops, train_flops_per_token
from boost_jax.config import Config, ConfigError, Train
from boost_jax.data.pipeline import eval_batches, open_dataset_on_all, train_iterator
from boost_jax.data.prepare import eval_split_label
from boost_jax.gin_io import operative_gin
from boost_jax.parallel.mesh import local_batch_rows, make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.train import data_state
from boost_jax.train.checkpoint import Checkpointer
from boost_jax.train.metrics import MetricsWriter
from boost_jax.train.optim import make_optimizer
from boost_jax.train.progress import Window, compiling, duration, say
from boost_jax.train.resume import check_resume
from boost_jax.train.samples import Sampler, check_sample_size, host_params
from boost_jax.train.signals import StopRequest
from boost_jax.train.step import (
    abstract_state,
    compile_train_step,
    evaluate,
    from_checkpoint_layout,
    init_state,
    make_eval_step,
    stop_flags,
    to_checkpoint_layout,
)


@dataclasses.dataclass
class Summary:
    """What a run did (returned by :func:`run`)."""

    start_step: int
    step: int
    final_loss: float | None
    eval_loss: float | None
    interrupted_by: int | None  # the agreed signal number, if a signal stopped the run
    checkpoint_dir: str
    metrics_file: str
    diverged: str | None = None  # why the non-finite policy stopped the run

    @property
    def eval_ppl(self) -> float | None:
        return None if self.eval_loss is None else math.exp(self.eval_loss)


def _global_batch(local: dict, model: ShardedModel, global_batch: int) -> dict:
    return {k: jax.make_array_from_process_local_data(model.batch_sharding, v,
                                                      (global_batch, v.shape[1]))
            for k, v in local.items()}


def _write_config(workdir: Path, config: Config) -> None:
    """``config.json`` and ``config.gin``: every field's value (``--gin_file`` takes it)."""
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    (workdir / "config.gin").write_text(operative_gin(config))


class Diverged(RuntimeError):
    """The loss or gradient norm stopped being finite (``Train.nonfinite``)."""


class _Reporter:
    """Reads a step's metrics back from the device, records them with step time, throughput
    and MFU, prints a progress line every ``Train.log_every`` steps, and applies the
    non-finite policy.

    One clock: the time of step ``n`` is the gap between the completions of steps ``n-1`` and
    ``n``, less the time spent in :meth:`paused` blocks (eval, checkpoint saves) in between.
    """

    def __init__(self, writer: MetricsWriter, train: Train, tokens: int,
                 flops_per_device: float, peak: float | None):
        self.writer, self.train = writer, train
        self.tokens, self.flops, self.peak = tokens, flops_per_device, peak
        self.window = Window(train.steps, tokens, flops_per_device, peak)
        self.last_done, self.excluded, self.last_loss = time.perf_counter(), 0.0, None
        self.skipped_in_a_row, self.skipped = 0, 0

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start

    def __call__(self, step: int, metrics: dict) -> int:
        """Log step ``step``'s metrics; returns the agreed stop signal (0: go on)."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        signum = int(values.pop("stop_signal"))
        now = time.perf_counter()
        dt = now - self.last_done - self.excluded
        self.last_done, self.excluded = now, 0.0
        values.update(step_time=dt, tokens_per_sec=self.tokens / dt,
                      tflops_per_device=self.flops / dt / 1e12,
                      mfu=None if self.peak is None else self.flops / dt / self.peak)
        self._check_finite(step, values)
        self.last_loss = values["loss"]
        self.writer.write(step, values)
        self.window.add(dt)
        if step % self.train.log_every == 0 or step == self.train.steps:
            say(self.window.line(step, values["loss"]))
        return signum

    def _check_finite(self, step: int, values: dict) -> None:
        """Count a skipped step; raise :class:`Diverged` when the policy says stop."""
        if not values["nonfinite"]:
            self.skipped_in_a_row = 0
            return
        self.skipped += 1
        self.skipped_in_a_row += 1
        values["skipped_total"] = self.skipped
        what = f"step {step}: loss {values['loss']}, gradient norm {values['grad_norm']}"
        if self.train.nonfinite == "stop":
            raise Diverged(f"{what} (Train.nonfinite='stop'); the step was not applied and "
                           "no checkpoint was written after it")
        if self.skipped_in_a_row > self.train.max_skips:
            raise Diverged(f"{what}: {self.skipped_in_a_row} steps in a row skipped, more "
                           f"than Train.max_skips={self.train.max_skips}")
        logging.warning("%s: not finite, step skipped (parameters and optimizer state "
                        "unchanged; %d in a row)", what, self.skipped_in_a_row)


class _Run:
    """One run's parts, and the named steps of the loop: restore, step, report, evaluate,
    sample, checkpoint, finish."""

    def __init__(self, config: Config, workdir: Path, devices, checkpoint_async: bool):
        t = config.train
        check_sample_size(config.model, t)  # before anything is built or compiled
        self.config, self.workdir, self.t = config, workdir, t
        mesh = make_mesh(config.parallel, devices)
        dataset = open_dataset_on_all(config.data)
        if dataset.vocab_size > config.model.vocab_size:
            raise ConfigError(f"Model.vocab_size={config.model.vocab_size} is smaller than the "
                              f"vocabulary of the dataset's tokenizer ({dataset.vocab_size})")
        self.model = ShardedModel(config.model, config.parallel, mesh, jnp.dtype(t.dtype),
                                  max_segments=config.data.max_segments)
        self.opt = make_optimizer(t, self.model)
        self.rows = rows = local_batch_rows(mesh, t.batch_size)
        self.train_it = train_iterator(dataset, t.seq_len, t.batch_size, t.seed, rows,
                                       config.data.worker_count)
        self.evals = [self.global_batch(b) for b in
                      eval_batches(dataset, t.seq_len, t.batch_size, t.eval_batches, rows)]
        self.eval_split = eval_split_label(dataset.meta)
        self.lead = jax.process_index() == 0
        self.sampler = Sampler(t, dataset.path) if t.sample_every else None
        if self.lead:
            workdir.mkdir(parents=True, exist_ok=True)
        self.ckpt = Checkpointer(workdir / "checkpoints", t.keep_checkpoints, checkpoint_async)
        self.meta = {"config": config.to_dict(), "process_count": jax.process_count(),
                     "worker_count": config.data.worker_count}  # + "data_state" at each save

    def _check_meta(self, meta: dict) -> None:
        """Refuse a checkpoint this run cannot resume exactly (train/resume.py,
        train/data_state.py) before any array is read."""
        where = str(self.ckpt.directory)
        check_resume(meta.get("config", {}), self.config, where)
        data_state.position(meta, self.rows, self.config.data.packing, where)

    def global_batch(self, local: dict) -> dict:
        return _global_batch(local, self.model, self.t.batch_size)

    def restore(self, fresh_start: bool = False) -> tuple[dict, int]:
        """The newest intact checkpoint's state (and data position), else a fresh one --
        which a workdir whose checkpoints all turned out damaged gets only with
        ``fresh_start`` (else :class:`ConfigError`)."""
        model, opt = self.model, self.opt
        restored = self.ckpt.restore_latest(abstract_state(model, opt, canonical=True),
                                            check_meta=self._check_meta)
        if restored is not None:
            state = from_checkpoint_layout(model, opt, restored.state)
            self.train_it.set_state(data_state.position(
                restored.meta, self.rows, self.config.data.packing, str(self.ckpt.directory)))
            say(f"resumed from {self.ckpt.directory / str(restored.step)} at step "
                f"{restored.step}")
            return state, restored.step
        if self.ckpt.quarantined and not fresh_start:
            names = ", ".join(p.name for p in self.ckpt.quarantined)
            raise ConfigError(f"no usable checkpoint in {self.ckpt.directory}: every one was "
                              f"damaged and moved aside ({names}); rerun with --fresh_start to "
                              "train from step 0 in this workdir")
        m = self.config.model
        n_params = sum(math.prod(d.shape) for d in model.defs.values())
        say(f"initialised {m.arch}/{m.size} ({n_params:,} parameters) from seed {self.t.seed}")
        return init_state(model, opt, self.t.seed), 0

    def compile(self, start: int) -> None:
        """Compile the steps; open the metrics (from ``start``)."""
        t, mesh = self.t, self.model.mesh
        if self.lead:
            _write_config(self.workdir, self.config)
        self.writer = MetricsWriter(self.workdir, start, enabled=self.lead)
        tokens = t.batch_size * t.seq_len
        kind = mesh.devices.flat[0].device_kind
        with compiling("the train step"):
            self.step_fn = compile_train_step(self.model, self.opt, t.batch_size, t.seq_len,
                                              self.config.data.packing == "document")
        self.eval_fn = make_eval_step(self.model)
        say(f"training steps {start + 1}..{t.steps} of {tokens:,} tokens on a "
            f"{' x '.join(f'{k}={v}' for k, v in mesh.shape.items())} mesh of {kind}")
        if self.evals:
            say(f"evaluating {len(self.evals)} batch(es) of the eval split: {self.eval_split}")
        flops = train_flops_per_token(self.config.model, t.seq_len) * tokens / mesh.size
        self.report = _Reporter(self.writer, t, tokens, flops,
                                peak_flops(kind, t.dtype, t.peak_tflops))

    def evaluate(self, step: int, params: dict) -> float | None:
        if not self.evals:
            return None
        with self.report.paused():
            loss = evaluate(self.eval_fn, params, self.evals).loss
        self.writer.write(step, {"eval_loss": loss, "eval_ppl": math.exp(loss)}, prefix="eval")
        say(f"eval at step {step}: loss {loss:.4f}, perplexity {math.exp(loss):.2f}")
        return loss

    def sample(self, step: int, params: dict) -> None:
        """Greedy continuations of ``Train.sample_prompts`` (``Train.sample_tokens`` each, up
        to the end-of-text token) from ``params``, on one device in ``Train.dtype``: a
        ``samples`` line in the metrics, TensorBoard text and a line each on stdout. Every
        process takes part in gathering the parameters; process 0 generates and writes."""
        with self.report.paused():
            host = host_params(self.model, params)
            if not self.lead:
                return
            texts = self.sampler.texts(self.config.model, host)
        self.writer.write_text(step, "samples", texts)
        for text in texts:
            say(f"sample at step {step}: {text!r}")

    def checkpoint(self, step: int, state: dict, wait: bool = False) -> None:
        with self.report.paused():
            position = data_state.gather(self.train_it.get_state(), self.rows)
            self.ckpt.save(step, to_checkpoint_layout(self.model, self.opt, state),
                           {**self.meta, "data_state": position}, wait=wait)

    def train(self, state: dict, start: int, stop: StopRequest) -> tuple[dict, int, float | None]:
        """Steps until ``Train.steps`` or an agreed stop (:attr:`signal`). Metrics of step
        ``n`` are read after step ``n + 1`` is dispatched, so the host never stalls the
        device. Returns ``(state, step, the last eval loss)``; raises :class:`Diverged` by the
        non-finite policy."""
        t = self.t
        step, pending, eval_loss = start, None, None
        self.step = start  # the last step dispatched (read if the policy stops the run)
        self.signal = 0  # the agreed stop signal, the same on every process
        flags = {}  # the stop input per local signal, built once

        def due(every: int) -> bool:
            return step % every == 0 and step < t.steps

        def flush() -> None:
            """Read the pending step's metrics; also before a pause that waits for the step
            (checkpoint, eval, samples), so its time is counted as the step's."""
            nonlocal pending
            if pending is not None:
                signum = self.report(*pending)
                self.signal = self.signal or signum
            pending = None

        while step < t.steps and not self.signal:
            signum = stop.signum  # read once: a signal may arrive at any moment
            if signum not in flags:
                flags[signum] = stop_flags(self.model, signum)
            batch = self.global_batch(next(self.train_it))
            state, metrics = self.step_fn(state, batch, flags[signum])
            step = self.step = step + 1
            flush()
            pending = (step, metrics)
            save, evaluate = due(t.checkpoint_every), due(t.eval_every)
            show = bool(t.sample_every) and due(t.sample_every)
            if save or evaluate or show:
                flush()
            if self.signal:  # the run's end saves this step
                break
            if save:
                self.checkpoint(step, state)
            if evaluate:
                eval_loss = self.evaluate(step, state["params"])
            if show:
                self.sample(step, state["params"])
        flush()
        return state, step, eval_loss

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()


def _check_writable(workdir: Path) -> None:
    """Create ``workdir`` if needed and write a file there, before any work is done."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(f"--workdir={workdir} is not writable ({err.strerror or err}); "
                          "choose another --workdir") from None


def _nothing_to_do(r: _Run, step: int) -> Summary:
    """A finished run rerun: nothing is trained, evaluated or written."""
    r.ckpt.close()
    say(f"nothing to do: {r.workdir} is already trained to step {step} (Train.steps="
        f"{r.t.steps}); raise Train.steps, and pin Train.schedule_steps, to train further")
    return Summary(step, step, None, None, None, str(r.ckpt.directory),
                   str(r.workdir / "metrics.jsonl"))


def run(config: Config, workdir: str | Path, devices: Sequence[jax.Device] | None = None,
        checkpoint_async: bool = True, fresh_start: bool = False) -> Summary:
    """Train (or resume training) ``config`` in ``workdir``; see the module docstring.

    ``fresh_start``: initialise from the seed when the workdir's checkpoints are all damaged
    (else that is a :class:`ConfigError`). Raises :class:`CheckpointWriteError` when a save
    fails."""
    t_start, workdir = time.perf_counter(), Path(workdir).absolute()
    _check_writable(workdir)
    with StopRequest() as stop:  # until the last checkpoint is written (train/signals.py)
        r = _Run(config, workdir, devices, checkpoint_async)
        state, start = r.restore(fresh_start)
        if start >= config.train.steps:
            return _nothing_to_do(r, start)
        r.compile(start)
        diverged = None
        try:
            state, step, eval_loss = r.train(state, start, stop)
        except Diverged as err:  # nothing is saved over the last good checkpoint
            diverged, step, eval_loss = str(err), r.step, None
        interrupted = r.signal or None
        if diverged is None:
            r.checkpoint(step, state, wait=True)
            if interrupted is not None:
                logging.warning("stopped by signal %d after step %d; checkpoint saved -- rerun "
                                "the same command to resume", interrupted, step)
            else:
                eval_loss = r.evaluate(step, state["params"])
                if config.train.sample_every:
                    r.sample(step, state["params"])
        r.close()
    summary = Summary(start, step, r.report.last_loss, eval_loss, interrupted,
                      str(r.ckpt.directory), str(r.writer.path), diverged)
    if diverged is not None:
        logging.error("training diverged: %s", diverged)
    elif r.lead:
        ppl = "n/a" if summary.eval_ppl is None else f"{summary.eval_ppl:.2f}"
        loss = "n/a" if summary.final_loss is None else f"{summary.final_loss:.4f}"
        say(f"done: steps {start}->{step}, final train loss {loss}, eval perplexity {ppl}, "
            f"{duration(time.perf_counter() - t_start)}")
        say(f"checkpoints: {summary.checkpoint_dir}")
        say(f"metrics: {summary.metrics_file} (TensorBoard: {r.workdir / 'tensorboard'})")
    return summary
