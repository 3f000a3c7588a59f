"""The BOOST paper's measured iteration times and the layouts they ran with,
for validating the performance model (``python -m boost_jax.bench model --paper``).

Layouts come from the official repository's benchmark configs (``examples/cola/config_cola_
llama_{3b,13b,30b}.yaml``, ``examples/config_llama_30b.yaml``,
``config_cola_llama_7b_vanillaTP.yaml``): 3B TP=2 and 13B TP=4 x PP=2 with one micro-batch of
4 sequences; 7B TP=4 as 4 accumulated micro-batches of 1 sequence (``Parallel.grad_accum=4``:
the trainer's gradient accumulation, one micro-step's activations alive at a time); 30B
TP=4 x PP=4 (1F1B) with whole-layer recompute. Two assumptions of ours: the 1B TP=1 row runs
one micro-batch of 4 like the 3B/13B configs, and the 30B row runs the paper's batch of 4 as 4
micro-batches of 1 -- the repository's 30B config reads micro-batch 4 x accumulation 4 (batch
16), which would need at least 3.8 s of GEMMs on 16 A100s at 80% of peak, longer than the
2.43 s the paper measured.
"""

from __future__ import annotations

import dataclasses

from boost_jax.analysis.hardware import Hardware
from boost_jax.analysis.perf_model import Efficiency, Prediction, predict
from boost_jax.config import Model, Parallel

METHODS = ("fullrank", "vanilla", "boost")
#: the paper abstract's speedup ranges of BOOST over each baseline (3B-30B)
SPEEDUP_RANGES = {"fullrank": (1.46, 1.91), "vanilla": (1.87, 2.27)}


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    size: str
    tensor: int
    pipe: int
    batch: int
    microbatches: int  # pipeline microbatches (with pipe > 1)
    remat: str
    measured: dict[str, float]  # method -> seconds per iteration
    arch: str = "cola"  # the low-rank architecture of the vanilla and BOOST columns
    source: str = "README"
    grad_accum: int = 1  # accumulated micro-steps per iteration

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipe


WEAK_SCALING = [
    Row("1B TP1", "1b", 1, 1, 4, 1, "none", dict(fullrank=0.85, vanilla=0.56, boost=0.59)),
    Row("3B TP2", "3b", 2, 1, 4, 1, "none", dict(fullrank=1.14, vanilla=1.41, boost=0.78)),
    Row("7B TP4", "7b", 4, 1, 4, 1, "none", dict(fullrank=1.06, vanilla=1.64, boost=0.72),
        grad_accum=4),
    Row("13B TP4xPP2", "13b", 4, 2, 4, 1, "none",
        dict(fullrank=2.07, vanilla=2.42, boost=1.30)),
    Row("30B TP4xPP4", "30b", 4, 4, 4, 4, "full", dict(fullrank=2.43, vanilla=2.58, boost=1.27),
        source="paper Fig. 5 (secondary notes)"),
]
ARCHITECTURES = [
    Row(f"7B {label}", "7b", 4, 1, 4, 1, "none",
        dict(fullrank=1.06, vanilla=van, boost=boost), arch=arch,
        source="paper Fig. 5 right (secondary notes)", grad_accum=4)
    for arch, label, van, boost in (("svd", "SVD", 1.57, 0.70), ("cola", "CoLA", 1.64, 0.72),
                                    ("lax", "LaX", 1.72, 0.75))
]


def configs(row: Row, method: str) -> tuple[Model, Parallel]:
    """The model and parallel layout of one method on one row."""
    arch = "dense" if method == "fullrank" else row.arch
    plan = {"fullrank": "fullrank", "vanilla": "vanilla", "boost": "btp"}[method]
    parallel = Parallel(data=1, tensor=row.tensor, pipe=row.pipe,
                        tp_plan=plan if row.tensor > 1 else "none", rmsnorm="online",
                        remat=row.remat, microbatches=row.microbatches,
                        grad_accum=row.grad_accum)
    return Model(arch=arch, size=row.size), parallel


def predict_row(row: Row, hw: Hardware, eff: Efficiency) -> dict[str, Prediction]:
    out = {}
    for method in METHODS:
        model, parallel = configs(row, method)
        out[method] = predict(model, parallel, row.batch, 4096, hw, eff)
    return out


def compare(rows: list[Row], hw: Hardware, eff: Efficiency) -> list[dict]:
    """Measured vs predicted seconds, errors and speedups for every row (JSON-able)."""
    table = []
    for row in rows:
        preds = predict_row(row, hw, eff)
        entry = {"row": row.name, "gpus": row.gpus, "tensor": row.tensor, "pipe": row.pipe,
                 "batch": row.batch, "microbatches": row.microbatches,
                 "grad_accum": row.grad_accum, "remat": row.remat,
                 "arch": row.arch, "source": row.source}
        for method in METHODS:
            measured, predicted = row.measured[method], preds[method].step_s
            entry[method] = {"measured_s": measured, "predicted_s": predicted,
                             "error": predicted / measured - 1,
                             "breakdown": preds[method].breakdown}
        for base in ("fullrank", "vanilla"):
            entry[f"speedup_vs_{base}"] = {
                "measured": row.measured[base] / row.measured["boost"],
                "predicted": preds[base].step_s / preds["boost"].step_s}
        table.append(entry)
    return table


def compare_with_planner(rows: list[Row], hw: Hardware) -> list[dict]:
    """Each row's paper layout (BOOST and full rank) beside the planner's best layout for the
    same model, GPUs and batch on ``hw`` (analysis/planner.py; seq 4096): ``row``, ``method``,
    ``paper`` and ``choice`` (:class:`~boost_jax.analysis.planner.Layout`; ``None`` where no
    layout fits), ``over`` (the
    paper's layout above the planner's budget once its headroom is added). ``python -m
    boost_jax.plan --paper`` prints it."""
    from boost_jax.analysis.planner import Problem, evaluate, plan

    out = []
    for row in rows:
        for method in ("boost", "fullrank"):
            model, parallel = configs(row, method)
            problem = Problem(model, row.gpus, row.batch, 4096, hw)
            paper = evaluate(problem, parallel)
            out.append({"row": row.name, "method": method, "paper": paper,
                        "over": not problem.fits(paper.memory),
                        "choice": next(iter(plan(problem).layouts), None)})
    return out
