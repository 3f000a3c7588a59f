"""The suite's own settings (``tests/conftest.py``) leave what it checks unchanged: XLA:CPU's
LLVM code generation at -O0 gives the train step the same optimized HLO and the same buffer
sizes as XLA's default level, at which the commands compile; on jaxlib 0.10, XLA:CPU's legacy
fusion emitters (the suite's choice there) change its fusions only: the same collectives, dots
and argument and output sizes, the temporary size within 0.1 %."""

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from boost_jax.analysis.hlo import collectives, dots
from boost_jax.config import Parallel, Train
from boost_jax.optim import make_optimizer
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.testing import tiny
from boost_jax.train.step import (
    STOP_SIGNALS,
    STOP_SPEC,
    abstract_batch,
    abstract_state,
    make_train_step,
)

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

#: XLA's default backend optimization level (DefaultDebugOptionsIgnoringFlags in
#: xla/debug_options_flags.cc)
XLA_DEFAULT_LEVEL = 3


def _program(compiled) -> tuple[str, tuple[int, ...]]:
    """The optimized HLO without its source metadata, and the buffer sizes."""
    mem = compiled.memory_analysis()
    sizes = tuple(getattr(mem, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                            "alias_size_in_bytes", "temp_size_in_bytes"))
    return re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text()), sizes


def _partitioned(compiled, mesh) -> tuple[list, list]:
    """What the suite reads of a program besides its fusions: every collective (kind, dtype,
    shape, mesh axes, executions, enclosing loops) and every dot (source, shape, contraction,
    executions), sorted."""
    hlo = compiled.as_text()
    colls = sorted((c.op, c.dtype, c.shape, c.axes, c.count, c.trips, c.backward, c.op_name)
                   for c in collectives(hlo, tuple(mesh.shape.values()), mesh.axis_names))
    return colls, sorted((d.op_name, d.shape, d.contracted, d.count) for d in dots(hlo))


def test_llvm_level_leaves_the_program_and_its_memory_unchanged():
    """Guards the suite's XLA flags (tests/conftest.py): the tiny btp step with low-rank remat
    on 8 devices compiled with them and with XLA's defaults has the same optimized HLO and the
    same argument, output, alias and temporary sizes; where the suite also chose the legacy
    fusion emitters (jaxlib 0.10), the same collectives and dots, the same argument, output and
    alias sizes, and temporaries within 0.1 % (measured: 128 bytes of 378 KB)."""
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    parallel = Parallel(data=2, tensor=4, tp_plan="btp", remat="lowrank")
    model = ShardedModel(tiny("cola"), parallel, make_mesh(parallel), jnp.dtype("float32"))
    opt = make_optimizer(Train())
    stop = jax.ShapeDtypeStruct((model.mesh.size, len(STOP_SIGNALS)), jnp.float32,
                                sharding=NamedSharding(model.mesh, STOP_SPEC))
    lowered = make_train_step(model, opt).lower(abstract_state(model, opt),
                                                abstract_batch(model, 8, 16), stop)
    defaults = {"xla_backend_optimization_level": XLA_DEFAULT_LEVEL}
    legacy_emitters = "--xla_cpu_use_fusion_emitters=false" in os.environ["XLA_FLAGS"]
    if legacy_emitters:
        defaults["xla_cpu_use_fusion_emitters"] = True
    suite_compiled, default_compiled = lowered.compile(), lowered.compile(compiler_options=defaults)
    suite, default = _program(suite_compiled), _program(default_compiled)
    assert _partitioned(suite_compiled, model.mesh) == _partitioned(default_compiled, model.mesh)
    assert suite[1][:3] == default[1][:3]
    if legacy_emitters:
        assert abs(suite[1][3] - default[1][3]) <= 1e-3 * default[1][3]
    else:
        assert suite == default


def test_the_longest_files_listed_exist():
    """conftest's ``LONGEST`` (the order the workers take the longest files in) names files
    that exist: a renamed file would silently fall back to collection order."""
    from tests.conftest import LONGEST, REPO

    assert [p for p in LONGEST if not (REPO / p).is_file()] == []
