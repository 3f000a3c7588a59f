"""The training loop end to end (in-process): exact resume, data parallelism, checkpoints."""

import json
import shutil

import jax
import numpy as np
import pytest

from boost_jax.config import Config, ConfigError, Data, Parallel, Train
from boost_jax.testing import SINGLE, rel_err, tiny
from boost_jax.train.loop import run


def _config(data, steps, parallel=SINGLE, model=None, packing="concat", **train):
    train = dict(dict(batch_size=8, seq_len=32, log_every=1000, eval_every=1000,
                      checkpoint_every=1000, eval_batches=1, learning_rate=3e-3), **train)
    return Config(model or tiny("cola"), parallel, Train(steps=steps, **train),
                  Data(path=str(data), packing=packing))


def _losses(workdir) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_exact_resume_equals_uninterrupted(tiny_data, tmp_path):
    """Train 40 steps, stop, resume to 80: the same losses as an uninterrupted 80-step run."""
    one = jax.devices()[:1]
    full = tmp_path / "full"
    s = run(_config(tiny_data, 80, schedule_steps=80, checkpoint_every=30), full, one)
    assert (s.start_step, s.step) == (0, 80) and s.eval_loss is not None
    split = tmp_path / "split"
    first = run(_config(tiny_data, 40, schedule_steps=80, checkpoint_every=30), split, one)
    assert first.step == 40
    second = run(_config(tiny_data, 80, schedule_steps=80, checkpoint_every=30), split, one)
    assert (second.start_step, second.step) == (40, 80)
    a, b = _losses(full), _losses(split)
    assert sorted(b) == list(range(1, 81))  # no step logged twice
    assert [a[k] for k in range(1, 81)] == [b[k] for k in range(1, 81)]  # bit-exact
    assert np.mean([a[k] for k in range(71, 81)]) < np.mean([a[k] for k in range(1, 11)]) - 0.5


@pytest.fixture(scope="module")
def single_device(tiny_data, tmp_path_factory):
    """10 steps on one device (fp32; the final checkpoint at 10): its summary and workdir,
    read by the tests below (a test that writes copies the workdir)."""
    workdir = tmp_path_factory.mktemp("single_device")
    return run(_config(tiny_data, 10), workdir, jax.devices()[:1]), workdir


def test_data_parallel_matches_single_device(tiny_data, tmp_path, single_device):
    ref, workdir = single_device
    dp = run(_config(tiny_data, 10, Parallel(data=8, tensor=1, tp_plan="none")), tmp_path / "dp8",
              jax.devices())
    a, b = _losses(workdir), _losses(tmp_path / "dp8")
    assert rel_err([b[k] for k in sorted(b)], [a[k] for k in sorted(a)]) < 1e-5
    assert abs(dp.eval_loss - ref.eval_loss) / ref.eval_loss < 1e-5


def test_document_packing_trains_and_resumes_exactly(packing_data, tmp_path):
    """Packed rows end to end, DP2 x TP2 (btp): 6 steps in one run equal 3 + 3 resumed."""
    four, par = jax.devices()[:4], Parallel(data=2, tensor=2, tp_plan="btp")
    cfg = dict(parallel=par, packing="document", schedule_steps=6, checkpoint_every=3)
    run(_config(packing_data, 6, **cfg), tmp_path / "full", four)
    run(_config(packing_data, 3, **cfg), tmp_path / "split", four)
    resumed = run(_config(packing_data, 6, **cfg), tmp_path / "split", four)
    assert (resumed.start_step, resumed.step) == (3, 6) and resumed.eval_loss is not None
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert [a[k] for k in range(1, 7)] == [b[k] for k in range(1, 7)]


def test_tp_size_invariance_dp4_vs_tp4(tiny_data, tmp_path):
    """BOOST's README loss curves as a test: DP4-TP1 and DP1-TP4 (CoLA, btp, online RMSNorm)
    log the same losses for 20 steps."""
    four = jax.devices()[:4]
    run(_config(tiny_data, 20, Parallel(data=4, tensor=1, tp_plan="btp")), tmp_path / "dp4", four)
    run(_config(tiny_data, 20, Parallel(data=1, tensor=4, tp_plan="btp")), tmp_path / "tp4", four)
    a, b = _losses(tmp_path / "dp4"), _losses(tmp_path / "tp4")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert rel_err([b[k] for k in range(1, 21)], [a[k] for k in range(1, 21)]) < 1e-5
    assert a[20] < a[1]


