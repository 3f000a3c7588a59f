"""``python -m boost_jax.bench checkpoint``: what verifying checkpoints costs.

On the configured model (default: CoLA 1B, one device, fp32 state: parameters and both AdamW
moments) it times, median of ``--steps`` repeats after a warm-up: the state's fingerprint
(train/integrity.py: one jitted reduction, read back), a complete checkpoint save
(``Checkpointer.save`` + wait: fingerprint, host copy, write, commit), and prints the
fingerprint's share of the save. A verified restore adds the same reduction (with the finite
check) to the read.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from absl import flags

from boost_jax.bench.measure import run_benchmark
from boost_jax.config import Config

FLAGS = flags.FLAGS

DEFAULTS = ["Model.size='1b'", "Parallel.data=1", "Parallel.tensor=1",
            "Train.dtype='float32'"]


def _median(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, page cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _run(config: Config) -> int:
    import jax

    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.checkpoint import Checkpointer
    from boost_jax.train.integrity import fingerprint
    from boost_jax.train.optim import make_optimizer
    from boost_jax.train.step import init_state

    model = ShardedModel(config.model, config.parallel, make_mesh(config.parallel))
    opt = make_optimizer(config.train)
    state = init_state(model, opt, config.train.seed)
    gib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    ckpt = Checkpointer(root, keep=1)
    step = iter(range(1, 10**6))
    try:
        t_fp = _median(lambda: fingerprint(state), FLAGS.steps)
        t_save = _median(lambda: ckpt.save(next(step), state, {}, wait=True), FLAGS.steps)
    finally:
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
    row = {"model": f"{config.model.arch}/{config.model.size}", "state_gib": round(gib, 2),
           "fingerprint_s": round(t_fp, 3), "save_s": round(t_save, 3),
           "fingerprint_share_of_save": round(t_fp / t_save, 4),
           "device": jax.devices()[0].device_kind}
    if FLAGS.json:
        print(json.dumps(row))
    else:
        width = max(map(len, row))
        print("\n".join(f"{k:<{width}}  {v}" for k, v in row.items()))
    return 0


def main(argv) -> int:
    return run_benchmark("checkpoint", argv, DEFAULTS, _run)
