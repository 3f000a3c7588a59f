"""The training loop: restore-or-init, jitted steps, logging, eval, checkpoints, signals.

Flow (:class:`_Run`, one method a step): mesh -> dataset -> sharded model + optimizer ->
restore the newest intact checkpoint (or initialise from the seed) -> compile the step ahead
of time -> train -> final checkpoint, eval and (``Train.sample_every``) greedy samples. Metrics
of step ``n`` are read back after step ``n + 1`` has been dispatched, so the host never stalls
the device, and the next ``Data.device_prefetch`` batches are put on the devices by a
background thread while a step runs (data/loader.py); step time excludes eval, sample and
checkpoint time. A step whose loss or gradient norm is not finite is never applied (inside the
jitted step); ``Train.nonfinite`` then stops the run without a final checkpoint or skips the
step (at most ``Train.max_skips`` in a row).

Stopping is agreed: SIGTERM/SIGINT only set a flag, which the next dispatched step carries in
its gradient-norm all-reduce (train/step.py :func:`stop_flags`). Every process reads the
summed flags in the metrics of the same step ``n``, leaves the loop after step ``n + 1`` (at
most two steps after the signal), saves the same checkpoint and exits with the signal's code,
however many of them received it and when. A second signal ends the process at once, without
a checkpoint (operations/signals.py). The handlers are the entry point's (commands/train.py passes
its :class:`StopRequest`); called from Python, :func:`run` installs none.

Operating a run: each step's report and the pauses feed the goodput account
(train/reporter.py, operations/goodput.py) and the hang watchdog (operations/watchdog.py), which
watches
the training loop only; ``Train.profile_steps`` steps are traced (operations/profiling.py). With
the checkpoints on an object store, the run's small files (config, metrics) are copied beside
them, and a fresh workdir starts from those copies (checkpointing/run_files.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import logging

from boost_jax.analysis.flops import peak_flops, train_flops_per_token
from boost_jax.checkpointing import lease, record
from boost_jax.checkpointing.checkpointer import Checkpointer
from boost_jax.checkpointing.run_files import RunFiles
from boost_jax.config import Config, ConfigError
from boost_jax.data.loader import (
    check_vocab,
    eval_batches,
    open_dataset_on_all,
    train_iterator,
)
from boost_jax.data.prepare import eval_split_label
from boost_jax.gin_io import operative_gin
from boost_jax.operations import workdir as workdirs
from boost_jax.operations import workdir_lock
from boost_jax.operations.disk_errors import writing
from boost_jax.operations.goodput import Goodput, read_history
from boost_jax.operations.profiling import StepProfiler
from boost_jax.operations.progress import compiling, say
from boost_jax.operations.signals import StopRequest
from boost_jax.operations.watchdog import Watchdog
from boost_jax.optim import make_optimizer
from boost_jax.parallel.mesh import local_batch_rows, make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.train import data_state
from boost_jax.train.eval_loss import evaluate, make_eval_step
from boost_jax.train.metrics import MetricsWriter
from boost_jax.train.reporter import Diverged
from boost_jax.train.reporter import Reporter as _Reporter
from boost_jax.train.resume import check_data, check_resume
from boost_jax.train.samples import Sampler, check_sample_size, host_params
from boost_jax.train.step import (
    abstract_state,
    compile_train_step,
    from_checkpoint_layout,
    init_state,
    stop_flags,
    to_checkpoint_layout,
)
from boost_jax.train.summary import Summary, report
from boost_jax.train.wandb_logger import WandbRun, check_available


def _global_batch(local: dict, model: ShardedModel, global_batch: int) -> dict:
    return {k: jax.make_array_from_process_local_data(model.batch_sharding, v,
                                                      (global_batch, v.shape[1]))
            for k, v in local.items()}


def _micro_parts(local: dict, k: int) -> list[dict]:
    """An eval batch cut as the train step cuts its batch (train/step.py ``accumulate``):
    part ``i`` takes rows ``i, i + k, ...`` of this process's rows, so each data shard
    evaluates ``1/k`` of its rows at a time -- what it trains on per micro-step."""
    return [{name: v[i::k] for name, v in local.items()} for i in range(k)]


def _write_config(workdir: Path, config: Config) -> None:
    """``config.json`` and ``config.gin``: every field's value (``--gin_file`` takes it)."""
    with writing(workdir / "config.json"):
        (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    with writing(workdir / "config.gin"):
        (workdir / "config.gin").write_text(operative_gin(config))


class _Run:
    """One run's parts, and the named steps of the loop: restore, step, report, evaluate,
    sample, checkpoint, finish."""

    def __init__(self, config: Config, workdir: Path, devices, checkpoint_async: bool,
                 goodput: Goodput, checkpoint_dir: str | None = None,
                 allow_data_change: bool = False, on_hang: Callable[[int], object] | None = None):
        t = config.train
        check_sample_size(config.model, t)  # before anything is built or compiled
        check_available(t.wandb)
        self.config, self.workdir, self.t = config, workdir, t
        mesh = make_mesh(config.parallel, devices)
        dataset = open_dataset_on_all(config.data)
        check_vocab(config.model.vocab_size, config.data, dataset.ids_used)
        self.model = ShardedModel(config.model, config.parallel, mesh, jnp.dtype(t.dtype),
                                  max_segments=config.data.segment_bound)
        self.opt = make_optimizer(t, self.model)
        self.rows = rows = local_batch_rows(mesh, t.batch_size)
        self.train_it = train_iterator(dataset, t.seq_len, t.batch_size, t.seed, rows,
                                       config.data.worker_count, put=self.global_batch,
                                       prefetch=config.data.device_prefetch)
        k = config.parallel.grad_accum  # the evaluation's micro-batches are the steps'
        self.evals = [self.global_batch(part, t.batch_size // k) for b in
                      eval_batches(dataset, t.seq_len, t.batch_size, t.eval_batches, rows)
                      for part in _micro_parts(b, k)]
        self.eval_split = eval_split_label(dataset.meta)
        self.lead, self.goodput = jax.process_index() == 0, goodput
        self.profiler = StepProfiler(t, workdir, jax.process_index(), jax.process_count())
        self.watchdog = Watchdog(t.hang_timeout_s, workdir, jax.process_index(), exit=on_hang)
        self.sampler = Sampler(t, dataset.path) if t.sample_every else None
        if self.lead:
            workdir.mkdir(parents=True, exist_ok=True)
        self.writer: MetricsWriter | None = None  # opened by compile()
        self.closed = False
        self.ckpt = Checkpointer(checkpoint_dir or workdir / "checkpoints", t.keep_checkpoints,
                                 checkpoint_async)
        self.run_files = RunFiles(workdir, self.ckpt.directory, enabled=self.lead)
        self.meta = {"config": config.to_dict(), "process_count": jax.process_count(),
                     "worker_count": config.data.worker_count,
                     "data_fingerprint": dataset.fingerprint}  # + "data_state" at each save
        self.allow_data_change, self.data_change = allow_data_change, None

    def _check_meta(self, meta: dict) -> None:
        """Refuse a checkpoint this run cannot resume exactly (train/resume.py,
        train/data_state.py) before any array is read."""
        where = str(self.ckpt.directory)
        check_resume(meta.get("config", {}), self.config, where)
        self.data_change = check_data(meta, self.meta["data_fingerprint"],
                                      self.config.data.path, where, self.allow_data_change)
        self._position(meta, where)

    def _position(self, meta: dict, where: str) -> dict:
        """This process's data position in a checkpoint (train/data_state.py)."""
        data = self.config.data
        return data_state.position(meta, self.rows, data.packing, where, data_state.same_groups(
            meta, self.t.batch_size, data.packing_bins))

    def global_batch(self, local: dict, rows: int | None = None) -> dict:
        """``local`` (this process's rows) on the devices, as a global batch of ``rows``
        (default ``Train.batch_size``) split on ``data``."""
        return _global_batch(local, self.model, rows or self.t.batch_size)

    def restore(self, fresh_start: bool = False) -> tuple[dict, int]:
        """The newest intact checkpoint's state (and data position), else a fresh one --
        which a workdir whose checkpoints all turned out damaged gets only with
        ``fresh_start`` (else :class:`ConfigError`)."""
        model, opt = self.model, self.opt
        with self.goodput.timed("checkpoint"):
            restored = self.ckpt.restore_latest(abstract_state(model, opt, canonical=True),
                                                check_meta=self._check_meta)
        if restored is not None:
            state = from_checkpoint_layout(model, opt, restored.state)
            self.train_it.set_state(self._position(restored.meta, str(self.ckpt.directory)))
            say(f"resumed from {self.ckpt.directory / str(restored.step)} at step "
                f"{restored.step}")
            return state, restored.step
        if self.ckpt.quarantined and not fresh_start:
            names = ", ".join(p.name for p in self.ckpt.quarantined)
            raise ConfigError(f"no usable checkpoint in {self.ckpt.directory}: every one was "
                              f"damaged and moved aside ({names}); rerun with --fresh_start to "
                              "train from step 0 in this workdir")
        if not self.ckpt.quarantined:
            record.refuse_a_silent_restart(self.workdir, self.ckpt.directory,
                                                      fresh_start)
        m = self.config.model
        n_params = sum(math.prod(d.shape) for d in model.defs.values())
        say(f"initialised {m.arch}/{m.size} ({n_params:,} parameters) from seed {self.t.seed}")
        return init_state(model, opt, self.t.seed), 0

    def compile(self, start: int) -> None:
        """Compile the steps; open the metrics (from ``start``), taking over the goodput
        account of the run's history (operations/goodput.py)."""
        t, mesh = self.t, self.model.mesh
        if self.lead:  # (the time of the processes before, read before the rewind)
            self.run_files.fetch()  # on a fresh node: the history kept beside the checkpoints
            _write_config(self.workdir, self.config)
            self.goodput.resume(read_history(self.workdir / "metrics.jsonl"), start)
        wandb = (WandbRun(self.workdir, self.config.to_dict(), t.wandb_project, t.wandb_name)
                 if self.lead and t.wandb else None)
        self.writer = MetricsWriter(self.workdir, start, enabled=self.lead, wandb=wandb)
        tokens = t.batch_size * t.seq_len
        kind = mesh.devices.flat[0].device_kind
        with self.goodput.timed("compile"), compiling("the train step"):
            self.step_fn = compile_train_step(self.model, self.opt, t.batch_size, t.seq_len,
                                              self.config.data.packed,
                                              group_rows=t.loss_group_rows)
        self.eval_fn = make_eval_step(self.model)
        say(f"training steps {start + 1}..{t.steps} of {tokens:,} tokens on a "
            f"{' x '.join(f'{k}={v}' for k, v in mesh.shape.items())} mesh of {kind}")
        if self.evals:
            k = self.config.parallel.grad_accum
            each = f", {k} micro-batches each" if k > 1 else ""
            say(f"evaluating {len(self.evals) // k} batch(es) of the eval split{each}: "
                f"{self.eval_split}")
        flops = train_flops_per_token(self.config.model, t.seq_len) * tokens / mesh.size
        if start:  # the time inherited, kept should this process die before its next record
            self.writer.write(start, self.goodput.record(), prefix="")
        if self.data_change:  # --allow_data_change: the run's history says so
            self.writer.write_text(start, "data_changed", list(self.data_change), prefix="")
        self.report = _Reporter(self.writer, t, tokens, flops,
                                peak_flops(kind, t.dtype, t.peak_tflops), self.goodput,
                                self.watchdog)
        self.run_files.upload()

    def evaluate(self, step: int, params: dict) -> float | None:
        if not self.evals:
            return None
        with self.report.paused("eval"):
            totals = evaluate(self.eval_fn, params, self.evals, None, self.t.loss_group_rows)
        loss, cola = totals.loss, totals.cola_loss  # the two definitions: docs/guides/eval.md
        self.writer.write(step, {"eval_loss": loss, "eval_ppl": math.exp(loss),
                                 "eval_cola_loss": cola}, prefix="eval")
        say(f"eval at step {step}: loss {loss:.4f}, perplexity {math.exp(loss):.2f} (token "
            f"mean); the low-rank papers' definition {cola:.4f}, {math.exp(cola):.2f} (the "
            f"{totals.groups} batches' means over {totals.groups + 1})")
        return loss

    def sample(self, step: int, params: dict) -> None:
        """Greedy continuations of ``Train.sample_prompts`` (``Train.sample_tokens`` each, up
        to the end-of-text token) from ``params``, on one device in ``Train.dtype``: a
        ``samples`` line in the metrics, TensorBoard text and a line each on stdout. Every
        process takes part in gathering the parameters; process 0 generates and writes."""
        with self.report.paused("eval"):
            host = host_params(self.model, params)
            if not self.lead:
                return
            texts = self.sampler.texts(self.config.model, host)
        self.writer.write_text(step, "samples", texts)
        for text in texts:
            say(f"sample at step {step}: {text!r}")

    def checkpoint(self, step: int, state: dict, wait: bool = False) -> None:
        with self.report.paused("checkpoint"):
            position = data_state.gather(self.train_it.get_state(), self.rows)
            self.ckpt.save(step, to_checkpoint_layout(self.model, self.opt, state),
                           {**self.meta, "data_state": position}, wait=wait)
            self.run_files.upload()  # the metrics to this step, beside the checkpoint
            committed = self.ckpt.steps()  # every process: one decision (a collective)
            if self.lead:
                record.write(self.workdir, committed, self.ckpt.directory)

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
            with self.profiler.step(step + 1, pending, self.report.paused):
                with self.report.fetching(pending):
                    batch = next(self.train_it)  # on the devices
                state, metrics = self.step_fn(state, batch, flags[signum])
            step = self.step = step + 1
            flush()
            self.ckpt.check()  # a failed background save ends the run here, in one line
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
        """Finish the checkpoint saves, close the metrics and copy the run's files (once; each
        part even when an earlier one raised, whose error then propagates)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.ExitStack() as parts:  # run last to first
            if self.writer is not None:  # compile() fetched the bucket's copy first: a run
                # that stops before never writes its local files over the bucket's
                parts.callback(self.run_files.upload)
                parts.callback(self.writer.close)
            parts.callback(self.ckpt.close)


def _nothing_to_do(r: _Run, step: int) -> Summary:
    """A finished run rerun: nothing is trained, evaluated or written."""
    say(f"nothing to do: {r.workdir} is already trained to step {step} (Train.steps="
        f"{r.t.steps}); raise Train.steps, and pin Train.schedule_steps, to train further")
    return Summary(step, step, None, None, None, str(r.ckpt.directory),
                   str(r.workdir / "metrics.jsonl"))


def run(config: Config, workdir: str | Path, devices: Sequence[jax.Device] | None = None,
        checkpoint_async: bool = True, fresh_start: bool = False,
        checkpoint_dir: str | None = None, allow_data_change: bool = False,
        stop: StopRequest | None = None, on_hang: Callable[[int], object] | None = None
        ) -> Summary:
    """Train (or resume training) ``config`` in ``workdir``; see the module docstring.

    ``checkpoint_dir``: where the checkpoints go (default ``<workdir>/checkpoints``): a local
    directory or an object store's URL (``s3://bucket/run``, ``gs://bucket/run``;
    checkpointing/storage.py).

    ``fresh_start``: initialise from the seed when the workdir's checkpoints are all damaged
    (else that is a :class:`ConfigError`). ``allow_data_change``: resume on a dataset other
    than the checkpoint's (train/resume.py :func:`check_data`). ``stop``: the entered
    :class:`StopRequest` of the entry point that installed the signal handlers
    (``python -m boost_jax.train``); None: no signal stops the run, and none is handled here.
    ``on_hang``: what ends the process when the hang watchdog fires (``Train.hang_timeout_s``;
    called with its exit code, operations/watchdog.py): the entry point's ``os._exit``; None:
    the stacks are dumped and the process is left to its caller.
    Raises :class:`CheckpointWriteError` when a save fails."""
    t_start = time.perf_counter()
    stop = stop or StopRequest()  # not entered: its signal never comes
    # a workdir this run made is removed if it fails before writing there; one run per
    # workdir and per bucket (operations/workdir_lock.py, checkpointing/lease.py)
    with (workdirs.prepared(workdir, recorded=workdirs.run_recorded) as workdir,
          workdir_lock.held(workdir), lease.held(checkpoint_dir or workdir / "checkpoints")):
        r = _Run(config, workdir, devices, checkpoint_async, Goodput(t_start), checkpoint_dir,
                 allow_data_change, on_hang)
        # the prefetch thread ends and the run is closed, whatever happens
        with contextlib.closing(r), contextlib.closing(r.train_it):
            state, start = r.restore(fresh_start)
            if start >= config.train.steps:
                return _nothing_to_do(r, start)
            r.compile(start)
            diverged = None
            try:
                with r.profiler, r.watchdog:  # the steps are profiled, and watched for hangs
                    state, step, eval_loss = r.train(state, start, stop)
            except Diverged as err:  # nothing is saved over the last good checkpoint
                diverged, step, eval_loss = str(err), r.step, None
            interrupted = r.signal or None
            if diverged is None:
                r.checkpoint(step, state, wait=True)
                if interrupted is not None:
                    logging.warning("stopped by signal %d after step %d; checkpoint saved -- "
                                    "rerun the same command to resume", interrupted, step)
                else:
                    eval_loss = r.evaluate(step, state["params"])
                    if config.train.sample_every:
                        r.sample(step, state["params"])
            goodput = r.goodput.record()
            r.writer.write(step, goodput, prefix="")
    summary = Summary(start, step, r.report.last_loss, eval_loss, interrupted,
                      str(r.ckpt.directory), str(r.writer.path), diverged,
                      r.run_files.problem)
    report(summary, goodput, time.perf_counter() - t_start, r.lead,
           str(r.workdir / "tensorboard"))
    return summary