def test_corrupt_checkpoint_falls_back_to_an_older_one(tiny_data, tmp_path):
    one = jax.devices()[:1]
    cfg = _config(tiny_data, 8, schedule_steps=12, checkpoint_every=4)
    run(cfg, tmp_path, one)
    before = _losses(tmp_path)
    ckpt = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 8]
    for f in (ckpt / "8" / "state").rglob("*"):  # damage the newest checkpoint's arrays
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    s = run(_config(tiny_data, 12, schedule_steps=12, checkpoint_every=4), tmp_path, one)
    assert s.start_step == 4
    assert any(p.name.startswith("corrupt-8") for p in ckpt.iterdir())  # moved aside, kept
    after = _losses(tmp_path)
    assert [after[k] for k in range(5, 9)] == [before[k] for k in range(5, 9)]


def test_partial_checkpoint_is_ignored(tiny_data, tmp_path):
    one = jax.devices()[:1]
    run(_config(tiny_data, 4, schedule_steps=8), tmp_path, one)
    # a save that died half-way: orbax's temporary directory, never renamed
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(ckpt / "4", ckpt / "6.orbax-checkpoint-tmp")
    s = run(_config(tiny_data, 8, schedule_steps=8), tmp_path, one)
    assert (s.start_step, s.step) == (4, 8)


@pytest.mark.parametrize("arch", ["svd", "dense"])  # same shapes / other shapes
def test_other_model_in_workdir_is_refused(tiny_data, tmp_path, arch, single_device):
    workdir = tmp_path / "run"  # a CoLA run's, checkpoint 10
    shutil.copytree(single_device[1], workdir)
    cfg = _config(tiny_data, 12)
    cfg = Config(tiny(arch), cfg.parallel, cfg.train, cfg.data)
    with pytest.raises(ConfigError, match="another model"):
        run(cfg, workdir, jax.devices()[:1])
    # the checkpoint is refused, not treated as damaged
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == ["10"]


def test_a_restart_without_the_committed_checkpoints_is_refused(tiny_data, tmp_path,
                                                                 single_device):
    """Guards checkpointing/record.py: the 10-step run's workdir records its committed
    checkpoint 10; a restart pointed at a checkpoint directory without it (a forgotten or changed
    --checkpoint_dir, an emptied directory) stops in one line naming where the checkpoints were,
    instead of training from step 0; --fresh_start removes the record (and would train)."""
    from boost_jax.checkpointing import record as checkpoint_record

    workdir = tmp_path / "run"
    shutil.copytree(single_device[1], workdir)
    record = json.loads((workdir / checkpoint_record.RECORD).read_text())
    assert record == {"step": 10, "directory": str(single_device[1] / "checkpoints")}
    with pytest.raises(ConfigError) as err:
        run(_config(tiny_data, 12), workdir, jax.devices()[:1],
            checkpoint_dir=str(tmp_path / "elsewhere"))
    assert str(err.value) == (
        f"no checkpoint in {tmp_path / 'elsewhere'}, but this workdir's run committed one at "
        f"step 10 in {record['directory']} ({workdir / checkpoint_record.RECORD}): resume with "
        f"--checkpoint_dir={record['directory']}, or rerun with --fresh_start to train from step "
        "0 in this workdir")
    checkpoint_record.refuse_a_silent_restart(workdir, tmp_path / "elsewhere", fresh_start=True)
    assert not (workdir / checkpoint_record.RECORD).exists()
    checkpoint_record.write(workdir, [], tmp_path)  # nothing committed (killed before a save)
    assert not (workdir / checkpoint_record.RECORD).exists()


