"""The low-rank papers' pre-training protocol, our side against the CoLA authors' own code.

``tests/golden/cola_protocol/`` was recorded by ``tests/golden/make_cola_protocol.py`` from
alvin-zyl/CoLA (their ``ColaForCausalLM``, row loader, AdamW, scheduler and
``evaluate_model``, float32 on a CPU): a small corpus, a tokenizer whose template appends
``</s>`` as t5's does, their initial weights, and what their loop did. Here the same corpus
goes through our ``prepare`` and ``Data.packing='pad'`` rows, the weights through our CoLA
import, and the run through our train step with the protocol's options
(``Train.warmup_from_zero``, ``decay_norms``, ``loss_group_rows``). It guards: the same token
batches and label masks; for 21 updates (warm-up, cosine, clipping at 0.5 and weight decay
acting) the learning rate and objective within 1e-5 relative and the gradient norm before
clipping within 1e-4; after 20 updates every parameter tensor's norm within 1e-5 and their
evaluation number (``EvalTotals.cola_loss``). Each of the three options, turned off, fails it.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import Config, Data, Parallel, Train
from boost_jax.data.loader import iter_eval_batches, open_dataset
from boost_jax.data.packing import DocumentRows
from boost_jax.data.prepare import prepare
from boost_jax.interop.cola import cola_state_dict, import_cola
from boost_jax.testing import rel_err

FIXTURE = Path(__file__).parents[1] / "golden" / "cola_protocol"
RECORD = json.loads((FIXTURE / "record.json").read_text())
TOL = 1e-5
#: the gradient norm's: two of the 21 steps are ill-conditioned (torch float32 vs float64 on
#: their side alone: 2.3e-6 there, 1e-7 elsewhere); float32 ours vs theirs measured 1.1e-5
#: and 1.9e-5 there, float64 on both sides 9.4e-7 -- rounding, not a difference of method
GRAD_NORM_TOL = 1e-4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """The fixture's corpus prepared with its tokenizer, one document per chunk so the train
    split keeps the file's order (the order their loader read it in)."""
    out = tmp_path_factory.mktemp("cola_protocol") / "data"
    prepare([FIXTURE / "train.jsonl"], out, tokenizer=f"hf:{FIXTURE}", chunk_mb=1e-6,
            eval_inputs=[FIXTURE / "validation.jsonl"], progress=False)
    return out


def _config(dataset: Path) -> Config:
    r = RECORD
    model, _ = import_cola(FIXTURE / "model")
    train = Train(steps=r["steps"] + 1, schedule_steps=r["steps"], batch_size=r["total_batch_size"],
                  micro_batch_size=r["batch_size"], seq_len=r["seq_len"], learning_rate=r["lr"],
                  warmup_steps=r["warmup_steps"], min_lr_ratio=r["min_lr_ratio"],
                  weight_decay=r["weight_decay"], grad_clip=r["grad_clipping"],
                  warmup_from_zero=True, decay_norms=True, loss_group_rows=r["batch_size"])
    return Config(model, Parallel(data=1, tensor=1), train,
                  Data(path=str(dataset), packing="pad"))


def _their_rows() -> tuple[np.ndarray, np.ndarray]:
    """Every micro-batch's ``input_ids`` and ``attention_mask``, in order: ``[rows, L]``."""
    ids = np.concatenate([b["input_ids"] for b in RECORD["batches"]])
    mask = np.concatenate([b["attention_mask"] for b in RECORD["batches"]])
    return ids, mask


