"""Packed rows with document masking (``Data.packing='document'``) through the model: a document
packed with others gives the logits it gives alone, under every plan; the loss ignores padding;
loss and gradients of a packed batch match the single-device model under TP, DP and the
pipeline."""

import functools

import jax
import numpy as np
import pytest

from boost_jax.config import Parallel
from boost_jax.models.attention import Segments
from boost_jax.models.decoder import abstract_model, reference_logits
from boost_jax.models.init import init_params
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.runner import ShardedModel
from boost_jax.testing import SINGLE, loss_and_grads, rel_err, tiny, tree_rel_err

SEQ = 16
#: documents (lengths) packed first-fit into rows of SEQ tokens; 0 = padding
ROWS = [(5, 7, 3), (9, 6), (16,), (4, 4, 4, 2)]


@functools.cache
def _problem(arch="cola", n_layers=2):
    model = tiny(arch, n_layers=n_layers)
    params = jax.device_get(init_params(abstract_model(model)[1], seed=0))
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, model.vocab_size, n + 1) for n in row] for row in ROWS]
    batch = {k: np.zeros((len(ROWS), SEQ), np.int32)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    for r, row in enumerate(docs):
        at = 0
        for seg, doc in enumerate(row, start=1):
            n = len(doc) - 1
            batch["inputs"][r, at:at + n], batch["targets"][r, at:at + n] = doc[:-1], doc[1:]
            batch["segment_ids"][r, at:at + n], batch["positions"][r, at:at + n] = seg, range(n)
            at += n
    return model, params, docs, batch


def _alone(model, params, doc):
    """Logits ``[n, V]`` and per-token losses of one document as its own unpacked row."""
    logits = np.asarray(reference_logits(model, params, doc[None, :-1]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return logits, -logp[np.arange(len(doc) - 1), doc[1:]]


@pytest.mark.parametrize("plan, tensor", [("none", 1), ("btp", 4)])
def test_packed_document_logits_equal_alone(plan, tensor):
    model, params, docs, batch = _problem()
    parallel = Parallel(data=1, tensor=tensor, tp_plan=plan)
    sharded = ShardedModel(model, parallel, make_mesh(parallel, jax.devices()[:tensor]))
    p = jax.device_put(params, sharded.param_shardings)
    seg = Segments(batch["segment_ids"], batch["positions"])
    packed = np.asarray(jax.jit(sharded.logits)(p, batch["inputs"], seg))
    for r, row in enumerate(docs):
        at = 0
        for doc in row:
            n = len(doc) - 1
            alone, _ = _alone(model, params, doc)
            assert rel_err(packed[r, at:at + n], alone) <= 1e-5, (plan, r, at)
            at += n
    # and not what the same tokens give as one unmasked sequence
    unmasked = np.asarray(jax.jit(sharded.logits)(p, batch["inputs"]))
    assert rel_err(unmasked[0, 5:12], packed[0, 5:12]) > 1e-3


def test_loss_is_the_mean_over_documents_and_ignores_padding():
    model, params, docs, batch = _problem()
    per_token = np.concatenate([_alone(model, params, d)[1] for row in docs for d in row])
    loss, _ = loss_and_grads(model, SINGLE, params, batch["inputs"], batch["targets"],
                             packing={k: batch[k] for k in ("segment_ids", "positions")})
    assert rel_err(loss, per_token.mean()) <= 1e-5
    noisy = {k: v.copy() for k, v in batch.items()}
    pad = noisy["segment_ids"] == 0
    noisy["inputs"][pad], noisy["targets"][pad] = 7, 11
    loss2, _ = loss_and_grads(model, SINGLE, params, noisy["inputs"], noisy["targets"],
                              packing={k: noisy[k] for k in ("segment_ids", "positions")})
    assert rel_err(loss2, loss) <= 1e-6


@pytest.mark.parametrize("arch, mesh, plan, options", [
    ("cola", (2, 1, 4), "btp", dict(grad_accum=2)),
    ("cola", (2, 2, 2), "btp", dict(microbatches=2)),
    ("cola", (2, 1, 4), "vanilla", {}),
    ("dense", (1, 1, 4), "fullrank", {}),
])
def test_packed_loss_and_grads_match_single_device(arch, mesh, plan, options):
    """Segment ids travel with every data shard, micro-step and pipeline microbatch; the
    global token count is exact whatever the padding per shard."""
    model, params, _, batch = _problem(arch, n_layers=4)
    packing = {k: batch[k] for k in ("segment_ids", "positions")}
    ref = loss_and_grads(model, SINGLE, params, batch["inputs"], batch["targets"],
                         packing=packing)
    data, pipe, tensor = mesh
    parallel = Parallel(data=data, pipe=pipe, tensor=tensor, tp_plan=plan, **options)
    loss, grads = loss_and_grads(model, parallel, params, batch["inputs"], batch["targets"],
                                 packing=packing)
    assert rel_err(loss, ref[0]) <= 1e-5
    assert tree_rel_err(grads, ref[1]) <= 1e-5
