"""The performance model's row-calibrated constants, fitted on a stated subset of the paper's
rows, and the error they give on the rows left out (``python -m boost_jax.bench model --paper
--held_out``).

Of :class:`~boost_jax.analysis.perf_model.Efficiency`'s constants, two are set from the paper's
measured iteration times: ``attention`` and ``memory`` (:data:`FITTED`), on the full-rank
column. The others come from other data (``gemm_max`` and ``gemm_ai_half`` from the BOOST
README's kernel table, ``comm`` from its 7B communication times) and stay as they are. A fit
minimises the squared log error of the full-rank predictions on the given rows (Nelder-Mead
from the shipped values, each constant within :data:`BOUNDS`). :func:`leave_one_out` fits on
all full-rank rows but one and predicts that one: its error is out of sample. The vanilla and
BOOST columns are never fitted on.
"""

from __future__ import annotations

import dataclasses
import math

from boost_jax.analysis.hardware import Hardware
from boost_jax.analysis.paper import Row, configs
from boost_jax.analysis.perf_model import Efficiency, predict

#: the constants fitted on the paper's rows (the others come from other measurements)
FITTED = ("attention", "memory")
#: the column they are fitted on
METHOD = "fullrank"
SEQ_LEN = 4096  # the paper's (analysis/paper.py)
#: each fitted constant is a fraction of a peak (of the GPU's FLOP/s, of its HBM bandwidth)
BOUNDS = (0.05, 1.0)


def _error(row: Row, hw: Hardware, eff: Efficiency, method: str = METHOD) -> float:
    """``log(predicted / measured)`` of ``row``'s ``method`` column."""
    model, parallel = configs(row, method)
    return math.log(predict(model, parallel, row.batch, SEQ_LEN, hw, eff).step_s
                    / row.measured[method])


def fit(rows: list[Row], hw: Hardware, base: Efficiency = Efficiency()) -> Efficiency:
    """``base`` with :data:`FITTED` set to minimise the squared log error of the full-rank
    predictions on ``rows``."""
    from scipy.optimize import minimize

    def with_values(x) -> Efficiency:
        return dataclasses.replace(base, **dict(zip(FITTED, (float(v) for v in x))))

    def loss(x) -> float:
        eff = with_values(x)
        return sum(_error(row, hw, eff) ** 2 for row in rows)

    start = [getattr(base, name) for name in FITTED]
    best = minimize(loss, start, method="Nelder-Mead", bounds=[BOUNDS] * len(FITTED),
                    options=dict(xatol=1e-4, fatol=1e-10, maxiter=2000))
    return with_values(best.x)


def leave_one_out(rows: list[Row], hw: Hardware, base: Efficiency = Efficiency()
                  ) -> list[dict]:
    """Per row: its full-rank error with ``base`` (the shipped constants, fitted on every row:
    in sample), and with the constants fitted on the other rows (held out), those constants."""
    out = []
    for i, row in enumerate(rows):
        eff = fit(rows[:i] + rows[i + 1:], hw, base)
        out.append({"row": row.name, "measured_s": row.measured[METHOD],
                    "in_sample_error": math.expm1(_error(row, hw, base)),
                    "held_out_error": math.expm1(_error(row, hw, eff)),
                    "fitted": {name: getattr(eff, name) for name in FITTED}})
    return out