def test_a_resume_on_other_data_is_refused_unless_allowed(tiny_data, tmp_path, single_device):
    """Guards issue 46 case 4 (the data is part of the run's identity): the 10-step run's
    workdir resumed on a dataset prepared from other text is refused in one line, nothing
    written; a copy of its own dataset elsewhere is the same data; --allow_data_change goes on
    from step 10 and records the change in metrics.jsonl."""
    import lzma

    from boost_jax.data.corpus import corpus_path
    from boost_jax.data.manifest import fingerprint, read_manifest
    from boost_jax.data.prepare import prepare
    from boost_jax.train.resume import ResumeMismatch

    workdir = tmp_path / "run"
    shutil.copytree(single_device[1], workdir)
    with lzma.open(corpus_path("shakespeare"), "rt") as f:
        docs = [json.loads(line) for _, line in zip(range(6), f)][3:]  # three other plays
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    other = tmp_path / "other"
    prepare([tmp_path / "other.jsonl"], other, tokenizer="bpe:512", eval_fraction=0.05)
    mine, theirs = (fingerprint(p, read_manifest(p)) for p in (tiny_data, other))
    before = (workdir / "metrics.jsonl").read_text()
    with pytest.raises(ResumeMismatch) as err:
        run(_config(other, 12), workdir, jax.devices()[:1])
    assert str(err.value).startswith(
        f"Data.path={str(other)!r} holds other data than the checkpoints in "
        f"{workdir / 'checkpoints'} were trained on (data fingerprint {theirs}, the "
        f"checkpoints' {mine}: ")
    assert "--allow_data_change" in str(err.value)
    assert (workdir / "metrics.jsonl").read_text() == before
    copy = tmp_path / "copy"
    shutil.copytree(tiny_data, copy)
    assert fingerprint(copy, read_manifest(copy)) == mine
    s = run(_config(other, 12), workdir, jax.devices()[:1], allow_data_change=True)
    assert (s.start_step, s.step) == (10, 12)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["data_changed"]) for r in rows if "data_changed" in r] == [
        (10, [mine, theirs])]


def test_bfloat16_compute(tiny_data, tmp_path, single_device):
    f32 = single_device[0]
    bf16 = run(_config(tiny_data, 10, dtype="bfloat16"), tmp_path / "bf16", jax.devices()[:1])
    assert np.isfinite(bf16.final_loss)
    assert abs(bf16.final_loss - f32.final_loss) / f32.final_loss < 2e-2


@pytest.mark.parametrize("case, needle", [
    ("mesh", "needs 8 devices, but 1 are available"),
    ("data", "no prepared dataset"),
    ("vocab", r"Model.vocab_size=256 is smaller than the vocabulary of Data.path=.* \(its "
              r"largest token id \+ 1: 512\): add --gin_param=Model.vocab_size=512$"),
    ("seq_len", r"the train split has 0 windows .*, fewer than Train.batch_size=8; lower "
                r"Train.seq_len to at most \d+, or use a larger corpus$"),
])
def test_bad_run_inputs(tiny_data, tmp_path, case, needle):
    """Each early error is one line saying what fixes it, and a run that fails before it
    records a step leaves no trace: neither the workdir nor its parent ``runs/``, both made by
    the run, is left behind (issue 49; operations/workdir.py ``prepared``). Seen failing before
    it: ``runs/w`` stayed, holding the empty lock file; on the old vocabulary message (no
    binding named); and on the old advice for a sequence longer than the data ("lower
    Train.batch_size to at most 0")."""
    cfg = _config(tiny_data, 2)
    if case == "mesh":
        cfg = _config(tiny_data, 2, Parallel(data=8, tensor=1, tp_plan="none"))
    elif case == "data":
        cfg = Config(cfg.model, cfg.parallel, cfg.train, Data(path=str(tmp_path / "none")))
    elif case == "seq_len":
        cfg = _config(tiny_data, 2, seq_len=1 << 20)
    else:
        cfg = Config(tiny("cola", vocab_size=256), cfg.parallel, cfg.train, cfg.data)
    with pytest.raises(ConfigError, match=needle):
        run(cfg, tmp_path / "runs" / "w", jax.devices()[:1])
    assert not (tmp_path / "runs").exists()


