"""``python -m boost_jax.bench data``: is input the bottleneck? And what does preparing a large
corpus cost?

Loader (default): for each packing (``--packings``) and grain worker count
(``--loader_workers``), the configured dataset's training stream is read for ``--batches``
global batches (after the first, which pays for starting workers) and its rate printed --
batches/s, tokens/s and, for packed rows, the share of tokens that are not padding -- beside
what the train step consumes: ``batch_size x seq_len`` tokens per step, the step timed here on
the configured model and mesh (``--steps``), or ``--consume_tokens_per_s`` for a cluster's
measured rate. ``headroom`` is loader over trainer: below 1, input is the bottleneck.

Preparation (``--prepare_mb=N``): writes a synthetic corpus of N MiB (``data/synthetic.py``)
into ``--out`` and prepares it with ``python -m boost_jax.data.prepare`` at
``--prepare_workers`` (default: one per core; more prepare flags with ``--prepare_arg``),
sampling the resident memory of the whole process tree; with
``--kill_after_shards=K`` the first run is killed (SIGKILL) once K shards are finished and run
again, which must keep them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from absl import flags

from boost_jax.bench.measure import format_rows, measure, run_benchmark
from boost_jax.config import Config, ConfigError

FLAGS = flags.FLAGS
MIB = 2**20

DEFAULTS = ["Model.size='60m'", "Parallel.data=8", "Parallel.tensor=1", "Parallel.tp_plan='none'",
            "Train.batch_size=32", "Train.seq_len=256", "Train.dtype='float32'"]


def loader_rate(config: Config, packing: str, workers: int, batches: int) -> dict:
    """Read ``batches`` global batches of the training stream; its rate."""
    from boost_jax.data.loader import open_dataset, train_iterator

    t = config.train
    data = dataclasses.replace(config.data, packing=packing, worker_count=workers)
    it = train_iterator(open_dataset(data), t.seq_len, t.batch_size, t.seed, None, workers)
    next(it)  # starts the workers, builds any index
    used = 0.0
    start = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        used += float((b["segment_ids"] > 0).mean()) if "segment_ids" in b else 1.0
    seconds = time.perf_counter() - start
    if hasattr(it, "close"):  # stops grain's worker processes
        it.close()
    tokens = batches * t.batch_size * t.seq_len
    return {"packing": packing, "workers": workers, "batches_per_s": batches / seconds,
            "tokens_per_s": tokens / seconds, "non_padding": used / batches}


def trainer_rate(config: Config, packing: str, steps: int) -> float:
    """Tokens per second the configured train step consumes (timed here)."""
    data = dataclasses.replace(config.data, packing=packing)
    rep = measure(Config(config.model, config.parallel, config.train, data), steps)
    return rep["tokens_per_s"]


LOADER_COLUMNS = [("packing", "<10", "packing"), ("workers", ">8", "workers"),
                  ("batches/s", ">11.1f", "batches_per_s"),
                  ("tokens/s", ">12,.0f", "tokens_per_s"),
                  ("non-pad", ">9.3f", "non_padding"),
                  ("trainer tok/s", ">15,.0f", "trainer_tokens_per_s"),
                  ("headroom", ">10.1f", lambda r: r["tokens_per_s"] / r["trainer_tokens_per_s"])]


def _loader(config: Config) -> list[dict]:
    rows = []
    for packing in FLAGS.packings:
        if FLAGS.consume_tokens_per_s > 0:
            consume = FLAGS.consume_tokens_per_s
        else:
            consume = trainer_rate(config, packing, FLAGS.steps)
        for workers in map(int, FLAGS.loader_workers):
            row = loader_rate(config, packing, workers, FLAGS.batches)
            rows.append(dict(row, trainer_tokens_per_s=consume))
    return rows


# --- preparation -----------------------------------------------------------------------------
def _tree_rss(proc: psutil.Process) -> float:
    """Resident bytes of a process and all its descendants."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _watch(cmd: list[str], shards: Path, kill_after: int) -> tuple[int, float, str]:
    """Run ``cmd``, sampling its tree's RSS; SIGKILL it once ``kill_after`` (> 0) shard
    records exist under ``shards``. Returns (exit code, peak tree RSS bytes, stderr tail)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps, peak = psutil.Process(proc.pid), 0.0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(ps))
        if kill_after and len(list(shards.glob("[0-9]*.json"))) >= kill_after:
            for child in ps.children(recursive=True):
                child.send_signal(signal.SIGKILL)
            proc.send_signal(signal.SIGKILL)
        time.sleep(0.1)
    return proc.returncode, peak, proc.stderr.read()[-3000:]


def _prepare(config: Config) -> list[dict]:
    from boost_jax.data.prepare import verify
    from boost_jax.data.synthetic import write_corpus
    from boost_jax.publish import work_dir

    out = Path(FLAGS.out)
    src, dst = out / "corpus", out / "prepared"
    if not src.is_dir():
        start = time.perf_counter()
        write_corpus(src, FLAGS.prepare_mb, files=8)
        print(f"wrote a {FLAGS.prepare_mb:g} MiB synthetic corpus in "
              f"{time.perf_counter() - start:.0f} s: {src}", file=sys.stderr)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(work_dir(dst), ignore_errors=True)
    cmd = [sys.executable, "-m", "boost_jax.data.prepare", f"--input={src}", f"--output={dst}",
           f"--tokenizer={config.data.tokenizer}", f"--workers={FLAGS.prepare_workers}",
           *FLAGS.prepare_arg]
    corpus_mib = sum(f.stat().st_size for f in src.iterdir()) / MIB
    rows = []
    runs = [("killed", FLAGS.kill_after_shards), ("resumed", 0)] if FLAGS.kill_after_shards \
        else [("whole", 0)]
    for name, kill_after in runs:
        start = time.perf_counter()
        rc, peak, err = _watch(cmd, work_dir(dst) / "shards", kill_after)
        seconds = time.perf_counter() - start
        if name != "killed" and rc != 0:
            raise RuntimeError(f"prepare failed ({rc}):\n{err}")
        kept = err.count("finished shards kept")
        rows.append({"run": name, "corpus_mib": corpus_mib, "seconds": seconds,
                     "mib_per_s": corpus_mib / seconds if name == "whole" else float("nan"),
                     "peak_rss_mib": peak / MIB,
                     "exit": rc, "note": "kept finished shards" if kept else ""})
    if verify(dst):
        raise RuntimeError(f"{dst}: " + "; ".join(verify(dst)))
    manifest = json.loads((dst / "manifest.json").read_text())
    rows[-1]["note"] += (f"{'; ' if rows[-1]['note'] else ''}{len(manifest['shards'])} shards, "
                         f"{manifest['train_tokens'] + manifest['eval_tokens']:,} tokens, "
                         "checksums OK")
    return rows


PREPARE_COLUMNS = [("run", "<9", "run"), ("corpus MiB", ">12.0f", "corpus_mib"),
                   ("seconds", ">9.0f", "seconds"), ("MiB/s", ">8.1f", "mib_per_s"),
                   ("peak RSS MiB", ">14.0f", "peak_rss_mib"), ("exit", ">6", "exit"),
                   ("", "<2", lambda r: ""), ("note", "<60", "note")]


def _run(config: Config) -> int:
    if FLAGS.prepare_mb > 0:
        rows, columns = _prepare(config), PREPARE_COLUMNS
    else:
        if any(p not in ("concat", "document") for p in FLAGS.packings):
            raise ConfigError(f"--packings={','.join(FLAGS.packings)}: choose from concat, "
                              "document")
        rows, columns = _loader(config), LOADER_COLUMNS
    print(json.dumps(rows, indent=1) if FLAGS.json else "\n".join(format_rows(rows, columns)))
    return 0


def main(argv) -> int:
    return run_benchmark("data", argv, DEFAULTS, _run)
