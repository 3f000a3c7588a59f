"""``bench gpu`` off a GPU: the profile summary parses a real ``jax.profiler`` trace, the
attention switch reaches the model, and the benchmark refuses a host without a GPU."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from boost_jax.bench.gpu import top_ops
from boost_jax.config import Parallel
from boost_jax.models.attention import causal_attention


def test_top_ops_of_a_cpu_trace(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            f(x).block_until_ready()
    rows = top_ops(tmp_path, top=5)
    assert 0 < len(rows) <= 5
    assert all(r["total_ms"] >= 0 and r["calls"] >= 1 for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["total_ms"])
    assert sum(r["share"] for r in rows) <= 1.0 + 1e-9


def test_attention_implementation_reaches_the_execution():
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.testing import tiny

    parallel = Parallel(data=1, tensor=1, tp_plan="none", attention="auto")
    mesh = make_mesh(parallel, jax.devices()[:1])
    assert ShardedModel(tiny(), parallel, mesh, jnp.bfloat16).execution.attention == "xla"  # CPU
    with pytest.raises(Exception, match="Parallel.attention='cudnn' needs a GPU"):
        ShardedModel(tiny(), Parallel(data=1, tensor=1, tp_plan="none", attention="cudnn"),
                     mesh, jnp.bfloat16)
    q = jnp.ones((1, 8, 2, 4))
    assert causal_attention(q, q, q, 1e4, implementation="xla").shape == (1, 8, 8)


def test_bench_gpu_refuses_a_cpu_host():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "boost_jax.bench", "gpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "bench gpu: error: bench gpu measures a GPU; this host runs on cpu")