def test_metrics_file_contents(tiny_data, tmp_path):
    """Every field, and MFU from the analytic model FLOPs: tflops/device x step time = a hand
    count (attention causal, head included, the lowrank remat recompute not counted)."""
    parallel = Parallel(data=1, tensor=1, tp_plan="none", remat="lowrank")
    run(_config(tiny_data, 3, parallel, eval_every=2, peak_tflops=1.0), tmp_path,
        jax.devices()[:1])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert {"loss", "lr", "grad_norm", "step_time", "tokens_per_sec", "mfu"} <= set(train_rows[0])
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 3]
    assert np.isfinite([r["loss"] for r in train_rows]).all()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "config.json").read_text())["Model"]["arch"] == "cola"
    # tiny cola, s=32: 7 low-rank projections, causal attention and the head, x3 for training
    proj = 2 * 16 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 176) * 3)
    per_token = 3 * (2 * (proj + 2 * 32 * 64) + 2 * 64 * 512)
    for r in train_rows:
        assert rel_err(r["tflops_per_device"] * r["step_time"] * 1e12, per_token * 8 * 32) < 1e-9
        assert rel_err(r["mfu"], r["tflops_per_device"]) < 1e-9  # peak 1 TFLOP/s


def _poison_at(monkeypatch, step: int, vocab: int):
    """Make the batch of ``step`` carry an id outside the vocabulary (a NaN loss)."""
    from boost_jax.train import loop

    calls, real = [], loop._global_batch
    first = 1  # the one eval batch (Train.eval_batches=1) passes through first

    def poisoned(local, model, global_batch):
        calls.append(None)
        if len(calls) == first + step:
            local = dict(local, inputs=local["inputs"].copy())
            local["inputs"][0, 0] = vocab
        return real(local, model, global_batch)

    monkeypatch.setattr(loop, "_global_batch", poisoned)


def test_nonfinite_stop_keeps_the_last_good_checkpoint(tiny_data, tmp_path, monkeypatch):
    model = tiny("cola")
    _poison_at(monkeypatch, 5, model.vocab_size)
    s = run(_config(tiny_data, 10, checkpoint_every=3), tmp_path, jax.devices()[:1])
    assert s.diverged is not None and "step 5" in s.diverged and "nonfinite='stop'" in s.diverged
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [3]  # nothing written after the bad step
    losses = _losses(tmp_path)
    assert max(losses) == 4 and all(np.isfinite(v) for v in losses.values())
    monkeypatch.undo()
    resumed = run(_config(tiny_data, 6, checkpoint_every=3), tmp_path, jax.devices()[:1])
    assert (resumed.start_step, resumed.step, resumed.diverged) == (3, 6, None)


def test_nonfinite_skip_goes_on(tiny_data, tmp_path, monkeypatch):
    model = tiny("cola")
    _poison_at(monkeypatch, 4, model.vocab_size)
    s = run(_config(tiny_data, 8, nonfinite="skip"), tmp_path, jax.devices()[:1])
    assert s.diverged is None and s.step == 8 and np.isfinite(s.eval_loss)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text()
                                      .splitlines()) if "loss" in r}
    assert rows[4]["nonfinite"] == 1 and rows[4]["skipped_total"] == 1
    assert all(rows[k]["nonfinite"] == 0 and np.isfinite(rows[k]["loss"]) for k in rows
               if k != 4)


def test_a_steps_metrics_are_read_before_a_pause_waits_for_it(tiny_data, tmp_path,
                                                              monkeypatch):
    """Step ``n``'s metrics (and its time) are read before a checkpoint, eval or sample of
    step ``n`` starts: those pauses wait for the step, and their time is left out of the step
    times, so a pause first would log ~0 s for every checkpoint and eval step."""
    from boost_jax.train import loop

    events = []

    def recorded(cls, name):
        original = getattr(cls, name)

        def call(self, step, *args, **kwargs):
            events.append((name, step))
            return original(self, step, *args, **kwargs)
        monkeypatch.setattr(cls, name, call)

    recorded(loop._Reporter, "__call__")
    for name in ("checkpoint", "evaluate", "sample"):
        recorded(loop._Run, name)
    run(_config(tiny_data, 4, checkpoint_every=2, eval_every=2, sample_every=2,
                sample_tokens=2), tmp_path / "run", jax.devices()[:1])
    pauses = [(i, step) for i, (name, step) in enumerate(events) if name != "__call__"]
    assert {step for _, step in pauses} == {2, 4}
    for i, step in pauses:
        assert ("__call__", step) in events[:i], events


