"""LORO (optim/loro.py): the optax transformation against a direct NumPy transcription of the
authors' update (fp64), the distributed CholeskyQR's orthogonality, single device == btp TP=4
== vanilla TP=4 through the train step, exact resume across an exact step, and the errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from boost_jax.config import ConfigError, Parallel, Train
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import init_params
from boost_jax.optim import make_optimizer
from boost_jax.optim.optimizer import lr_schedule
from boost_jax.parallel.loro_qr import cholesky_qr
from boost_jax.parallel.mesh import make_mesh
from boost_jax.testing import SINGLE, rel_err, tiny

K = 3  # exact steps at updates 2, 5, ...
TRAIN = Train(optimizer="loro", loro_exact_every=K, steps=40, learning_rate=3e-3,
              weight_decay=0.01, loro_regular="adamw")  # 'authors': test_loro_regular.py


# --- the reference: LOROAdamW (loro_torch/loro_optim.py) transcribed to NumPy, fp64 ---------
def _qr(x):
    """Reduced QR with a positive diagonal (the unique one; what Cholesky-QR gives)."""
    q, r = np.linalg.qr(x)
    s = np.sign(np.diag(r))
    return q * s, r * s[:, None]


def _paper_exact(m, n, dm, dn, lr):
    """Their exact update of ``W = M N^T`` (``M = B^T [out, r]``, ``N = A [in, r]``),
    line by line."""
    r = m.shape[1]
    u, rm = _qr(m)
    v, rn = _qr(n)
    g_x_v = np.linalg.solve(rn.T, dm.T).T
    ut_x_g = np.linalg.solve(rm.T, dn.T)
    k0 = ut_x_g @ v
    y1 = (ut_x_g - ut_x_g @ v @ v.T).T
    y2 = g_x_v - u @ u.T @ g_x_v
    q1, k1 = _qr(y1)
    q2, k2 = _qr(y2)
    sigma = np.block([[k0, k1.T], [k2, np.zeros((r, r))]])
    s_aug = np.zeros((2 * r, 2 * r))
    s_aug[:r, :r] = rm @ rn.T
    u_sig, s_sig, vt_sig = np.linalg.svd(s_aug - lr * sigma)
    v_sig = vt_sig.T
    flip = np.sign(u_sig[np.argmax(np.abs(u_sig), axis=0), np.arange(2 * r)])
    u_sig, v_sig = u_sig * flip, v_sig * flip
    root = np.diag(np.sqrt(s_sig))[:, :r]
    return np.hstack([u, q2]) @ u_sig @ root, np.hstack([v, q1]) @ v_sig @ root


def _pairs(blocks):
    """(A [in, r], B [r, out]) views per layer and member, as index functions."""
    out = []
    for layer in range(blocks["o"]["a"].shape[0]):
        for proj, b, members in (("qkv", "b_q", [0]), ("qkv", "b_kv", [1, 2]),
                                 ("gate_up", "b_gu", [0, 1]), ("o", "b", None),
                                 ("down", "b", None)):
            for j, c in enumerate(members or [None]):
                a_idx = (layer, slice(None), c) if c is not None else (layer,)
                b_idx = (layer, j) if members else (layer,)
                out.append(((proj, "a"), a_idx, (proj, b), b_idx))
    return out


def _restart_lr(train, count: int) -> float:
    """run_c4.py's cosine_restart warm-up (5 steps from 1e-6 x) on the repository's cosine."""
    base = float(jax.jit(lr_schedule(train))(jnp.int32(count)))
    j, restarts = count % K, count // K
    return base * ((j / 5 * (1 - 1e-6) + 1e-6) if restarts and j < 5 else 1.0)


def _adamw_regular(p, m, v, t, lr, train, decay):
    """optax.adamw's update of a non-factor leaf (``decay``: not a norm)."""
    mh, vh = m / (1 - train.beta1 ** t), v / (1 - train.beta2 ** t)
    return p - lr * (mh / (np.sqrt(vh) + 1e-8) + (train.weight_decay * p if decay else 0.0))


