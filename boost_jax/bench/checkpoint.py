"""``python -m boost_jax.bench checkpoint``: what verifying checkpoints costs.

On the configured model (default: CoLA 1B, one device, fp32 state: parameters and both AdamW
moments) it times, best of ``--steps`` repeats after a warm-up, alternating the two so that
drifts of the page cache and the disk hit both alike (the best, as ``timeit`` does): a complete
checkpoint save (``Checkpointer.save`` + wait: host copy, encode, write, commit) with every
chunk's checksum (checkpointing/integrity.py) and the same save without it. The disk's writeback
adds
more noise to a save than the checksum costs, so the checksum's share is taken from the encode
alone (every array encoded as orbax's Zarr v3 chunks into memory, with and without the
checksum): ``(encode - encode_without_checksums) / save``. It also times the restore's check
of the state (one jitted reduction, read back).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import flags

from boost_jax.bench.measure import run_benchmark
from boost_jax.config import Config

FLAGS = flags.FLAGS

DEFAULTS = ["Model.size='1b'", "Parallel.data=1", "Parallel.tensor=1",
            "Train.dtype='float32'"]


def _best(fns, repeats: int) -> list[float]:
    """The shortest time of each of ``fns``, run ``repeats`` times after a warm-up round, in
    turn and in alternating order (A B, B A, ...) so that neither comes first every time."""
    times = [[] for _ in fns]
    for i in range(repeats + 1):
        order = list(zip(fns, times))
        for fn, t in order if i % 2 else order[::-1]:
            start = time.perf_counter()
            fn()
            if i:  # the first round warms up: compilation, page cache
                t.append(time.perf_counter() - start)
    return [min(t) for t in times]


def _encode(arrays: list, checksum: bool) -> None:
    """Encode ``arrays`` (host copies) as orbax's Zarr v3 chunks into memory, all at once as
    orbax's save does, with or without the chunk checksum: the save's encode step, without the
    disk's noise."""
    import tensorstore as ts

    from boost_jax.checkpointing.integrity import zarr3_metadata

    writes = []
    for x in arrays:
        shape = list(x.shape) or [1]
        meta = {**zarr3_metadata(shape, checksum), "data_type": str(x.dtype)}
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": meta,
                         "create": True}).result()
        writes.append(store.write(x.reshape(shape)))
    for w in writes:
        w.result()


def _run(config: Config) -> int:
    import jax

    from boost_jax.checkpointing.checkpointer import Checkpointer
    from boost_jax.checkpointing.integrity import chunk_checksums_off, verify
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import init_state

    model = ShardedModel(config.model, config.parallel, make_mesh(config.parallel))
    opt = make_optimizer(config.train)
    state = init_state(model, opt, config.train.seed)
    gib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    ckpt = Checkpointer(root, keep=1)
    step = iter(range(1, 10**6))

    def save_plain() -> None:
        with chunk_checksums_off():
            ckpt.save(next(step), state, {}, wait=True)

    try:
        t_crc, t_plain = _best(
            [lambda: ckpt.save(next(step), state, {}, wait=True), save_plain], FLAGS.steps)
        (t_check,) = _best([lambda: verify(state, 0)], FLAGS.steps)
    finally:
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    e_crc, e_plain = _best([lambda: _encode(host, True), lambda: _encode(host, False)],
                           FLAGS.steps)
    row = {"model": f"{config.model.arch}/{config.model.size}", "state_gib": round(gib, 2),
           "save_s": round(t_crc, 3), "save_without_checksums_s": round(t_plain, 3),
           "encode_s": round(e_crc, 3), "encode_without_checksums_s": round(e_plain, 3),
           "checksum_share_of_save": round((e_crc - e_plain) / t_crc, 4),
           "restore_check_s": round(t_check, 3), "device": jax.devices()[0].device_kind}
    if FLAGS.json:
        print(json.dumps(row))
    else:
        width = max(map(len, row))
        print("\n".join(f"{k:<{width}}  {v}" for k, v in row.items()))
    return 0


def main(argv) -> int:
    return run_benchmark("checkpoint", argv, DEFAULTS, _run)
