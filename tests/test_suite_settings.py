"""The suite's own settings (``tests/conftest.py``) leave what it checks unchanged: XLA:CPU's
LLVM code generation at -O0 gives the train step the same optimized HLO and the same buffer
sizes as XLA's default level, at which the commands compile."""

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from boost_jax.config import Parallel, Train
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.testing import tiny
from boost_jax.train.optim import make_optimizer
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


def test_llvm_level_leaves_the_program_and_its_memory_unchanged():
    """Guards the suite's -O0 (tests/conftest.py): the tiny btp step with low-rank remat on 8
    devices compiled at the suite's level and at XLA's default has the same optimized HLO and
    the same argument, output, alias and temporary sizes."""
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    parallel = Parallel(data=2, tensor=4, tp_plan="btp", remat="lowrank")
    model = ShardedModel(tiny("cola"), parallel, make_mesh(parallel), jnp.dtype("float32"))
    opt = make_optimizer(Train())
    stop = jax.ShapeDtypeStruct((model.mesh.size, len(STOP_SIGNALS)), jnp.float32,
                                sharding=NamedSharding(model.mesh, STOP_SPEC))
    lowered = make_train_step(model, opt).lower(abstract_state(model, opt),
                                                abstract_batch(model, 8, 16), stop)
    suite = _program(lowered.compile())
    default = _program(lowered.compile(
        compiler_options={"xla_backend_optimization_level": XLA_DEFAULT_LEVEL}))
    assert suite[1] == default[1]
    assert suite[0] == default[0]