@pytest.mark.parametrize("depth", [2, 0])
def test_batches_go_to_the_devices_ahead_of_their_step(tiny_data, tmp_path, monkeypatch, depth):
    """Data.device_prefetch=2: every training batch is put on the devices by the prefetch
    thread, not the loop's (0: by the loop, when its step starts); eval batches by the loop."""
    import threading

    from boost_jax.train import loop

    threads = []

    def recorded(local, model, global_batch):
        threads.append(threading.current_thread())
        return put(local, model, global_batch)

    put = loop._global_batch
    monkeypatch.setattr(loop, "_global_batch", recorded)
    config = _config(tiny_data, 4)
    config = Config(config.model, config.parallel, config.train,
                    Data(path=str(tiny_data), device_prefetch=depth))
    run(config, tmp_path / "run", jax.devices()[:1])
    evals, train = threads[:1], threads[1:]  # (eval_batches=1, put when the run starts)
    assert evals == [threading.main_thread()] and len(train) >= 4
    assert (threading.main_thread() in train) == (depth == 0), train


def test_the_prefetch_thread_ends_when_the_run_fails(tiny_data, tmp_path, monkeypatch):
    """A run that raises (here its final checkpoint) leaves no prefetch thread behind holding
    batches on the devices (in-process callers: notebooks, tests)."""
    import threading

    from boost_jax.train import loop

    def failing(self, step, state, wait=False):
        raise OSError("disk gone")

    monkeypatch.setattr(loop._Run, "checkpoint", failing)
    with pytest.raises(OSError, match="disk gone"):
        run(_config(tiny_data, 2), tmp_path / "run", jax.devices()[:1])
    assert not [t for t in threading.enumerate() if t.name.startswith("grain-thread-prefetch")]


def test_a_run_that_fails_is_closed(tiny_data, tmp_path, monkeypatch):
    """A run that raises after its steps (here its final checkpoint) still closes: the metrics
    writer is closed (its lines flushed) and the checkpointer gives up its claim on the
    directory, as a run that finishes does."""
    from boost_jax.checkpointing import integrity
    from boost_jax.train import loop
    from boost_jax.train.metrics import MetricsWriter

    closed, close = [], MetricsWriter.close

    def recording(self):
        closed.append(self.path)
        close(self)

    def failing(self, step, state, wait=False):
        raise OSError("disk gone")

    monkeypatch.setattr(loop._Run, "checkpoint", failing)
    monkeypatch.setattr(MetricsWriter, "close", recording)
    with pytest.raises(OSError, match="disk gone"):
        run(_config(tiny_data, 2), tmp_path / "run", jax.devices()[:1])
    assert closed == [tmp_path / "run" / "metrics.jsonl"]
    assert not [d for d in integrity._CLAIMED if str(tmp_path) in str(d)]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_run_called_from_python_installs_no_signal_handler(tiny_data, tmp_path, monkeypatch):
    """Process-wide effects belong to the entry point: ``run`` called from Python leaves
    SIGTERM's and SIGINT's handlers as they are while it trains (``python -m
    boost_jax.train`` installs its own around the run: tests/train/test_cli.py)."""
    import signal

    from boost_jax.train import loop

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    during, compile_ = [], loop._Run.compile

    def recording(self, start):
        during.append({s: signal.getsignal(s) for s in before})
        return compile_(self, start)

    monkeypatch.setattr(loop._Run, "compile", recording)
    run(_config(tiny_data, 1), tmp_path / "run", jax.devices()[:1])
    assert during == [before]