def _reference(params, grads_seq, train, d_model, lrs, regular=_adamw_regular):
    """``regular`` (``(p, m, v, t, lr, train, decay) -> p``) on the non-factor leaves, LORO on the
    factors (lazy steps scaled by ``train.loro_lr_scaler``, -1: r/d), refresh of every moment
    after each exact step if ``train.loro_reset_moments``; ``lrs``: the learning rates."""
    b1, b2, wd = train.beta1, train.beta2, train.weight_decay
    flat = {k: np.array(v, np.float64) for k, v in _flat(params).items()}
    factors = {k for k in flat if k[0] == "blocks" and k[-1] in ("a", "b", "b_q", "b_kv",
                                                                  "b_gu")}
    m = {k: np.zeros_like(v) for k, v in flat.items()}
    v = {k: np.zeros_like(x) for k, x in flat.items()}
    t, out = 0, []
    for count, (grads, lr) in enumerate(zip(grads_seq, lrs)):
        t += 1
        step = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        exact, dirs = (count + 1) % K == 0, {}
        for k, g in _flat(grads).items():
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            if k in factors:
                dirs[k] = m[k] / (np.sqrt(v[k]) + 1e-6)
                if not exact:
                    rank = flat[k].shape[-1 if k[-1] == "a" else -2]
                    scaler = train.loro_lr_scaler if train.loro_lr_scaler > 0 else rank / d_model
                    x = flat[k] - step * scaler * dirs[k]
                    flat[k] = x - step * wd * x
            else:
                flat[k] = regular(flat[k], m[k], v[k], t, lr, train,
                                  k[-1] not in ("attn_norm", "mlp_norm", "final_norm"))
        if exact:
            new = {k: flat[k].copy() for k in factors}
            for ka, ia, kb, ib in _pairs(params["blocks"]):
                ka, kb = ("blocks", *ka), ("blocks", *kb)
                mm, nn = _paper_exact(flat[kb][ib].T, flat[ka][ia], dirs[kb][ib].T,
                                      dirs[ka][ia], step)
                new[kb][ib], new[ka][ia] = mm.T, nn
            flat.update(new)
        if exact and train.loro_reset_moments:
            m = {k: np.zeros_like(x) for k, x in m.items()}
            v = {k: np.zeros_like(x) for k, x in v.items()}
            t = 0
        out.append(dict(flat))
    return out


def _flat(tree) -> dict:
    return {tuple(k.key for k in path): np.asarray(x) for path, x in
            jax.tree_util.tree_leaves_with_path(tree)}


def test_matches_the_authors_update_in_fp64():
    """Seven updates (exact at 2 and 5, restart warm-up, AdamW on the rest) of the tiny svd
    model's parameters with fixed gradients: the transformation in fp64 equals the NumPy
    transcription of LOROAdamW to 1e-12 -- which checks the block Cholesky-QR formulation
    (one QR of ``[A, D_A]``) against the authors' sequence of QRs and solves. The learning
    rate is an fp32 scalar (optax schedules are, even under x64): the reference takes the
    transformation's, checked against the restart formula to fp32 precision."""
    model = tiny("svd", n_layers=1)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    rng = np.random.default_rng(0)
    grads_seq = [jax.tree.map(lambda x: rng.normal(0, 1e-2, x.shape), params)
                 for _ in range(7)]
    got, lrs, count = _run_fp64(TRAIN, model, params, grads_seq)
    assert rel_err(lrs, [_restart_lr(TRAIN, c) for c in range(len(lrs))]) <= 1e-6
    assert lrs[3] < 1e-8 and lrs[4] > 0.1 * lrs[2]  # the restart after the exact step
    ref = _reference(params, grads_seq, TRAIN, model.d_model, lrs)
    for k, (now, want) in enumerate(zip(got, ref)):
        errs = {key: rel_err(now[key], want[key]) for key in now}
        assert max(errs.values()) <= 1e-12, (k, errs)
    assert count == 7


