"""The numbers of the README and of the docs' copies of command output, computed: each is derived
here from the code that produces it (the analytic communication, the parameter count, the
performance model) and compared with the text, so a change of either fails. Which test or
command backs each of the README's numbers, including those checked elsewhere (the quickstart's
perplexity: ``tests/test_quickstart.py``) and the one-off measurements, is listed in
docs/reference/tests.md.

The analytic communication used here is the compiled program's: ``comm_report --check`` and
``tests/parallel/test_communication.py`` read it from the compiled HLO and compare it with the
same formula for every plan.
"""

import re
import subprocess
import sys

import pytest

from boost_jax.analysis.comm import predict
from boost_jax.config import Data, Model, Parallel
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import count
from tests.test_docs import REPO

README = " ".join((REPO / "README.md").read_text().split())  # one space between words
GIB = 2 ** 30


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _layer_elements(arch, plan, size, dtype, tensor=4, **model):
    """Tensor-axis elements per layer and token (forward, backward) and forward bytes per
    token of ``arch`` under ``plan`` at TP=``tensor`` in ``dtype``."""
    comm = predict(Model(arch=arch, size=size, **model),
                   Parallel(data=1, tensor=tensor, tp_plan=plan), 4, 4096, dtype)
    return comm.layer_fwd, comm.layer_bwd, comm.layer_fwd_bytes


def test_seven_b_traffic_row():
    """Results, first row: the 7B shape at TP=4, forward elements per token and GiB per layer
    (batch 4 x 4096 tokens, bf16, as configs/paper/7b_tp4_comm.gin)."""
    row = re.search(r"\| tensor-axis traffic per layer, 7B, TP=4 .*?\| `fullrank` ([\d,]+); "
                    r"`vanilla` ([\d,]+); `btp` ([\d,]+) \(([\d.]+) / ([\d.]+) / ([\d.]+) GiB",
                    README)
    assert row, "the README's 7B traffic row changed: update this test with it"
    for k, (arch, plan) in enumerate([("dense", "fullrank"), ("cola", "vanilla"),
                                      ("cola", "btp")]):
        fwd, _, fwd_bytes = _layer_elements(arch, plan, "7b", "bfloat16", n_layers=2)
        assert _number(row.group(k + 1)) == fwd, (plan, fwd)
        assert float(row.group(k + 4)) == round(fwd_bytes * 4 * 4096 / GIB, 3), plan


def test_figure_caption_bytes_per_layer():
    """The figure's caption: the small CoLA model at TP=4 in fp32 (``bench step``'s default),
    forward + backward elements per layer and token -- btp ``14r + 2``, vanilla, Megatron's
    ``4d`` -- and the bytes the bars show (4 per fp32 element, as ``docs/bench_step.json``
    holds them). Issue 49: the caption spoke of bytes and quoted elements; seen failing on
    it."""
    import json

    caption = re.search(r"`btp` sends `14r \+ 2` elements, ([\d,]+) bytes; vanilla low-rank TP "
                        r"its full-width outputs, ([\d,]+) elements, ([\d,]+) bytes; Megatron's "
                        r"dense `4d`, ([\d,]+) elements, ([\d,]+) bytes", README)
    assert caption, "the README's figure caption changed: update this test with it"
    small = Model(size="small")
    bars = {r["row"]: r for r in json.loads((REPO / "docs" / "bench_step.json").read_text())
            ["rows"]}
    said = {"btp": (14 * small.attn_rank + 2, caption.group(1)),
            "vanilla": (_number(caption.group(2)), caption.group(3)),
            "fullrank": (_number(caption.group(4)), caption.group(5))}
    for arch, plan in (("cola", "btp"), ("cola", "vanilla"), ("dense", "fullrank")):
        fwd, bwd, _ = _layer_elements(arch, plan, "small", "float32")
        elements, in_bytes = said[plan]
        assert elements == fwd + bwd == bars[plan]["tp_elements_per_layer_token"], plan
        assert _number(in_bytes) == 4 * elements == bars[plan]["tp_bytes_per_layer_token"]
    assert said["fullrank"][0] == 4 * small.d_model


