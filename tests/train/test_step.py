"""The train step: gradient accumulation equals one step on the same global batch and cuts
activation memory; the whole update runs in the model's region on donated state, with no
gradient buffer copied on its way to the optimizer; a non-finite step is skipped, and the
logged learning rate is the applied one."""

import functools
import math
import re

import jax
import pytest

from boost_jax.analysis.hlo import collectives, entry_instructions
from boost_jax.compiled.step_report import compile_step
from boost_jax.config import Config, Data, Model, Parallel, Train
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.testing import SINGLE, loss_and_grads, rel_err, tiny, tree_rel_err


@pytest.mark.jax_sensitive
def test_accumulation_equals_one_step():
    """K=4 micro-steps give the loss and every gradient of the un-accumulated step on the
    same global batch (fp32)."""
    model = tiny("cola")
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs = jax.random.randint(jax.random.key(1), (8, 16), 0, model.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (8, 16), 0, model.vocab_size)
    one, four = (loss_and_grads(model, Parallel(data=2, tensor=4, grad_accum=k), params, inputs,
                                targets) for k in (1, 4))
    assert rel_err(four[0], one[0]) <= 1e-5
    assert tree_rel_err(four[1], one[1]) <= 1e-5


SEVEN_B = dict(size="7b", n_layers=2)  # 7B-shaped, 2 layers, data=1 x tensor=4


@functools.cache
def _seven_b(grad_accum: int):
    parallel = Parallel(data=1, tensor=4, grad_accum=grad_accum)
    config = Config(Model(**SEVEN_B), parallel, Train(batch_size=16, seq_len=512), Data())
    return compile_step(config, jax.devices()[:4])


@pytest.mark.jax_sensitive
def test_accumulation_cuts_temporary_memory():
    """One micro-step's activations alive at a time: at the 7B shape with 8192 tokens per
    step, K=4 needs at most 0.4x the temporary memory of K=1."""
    temp = {k: _seven_b(k)[2].memory_analysis().temp_size_in_bytes for k in (1, 4)}
    assert temp[4] <= 0.4 * temp[1], temp


@pytest.mark.jax_sensitive
def test_update_runs_in_the_region_without_gradient_copies():
    """The compiled step updates the donated state in place: no copy or transpose of a
    parameter-shaped (gradient) buffer outside the loops (the old boundary copied every
    stacked gradient), no collective over a size-1 axis (each would copy its buffer),
    parameters and moments aliased to the outputs."""
    model, _, compiled = _seven_b(1)
    local = {tuple(s.shard_shape(p.shape)) for p, s in zip(
        jax.tree.leaves(model.param_shapes()), jax.tree.leaves(model.param_shardings))}
    assert len(local) > 5
    entry = entry_instructions(compiled.as_text())
    ops = {name: op for name, _, op, _ in entry}
    for name, typ, op, operands in entry:
        if op in ("copy", "transpose") and (m := re.match(r"f32\[([\d,]*)\]", typ)):
            # zeros written into a loop's output buffer are fine; a copy of a value is not
            source = operands[0]
            init = "broadcast" in source or ops.get(source) in ("broadcast", "constant")
            shape = tuple(int(v) for v in m.group(1).split(","))
            assert init or shape not in local, (name, typ, source)
    mesh = model.mesh
    colls = collectives(compiled.as_text(), tuple(mesh.devices.shape), tuple(mesh.axis_names))
    assert all(c.group_size > 1 for c in colls)
    memory = compiled.memory_analysis()
    state = sum(math.prod(s.shape) * 4 for s in jax.tree.leaves(model.param_shapes()))
    assert memory.alias_size_in_bytes >= 3 * state / 4  # params + two moments, per device


def test_gspmd_baseline_accumulates_and_shards_too():
    """The GSPMD baseline (plain jit, the same shardings) runs FSDP with accumulation and
    computes the same gradients."""
    model = tiny("cola")
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    inputs = jax.random.randint(jax.random.key(1), (8, 16), 0, model.vocab_size)
    ref = loss_and_grads(model, SINGLE, params, inputs, inputs)
    loss, grads = loss_and_grads(model, Parallel(data=2, tensor=4, zero=3, grad_accum=2),
                                 params, inputs, inputs, gspmd=True)
    assert rel_err(loss, ref[0]) <= 1e-5
    assert tree_rel_err(grads, ref[1]) <= 1e-5