def _run_fp64(train, model, params, grads_seq) -> tuple[list[dict], list[float], int]:
    """The transformation in fp64 from ``params`` over ``grads_seq``: the flat parameters
    after each update, the learning rates of the updates (fp32 scalars: optax schedules are,
    even under x64) and its final update count."""
    with jax.enable_x64(True):
        opt = make_optimizer(train, model)
        lrs = [float(jax.jit(opt.schedule)(jnp.int32(c))) for c in range(len(grads_seq))]
        tx, out = opt.tx, []
        p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
        state = tx.init(p)

        @jax.jit
        def update(p, state, g):
            updates, state = tx.update(g, state, p)
            return optax.apply_updates(p, updates), state

        for grads in grads_seq:
            p, state = update(p, state, jax.tree.map(jnp.asarray, grads))
            out.append(_flat(jax.device_get(p)))
        return out, lrs, int(state.count)


# --- the distributed QR ---------------------------------------------------------------------
def _ill_conditioned(rows, cols, cond, seed):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(rows, cols)))
    v, _ = np.linalg.qr(rng.normal(size=(cols, cols)))
    return (u * np.logspace(0, -np.log10(cond), cols)) @ v.T


@pytest.mark.parametrize("cond", [1e1, 1e3])
def test_distributed_cholesky_qr_is_orthogonal(cond):
    """Shifted CholeskyQR3 in fp32 of a ``[64, 16]`` block row-split over tensor=4 (three
    16 x 16 all-reduces): ``||Q^T Q - I|| <= 1e-5``, ``QR = X``, and the Q of one device."""
    x = np.stack([_ill_conditioned(64, 16, cond, s) for s in range(2)]).astype(np.float32)
    mesh = make_mesh(Parallel(data=1, tensor=4, tp_plan="btp"), jax.devices()[:4])
    sharded = jax.jit(jax.shard_map(lambda b: tuple(cholesky_qr([b], ["tensor"], [64])[0]),
                                    mesh=mesh, in_specs=P(None, "tensor"),
                                    out_specs=(P(None, "tensor"), P())))
    q, r = jax.device_get(sharded(x))
    q1, _ = jax.device_get(jax.jit(lambda b: cholesky_qr([b], [None], [64])[0])(x))
    eye = np.eye(16)
    assert np.max(np.abs(np.einsum("bnc,bnd->bcd", q, q) - eye)) <= 1e-5
    assert np.all(np.diagonal(r, axis1=1, axis2=2) > 0)
    assert rel_err(q @ r, x) <= 1e-5
    assert rel_err(q, q1) <= 1e-3 * cond


# --- through the train step -----------------------------------------------------------------
#: the singular values a pair's product starts with in the TP comparison: sigma_0 * DECAY^j
DECAY = 0.7


@functools.cache
def _host_params(model):
    """The seed-0 init with each pair's product ``A B`` given well separated singular values
    (``sigma_j = sigma_0 DECAY^j``, its singular vectors kept) and balanced factors. At the
    plain init two of them lie 0.6 % apart, where the retraction's SVD rotates the factors
    inside their near-degenerate subspace by ~1e4 x its input's fp32 noise (a change of gauge
    that leaves ``A B`` unchanged); separated, the comparison is well conditioned."""
    params = jax.tree.map(np.array, jax.device_get(
        init_params(abstract_model(model)[1], seed=0)))
    blocks = params["blocks"]
    for (pa, ka), ia, (pb, kb), ib in _pairs(blocks):
        a, b = blocks[pa][ka], blocks[pb][kb]
        u, sigma, vt = np.linalg.svd(a[ia].astype(np.float64) @ b[ib], full_matrices=False)
        rank = a.shape[-1]
        root = np.sqrt(sigma[0] * DECAY ** np.arange(rank))
        a[ia], b[ib] = u[:, :rank] * root, root[:, None] * vt[:rank]
    return params