def test_quickstart_comm_report_comment():
    """The quickstart's ``comm_report`` line: the trained tiny model's btp forward elements per
    layer and token at its TP=2 in fp32, ``7r + 2``."""
    said = re.search(r"comm_report --gin_file=runs/tiny/config.gin --check +# btp: 7r\+2 = "
                     r"(\d+) per layer, token", README)
    assert said, "the README's quickstart comm_report line changed: update this test with it"
    fwd, _, _ = _layer_elements("cola", "btp", "tiny", "float32", tensor=2)
    assert int(said.group(1)) == fwd == 7 * Model(size="tiny").attn_rank + 2


def test_default_run_model_and_vocabulary():
    """Set up: the default run's model has 2.3M parameters and its tokenizer 4096 tokens (the
    uniform guess's perplexity)."""
    said = re.search(r"trains a ([\d.]+)M-parameter CoLA model", README)
    assert said and Model().arch == "cola"
    assert round(count(abstract_model(Model())[1]) / 1e6, 1) == float(said.group(1))
    uniform = re.search(r"a uniform guess over the (\d+) tokens would score (\d+)", README)
    assert Data().tokenizer == f"bpe:{uniform.group(1)}" and uniform.group(1) == uniform.group(2)


def test_paper_iteration_time_row():
    """Results: the performance model against the paper's iteration times -- within 15 % (BOOST,
    full-rank TP) and 25 % (vanilla TP) of every row, and the predicted range of BOOST over full
    rank (3B-30B rows), as ``bench model --paper`` prints them."""
    from boost_jax.analysis.hardware import PROFILES
    from boost_jax.analysis.paper import ARCHITECTURES, WEAK_SCALING, compare
    from boost_jax.analysis.perf_model import Efficiency

    row = re.search(r"predicted within (\d+) % \(BOOST, full-rank TP\) and (\d+) % \(vanilla TP\)"
                    r" of every row; BOOST over full rank ([\d.]+)–([\d.]+)× predicted", README)
    assert row, "the README's iteration-time row changed: update this test with it"
    rows = compare(WEAK_SCALING + ARCHITECTURES, PROFILES["a100_80gb_4gpu"], Efficiency())
    for r in rows:
        for method, bound in (("boost", 1), ("fullrank", 1), ("vanilla", 2)):
            assert abs(r[method]["error"]) <= int(row.group(bound)) / 100, (r["row"], method)
    speedups = [r["speedup_vs_fullrank"]["predicted"] for r in rows[1:5]]
    assert (float(row.group(3)), float(row.group(4))) == pytest.approx(
        (min(speedups), max(speedups)), abs=5e-3)


def test_docs_copies_of_bench_model_paper_are_its_output():
    """docs/BENCHMARKS.md holds ``bench model --paper``'s output verbatim, and docs/paper.md's
    tables its theirs / ours pairs for every row."""
    out = subprocess.run([sys.executable, "-m", "boost_jax.bench", "model", "--paper"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"```\n{out.stdout}```" in (REPO / "docs" / "BENCHMARKS.md").read_text(), (
        "docs/BENCHMARKS.md: paste the output of python -m boost_jax.bench model --paper")
    paper = (REPO / "docs" / "paper.md").read_text()
    pair = r"([\d.]+) / +([\d.]+)(?: \( *[+-]\d+%\))?"
    for line in out.stdout.splitlines():
        row = re.match(r"(\d+B(?: TP\S+| \w+))\s+(?:\d+\s+)?(.*)$", line)
        if not row:
            continue
        pairs = [f"{a} / {b}" for a, b in re.findall(pair, row.group(2))]
        assert len(pairs) == 5, line
        assert re.search(re.escape(f"| {row.group(1)} |") + r"(?: \d+ \|)? " +
                         re.escape(" | ".join(pairs)) + r" \|", paper), (
            f"docs/paper.md: the row {row.group(1)} is not {pairs}")


def test_low_rank_checkpointing_row():
    """Results: low-rank checkpointing's temporary memory at the 7B shape against ``none``'s,
    jaxlib 0.10.2 (2 layers) -- the figures tests/parallel/test_remat.py asserts on that
    version."""
    from tests.parallel.test_remat import MEASURED_MIB

    row = re.search(r"\| low-rank checkpointing, 7B shape \| ([\d.]+) of `none`'s temporary "
                    r"memory with identical tensor-axis traffic \(`full`: ([\d.]+),", README)
    assert row, "the README's low-rank checkpointing row changed: update this test with it"
    mib = MEASURED_MIB["0.10.2"]
    assert float(row.group(1)) == round(mib["lowrank"][0] / mib["none"][0], 2)
    assert float(row.group(2)) == round(mib["full"][0] / mib["none"][0], 2)