def test_a_nonfinite_step_is_not_applied():
    """A batch that makes the loss NaN (an id outside the vocabulary: NaN rows from the
    embedding lookup) leaves parameters and optimizer moments as they were, ZeRO-1 slices
    included; the next good batch trains."""
    import jax.numpy as jnp
    import numpy as np

    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import init_state, make_train_step, stop_flags

    parallel = Parallel(data=2, tensor=1, tp_plan="none", zero=1)
    model = ShardedModel(tiny("cola"), parallel, make_mesh(parallel, jax.devices()[:2]))
    opt = make_optimizer(Train())
    train_step = make_train_step(model, opt)
    step = lambda state, batch: train_step(state, batch, stop_flags(model))  # noqa: E731
    good = {k: jnp.ones((4, 16), jnp.int32) for k in ("inputs", "targets")}
    bad = dict(good, inputs=good["inputs"].at[1, 3].set(model.cfg.vocab_size))
    state, _ = step(init_state(model, opt, 0), good)
    before = jax.device_get(state)
    state, metrics = step(state, bad)
    after = jax.device_get(state)
    assert int(metrics["nonfinite"]) == 1 and not np.isfinite(float(metrics["loss"]))
    assert int(after["step"]) == int(before["step"]) + 1
    for a, b in zip(jax.tree.leaves(after["params"]) + jax.tree.leaves(after["opt_state"]),
                    jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"])):
        np.testing.assert_array_equal(a, b)
    state, metrics = step(state, good)
    assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("parallel, gspmd", [
    (Parallel(data=2, pipe=2, tensor=2, tp_plan="btp", microbatches=2, zero=1), False),
    (Parallel(data=2, tensor=4), True),
], ids=["btp-3d", "gspmd"])
def test_a_stop_flag_on_one_device_reaches_every_device(parallel, gspmd):
    """The stop flags ride in the gradient norm's all-reduce: a signal seen by the process of
    one device only (here: one row of the flags) is the step's ``stop_signal`` on every
    device, SIGTERM before SIGINT; the flags change nothing else."""
    import signal

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import STOP_SIGNALS, STOP_SPEC, init_state, make_train_step

    model = ShardedModel(tiny("cola", n_layers=2), parallel, make_mesh(parallel, jax.devices()),
                         gspmd=gspmd)
    opt = make_optimizer(Train())
    step = make_train_step(model, opt)
    batch = {k: jnp.ones((8, 16), jnp.int32) for k in ("inputs", "targets")}

    def flags(rows):  # {device row: signal}
        a = np.zeros((8, len(STOP_SIGNALS)), np.float32)
        for r, sig in rows.items():
            a[r, STOP_SIGNALS.index(sig)] = 1
        return jax.device_put(a, NamedSharding(model.mesh, STOP_SPEC))

    results = {}
    for name, rows in [("none", {}), ("int", {5: signal.SIGINT}),
                       ("both", {3: signal.SIGINT, 6: signal.SIGTERM})]:
        state, metrics = step(init_state(model, opt, 0), batch, flags(rows))
        results[name] = jax.device_get((state["params"], metrics))
    assert [int(results[k][1]["stop_signal"]) for k in ("none", "int", "both")] == [
        0, signal.SIGINT, signal.SIGTERM]
    for k in ("int", "both"):
        assert float(results[k][1]["grad_norm"]) == float(results["none"][1]["grad_norm"])
        for a, b in zip(jax.tree.leaves(results[k][0]), jax.tree.leaves(results["none"][0])):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer", ["adamw", "loro"])
def test_the_logged_lr_is_the_applied_one(optimizer):
    """A skipped (non-finite) step advances the step counter but not the optimizer's count:
    every step logs the schedule at the optimizer's count (LORO: its update count; exact step
    at update 2, then the restart warm-up), the skipped step the rate of the next update. The
    run with a skip ends with the parameters of the same run without it and logs the same
    rates for its applied steps, so it logged the rates it applied; after the skip they are
    not the schedule at the step counter."""
    import jax.numpy as jnp
    import numpy as np

    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import init_state, make_train_step, stop_flags

    model = ShardedModel(tiny("svd", rank=4, n_layers=1), SINGLE,
                         make_mesh(SINGLE, jax.devices()[:1]))
    opt = make_optimizer(Train(optimizer=optimizer, loro_exact_every=3, steps=50), model)
    train_step, schedule = make_train_step(model, opt), jax.jit(opt.schedule)
    good = {k: jnp.ones((4, 16), jnp.int32) for k in ("inputs", "targets")}
    bad = dict(good, inputs=good["inputs"].at[1, 3].set(model.cfg.vocab_size))

    def run(batches):
        state, lrs = init_state(model, opt, 0), []
        for batch in batches:
            opt_state = state["opt_state"]
            # the count the update's rate is read at: LORO's own, AdamW's Adam count
            count = int(opt_state.count if optimizer == "loro" else opt_state[0].count)
            step = int(state["step"])
            state, metrics = train_step(state, batch, stop_flags(model))
            lr = float(metrics["lr"])
            np.testing.assert_allclose(lr, float(schedule(count)), rtol=1e-6)
            if step > count:
                assert abs(lr - float(schedule(step))) > 1e-3 * lr, (step, count)
            lrs.append(lr)
        return jax.device_get(state["params"]), lrs

    params, lrs = run([good, bad, good, good, good])
    clean_params, clean_lrs = run([good] * 4)
    assert lrs[1] == lrs[2] and [lrs[0], *lrs[2:]] == clean_lrs
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(clean_params)):
        np.testing.assert_array_equal(a, b)