@functools.cache
def _trained(plan: str, tensor: int, steps: int = 5):
    """Losses and parameters of ``steps`` train steps of the tiny svd model (rank 4) with LORO
    (exact step at update 2) on ``tensor`` devices."""
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.step import make_train_step, state_shardings, stop_flags

    parallel = SINGLE if plan == "none" else Parallel(data=1, tensor=tensor, tp_plan=plan)
    model = ShardedModel(tiny("svd", rank=4), parallel,
                         make_mesh(parallel, jax.devices()[:tensor]))
    opt = make_optimizer(Train(optimizer="loro", loro_exact_every=K, steps=50), model)
    shardings = state_shardings(model, opt)
    params = jax.device_put(_host_params(model.cfg), shardings["params"])
    state = {"step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]),
             "params": params,
             "opt_state": jax.jit(opt.tx.init, out_shardings=shardings["opt_state"])(params)}
    losses, compiled = [], None
    for i in range(steps):
        tokens = jax.random.randint(jax.random.key(i), (8, 16), 0, model.cfg.vocab_size)
        batch = {k: jax.device_put(tokens, model.batch_sharding) for k in ("inputs", "targets")}
        args = (state, batch, stop_flags(model))
        compiled = compiled or make_train_step(model, opt).lower(*args).compile()
        state, metrics = compiled(*args)
        losses.append(float(metrics["loss"]))
    return model, compiled.as_text(), losses, jax.device_get(state["params"])


def _products(params) -> dict:
    """``W = A B`` of every factor pair (the weights the model computes with)."""
    from boost_jax.optim.loro import PAIRS
    out, blocks = {}, params["blocks"]
    for proj, members, b in PAIRS:
        a = blocks[proj]["a"]
        a = np.moveaxis(a[..., members[0]:members[1], :], -2, -3) if members else a[:, None]
        bb = blocks[proj][b] if members else blocks[proj][b][:, None]
        out[proj, b] = np.einsum("lmdr,lmre->lmde", a, bb)
    return out


@pytest.mark.slow  # about 30 s of compiles per plan on 2 cores; the HLO test covers btp here
@pytest.mark.parametrize("plan", ["btp", "vanilla"])
def test_tensor_parallel_matches_single_device(plan):
    """Five steps with an exact step at update 2 (K = 3), TP=4 against one
    device (fp32, 1e-5): the losses, every pair's product ``A B`` and every factor (max-abs
    relative error, as the plan tests); the AdamW leaves (embeddings, norms, head) by norm --
    their max-abs error is a single embedding entry 4x the next (1.6e-6 absolute; Adam's
    ``m / (sqrt(v) + eps)`` magnifies a near-zero gradient's noise), the rest <= 4e-7."""
    from boost_jax.optim.loro import BLOCKS
    from boost_jax.testing import norm_rel_err

    _, _, ref_losses, ref = _trained("none", 1)
    _, _, losses, params = _trained(plan, 4)
    assert rel_err(losses, ref_losses) <= 1e-5
    ref_w, w = _products(ref), _products(params)
    assert max(rel_err(w[k], ref_w[k]) for k in w) <= 1e-5
    flat, ref_flat = _flat(params), _flat(ref)
    factors = {k for k in flat if k[0] == BLOCKS and isinstance(ref["blocks"][k[1]], dict)}
    assert factors and max(rel_err(flat[k], ref_flat[k]) for k in factors) <= 1e-5
    assert max(norm_rel_err(flat[k], ref_flat[k]) for k in flat.keys() - factors) <= 1e-5


def _loro_collectives(plan: str):
    from boost_jax.analysis.hlo import collectives
    model, hlo, _, _ = _trained(plan, 4)
    mesh = model.mesh
    colls = collectives(hlo, tuple(mesh.devices.shape), tuple(mesh.axis_names))
    return model, [c for c in colls if "loro_exact" in c.op_name]


def test_btp_exact_step_all_reduces_only_gram_matrices():
    """The compiled BTP step: the exact step's collectives are three all-reduces over
    ``tensor`` (one per CholeskyQR pass, the upper triangles of every pair's ``2r x 2r`` Gram
    matrices in one): ``r (2r + 1)`` elements per factor each, nothing d-sized."""
    model, colls = _loro_collectives("btp")
    cfg, r = model.cfg, model.cfg.attn_rank
    factors = 2 * (1 + 2 + 2 + 1 + 1) * cfg.n_layers  # (A, B) of q, k, v, gate, up, o, down
    assert [c.op for c in colls] == ["all-reduce"] * 3
    assert all(c.axes == ("tensor",) and c.count == 1 for c in colls)
    assert [c.elements for c in colls] == [factors * r * (2 * r + 1)] * 3


LAPACK_CALL = re.compile(r'custom_call_target="(?:lapack|blas)_(\w+)", '
                         r"operand_layout_constraints=\{([^}]*)\}")