def test_the_rows_and_label_masks_are_the_authors(dataset):
    """Document i of our padded rows is row i of their loader: the same tokens (cut to the
    row as their tokenizer cuts, ``</s>`` kept last), our targets their labels shifted by one,
    our loss mask (``segment_ids > 0``) their non-pad labels; short and cut documents both
    occur."""
    ids, mask = _their_rows()
    rows = DocumentRows(dataset, "train", RECORD["seq_len"])
    assert len(rows) >= len(ids)
    ours = [rows[i] for i in range(len(ids))]
    inputs, targets, seg = (np.stack([o[k] for o in ours]) for k in
                            ("inputs", "targets", "segment_ids"))
    n, labelled = RECORD["seq_len"] - 1, mask[:, 1:] > 0  # their labels, shifted
    np.testing.assert_array_equal(seg[:, :n] > 0, labelled)
    # the inputs that precede a label (their last real input, ``</s>``, has none: no target)
    np.testing.assert_array_equal(np.where(labelled, inputs[:, :n], -1),
                                  np.where(labelled, ids[:, :n], -1))
    np.testing.assert_array_equal(np.where(labelled, targets[:, :n], -1),
                                  np.where(labelled, ids[:, 1:], -1))
    assert not seg[:, n:].any()
    assert (mask.sum(1) < RECORD["seq_len"]).any() and (mask.sum(1) == RECORD["seq_len"]).any()


def test_training_and_evaluation_match_the_authors(dataset):
    """21 updates of our train step from their initial weights on their batches: the learning
    rate each update applies (the 21st excepted: theirs wraps to the next cosine cycle), the
    objective within 1e-5 relative, the gradient norm before clipping within 1e-4
    (:data:`GRAD_NORM_TOL`), the step's ``tokens`` metric their count of labels; after 20
    updates, every parameter tensor's norm within 1e-5
    (weight decay on the norm gains shows there) and their ``evaluate_model`` number is our
    ``cola_loss`` over the eval split."""
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.runner import ShardedModel
    from boost_jax.train.eval_loss import evaluate, make_eval_step
    from boost_jax.train.step import make_train_step, stop_flags

    config = _config(dataset)
    t = config.train
    _, params = import_cola(FIXTURE / "model")
    model = ShardedModel(config.model, config.parallel, make_mesh(config.parallel,
                                                                  jax.devices()[:1]),
                         jnp.float32, max_segments=config.data.segment_bound)
    opt = make_optimizer(t, model)
    params = jax.device_put(model.from_canonical(params), model.param_shardings)
    state = {"step": jnp.zeros((), jnp.int32), "params": params,
             "opt_state": opt.tx.init(params)}
    step = make_train_step(model, opt, t.loss_group_rows)
    rows = DocumentRows(dataset, "train", t.seq_len)
    ds = open_dataset(config.data)
    eval_fn = make_eval_step(model)
    got = []
    for u in range(t.steps):
        if u == RECORD["steps"]:
            # global batches of 4 rows, read as their batches of 2 (Train.loss_group_rows)
            batches = iter_eval_batches(ds, t.seq_len, t.batch_size)
            totals = evaluate(eval_fn, state["params"], (
                jax.device_put(b, model.batch_sharding) for b in batches),
                group_rows=t.loss_group_rows)
            tensors = cola_state_dict(config.model, jax.device_get(
                model.to_canonical(state["params"])))
        picked = [rows[i] for i in range(u * t.batch_size, (u + 1) * t.batch_size)]
        batch = {k: jax.device_put(np.stack([p[k] for p in picked]), model.batch_sharding)
                 for k in picked[0]}
        state, metrics = step(state, batch, stop_flags(model))
        got.append({k: float(metrics[k]) for k in ("lr", "loss", "grad_norm", "tokens")})
    want = RECORD["updates"]
    assert len(got) == len(want) == 21
    labelled = _their_rows()[1][:, 1:].sum(1).reshape(len(want), -1).sum(1)  # non-pad labels
    assert [int(g["tokens"]) for g in got] == labelled.tolist()
    for u, (g, w) in enumerate(zip(got, want)):
        for k in ("loss", "lr", "grad_norm"):
            if k == "lr" and u == RECORD["steps"]:
                continue
            tol = GRAD_NORM_TOL if k == "grad_norm" else TOL
            assert abs(g[k] - w[k]) <= tol * abs(w[k]), (u, k, g[k], w[k])
    norms = {name: float(np.linalg.norm(tensors[name])) for name in RECORD["param_norms"]}
    for name, want_norm in RECORD["param_norms"].items():
        assert rel_err(norms[name], want_norm) <= TOL, (name, norms[name], want_norm)
    assert totals.groups == RECORD["eval"]["batches"]
    assert rel_err(totals.cola_loss, RECORD["eval"]["loss"]) <= TOL, (totals, RECORD["eval"])