def _device_conditionals(text: str) -> int:
    """Conditionals (``stablehlo.case`` / ``if``) of lowered StableHLO text whose branch is
    chosen by a value computed on the device: not those on a constant (how
    ``lax.platform_dependent`` lowers its choice for one platform), which the compiler folds
    away."""
    def static(name: str, before: int) -> bool:
        defs = list(re.finditer(rf"^\s*%{re.escape(name)}(?::\d+)? = (.*)$",
                                text[:before], re.MULTILINE))
        if not defs:  # a function argument
            return False
        rhs = defs[-1].group(1)
        if rhs.startswith("stablehlo.constant"):
            return True
        case = re.match(r'"stablehlo\.case"\(%([\w.]+)\)', rhs)
        return case is not None and static(case.group(1), defs[-1].start())

    found = re.finditer(r'"?stablehlo\.(?:case|if)"?\(%([\w.]+)', text)
    return sum(not static(m.group(1), m.start()) for m in found)


@pytest.mark.jax_sensitive
@pytest.mark.parametrize("optimizer", ["adamw", "loro"])
def test_the_nonfinite_guard_is_a_select_on_gpu_and_a_conditional_on_cpu(optimizer):
    """The skip of a non-finite step, lowered per platform (``lax.platform_dependent``): for
    CUDA a select, no conditional on a device value (XLA:GPU would copy the predicate to the
    host and wait for the gradient norm); for CPU a conditional, which updates the donated
    state in place (a select makes XLA:CPU copy parameter-sized buffers, which
    :func:`test_update_runs_in_the_region_without_gradient_copies` refuses). LORO's exact
    step (every ``loro_exact_every`` updates) stays a conditional on every platform."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import (
        STOP_SIGNALS,
        STOP_SPEC,
        abstract_batch,
        abstract_state,
        make_train_step,
    )

    model = ShardedModel(tiny("svd", rank=4, n_layers=1), SINGLE,
                         make_mesh(SINGLE, jax.devices()[:1]))
    opt = make_optimizer(Train(optimizer=optimizer, loro_exact_every=3, steps=50), model)
    stop = jax.ShapeDtypeStruct((1, len(STOP_SIGNALS)), jnp.float32,
                                sharding=NamedSharding(model.mesh, STOP_SPEC))
    traced = make_train_step(model, opt).trace(abstract_state(model, opt),
                                               abstract_batch(model, 4, 16), stop)
    loro = optimizer == "loro"
    for platform, conditionals in (("cuda", int(loro)), ("cpu", 1 + loro)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert _device_conditionals(text) == conditionals, platform


def test_the_gpu_guard_skips_like_the_cpu_one(monkeypatch):
    """The select the GPU program runs, executed here (``lax.platform_dependent`` made to
    take the default branch): a non-finite step leaves parameters and optimizer state as
    they were and advances the step counter; a good step trains."""
    import jax.numpy as jnp
    import numpy as np

    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import init_state, make_train_step, stop_flags

    chosen = []

    def default_branch(*args, default, **per_platform):
        chosen.append(default.__name__)
        return default(*args)

    monkeypatch.setattr(jax.lax, "platform_dependent", default_branch)
    model = ShardedModel(tiny("cola", n_layers=1), SINGLE, make_mesh(SINGLE, jax.devices()[:1]))
    opt = make_optimizer(Train())
    train_step = make_train_step(model, opt)
    good = {k: jnp.ones((2, 16), jnp.int32) for k in ("inputs", "targets")}
    bad = dict(good, inputs=good["inputs"].at[1, 3].set(model.cfg.vocab_size))
    before = jax.device_get(init_state(model, opt, 0))
    state, metrics = train_step(jax.device_put(before), bad, stop_flags(model))
    after = jax.device_get(state)
    assert chosen == ["select"] and int(metrics["nonfinite"]) == 1
    assert int(after["step"]) == int(before["step"]) + 1
    for a, b in zip(jax.tree.leaves((after["params"], after["opt_state"])),
                    jax.tree.leaves((before["params"], before["opt_state"]))):
        np.testing.assert_array_equal(a, b)
    state, metrics = train_step(state, good, stop_flags(model))
    assert int(metrics["nonfinite"]) == 0
    assert not np.array_equal(jax.device_get(state["params"]["final_norm"]),
                              before["params"]["final_norm"])