def test_cpu_lapack_calls_take_one_matrix_each():
    """On XLA:CPU every LAPACK kernel of the exact step (Cholesky, triangular solves, SVD)
    gets one matrix per call (loro_qr.matrixwise): jaxlib's batched kernels split the batch
    over XLA's thread pool and wait for it from a pool thread, which deadlocked the exact step
    once every pool thread was such a caller."""
    _, hlo, _, _ = _trained("btp", 4)
    calls = LAPACK_CALL.findall(hlo)
    assert {kernel for kernel, _ in calls} == {"spotrf_ffi", "strsm_ffi", "sgesdd_ffi"}
    operands = [shape for _, shapes in calls for shape in re.findall(r"\[([\d,]*)\]", shapes)]
    assert operands and all(shape.count(",") == 1 for shape in operands), operands


@pytest.mark.slow
def test_vanilla_exact_step_gathers_the_factors():
    """Vanilla splits the rank: the exact step all-gathers ``A, D_A, B, D_B`` (``2 (n_in +
    n_out) r`` elements per pair and layer) and reduces nothing."""
    model, colls = _loro_collectives("vanilla")
    cfg, r = model.cfg, model.cfg.attn_rank
    d, kv, ff = cfg.d_model, cfg.d_kv, cfg.d_ff
    widths = [(d, d, 1), (d, kv, 2), (d, ff, 2), (d, d, 1), (ff, d, 1)]  # n_in, n_out, members
    assert {c.op for c in colls} == {"all-gather"}
    assert all(c.axes == ("tensor",) for c in colls)
    assert sum(c.elements for c in colls) == sum(
        2 * (n_in + n_out) * r * m * cfg.n_layers for n_in, n_out, m in widths)


# --- the trainer ----------------------------------------------------------------------------
@pytest.mark.slow
def test_exact_resume_across_an_exact_step(tiny_data, tmp_path):
    """The LORO state (update count, shared moments) is in the checkpointed optimizer state:
    3 steps, checkpoint, resume to 6 -- across the exact step at update 3, its refresh and
    restart warm-up -- logs bit for bit the losses of an uninterrupted 6-step run."""
    from boost_jax.config import Config, Data
    from boost_jax.train.loop import run
    from tests.train.test_trainer import _losses

    def config(steps):
        return Config(tiny("svd", rank=4, n_layers=1), SINGLE,
                      Train(steps=steps, schedule_steps=6, batch_size=4, seq_len=16,
                            optimizer="loro", loro_exact_every=4, log_every=1000,
                            eval_every=1000, checkpoint_every=3, eval_batches=1),
                      Data(path=str(tiny_data)))

    one = jax.devices()[:1]
    run(config(6), tmp_path / "full", one)
    run(config(3), tmp_path / "split", one)
    resumed = run(config(6), tmp_path / "split", one)
    assert (resumed.start_step, resumed.step) == (3, 6)
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert [a[k] for k in range(1, 7)] == [b[k] for k in range(1, 7)]


@pytest.mark.parametrize("model, parallel, needle", [
    (tiny("cola"), SINGLE, "Model.arch='cola' needs 'adamw'"),
    (tiny("svd", rank=40), SINGLE, "rank 40 of qkv is above half"),
    (tiny("svd"), Parallel(data=2, tensor=1, tp_plan="none", zero=1), "Parallel.zero=1 is not"),
    (tiny("svd"), Parallel(data=1, pipe=2, tensor=1, tp_plan="none"), "pipeline parallelism"),
    (tiny("svd"), Parallel(data=2, tensor=4, tp_plan="btp"), "GSPMD"),
], ids=["cola", "rank", "zero", "pipe", "gspmd"])
def test_unsupported_setups_are_config_errors(model, parallel, needle):
    from boost_jax.parallel.runner import ShardedModel
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    sharded = ShardedModel(model, parallel, mesh, gspmd=needle == "GSPMD")
    with pytest.raises(ConfigError, match=needle):
        make_optimizer(TRAIN, sharded)


def test_loro_needs_the_model():
    with pytest.raises(ConfigError, match="needs the model"):
        make_optimizer(TRAIN)
