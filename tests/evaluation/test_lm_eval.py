"""The lm-evaluation-harness adapter (boost_jax/evaluation/harness.py), offline: its
log-likelihoods are log-softmax sums of ``reference_logits``, its generations are
``models.decode.generate`` cut at the stop strings, and a multiple-choice and a generation
task written here run end to end through ``lm_eval.simple_evaluate``."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read by datasets when it is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from boost_jax.config import ConfigError  # noqa: E402
from boost_jax.evaluation.harness import BoostLM, cut_at, run_tasks  # noqa: E402
from boost_jax.models.decode import generate  # noqa: E402
from boost_jax.models.decoder import reference_logits  # noqa: E402

MAX_LENGTH = 32
CONTEXTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.",
            "KING HENRY V:\nOnce more unto the breach, dear friends, once more; or close the "
            "wall up with our English dead.", ""]
CONTINUATIONS = [" What", " light", "\nAll:\nSpeak, speak.", "The king"]

MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
MC_DOCS = [{"question": "ROMEO: What light through yonder",
            "choices": [" window breaks", " cheese melts", " dog barks"], "label": 0},
           {"question": "First Citizen: Before we proceed any",
            "choices": [" further", " banana", " sideways"], "label": 0},
           {"question": "Once more unto the", "choices": [" breach", " fridge"], "label": 1}]
GEN_DOCS = [{"prompt": "ROMEO:", "answer": " I"}, {"prompt": "JULIET:\nO Romeo", "answer": "!"},
            {"prompt": CONTEXTS[2], "answer": " Cry"}]  # 3 prompts up to 32 tokens: compiled


@pytest.fixture(scope="module")
def lm(tiny_run) -> BoostLM:
    """The tiny run, scored in batches of 3 rows of at most 32 tokens (two buckets)."""
    return BoostLM(workdir=str(tiny_run.workdir), max_length=MAX_LENGTH, batch_size=3)


def _request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _reference(lm: BoostLM, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of log-softmax of ``reference_logits`` over the continuation (the last 33 tokens
    of the row), and whether each of its tokens is the argmax."""
    whole = (context + continuation)[-(MAX_LENGTH + 1):]
    row = np.zeros(MAX_LENGTH, np.int32)  # one shape, one compilation: the model is causal,
    row[:len(whole) - 1] = whole[:-1]  # so tokens after the row change nothing before them
    logits = np.asarray(reference_logits(lm.cfg, lm.trained.params, jnp.asarray(row[None])))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    n, targets = len(continuation), np.asarray(whole[1:])
    rows = np.arange(len(targets))[-n:]
    return (float(logp[rows, targets[-n:]].sum()),
            bool((logits[rows].argmax(-1) == targets[-n:]).all()))


def test_loglikelihood_is_the_reference_log_softmax_sum(lm):
    requests = [_request("loglikelihood", c, k) for c in CONTEXTS for k in CONTINUATIONS]
    got = lm.loglikelihood(requests)  # 16 requests, rows of 2..33 tokens: 2 buckets, 6 calls
    for request, (logp, greedy) in zip(requests, got):
        context, continuation = request.args
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation)
        ref, ref_greedy = _reference(lm, ctx, cont)
        assert logp == pytest.approx(ref, rel=1e-5, abs=1e-4), request.args
        assert greedy == ref_greedy
    # the argmax continuation is greedy; any other token is not
    ctx = lm.tok_encode(CONTEXTS[0])
    best = int(np.asarray(reference_logits(lm.cfg, lm.trained.params,
                                           jnp.asarray([ctx])))[0, -1].argmax())
    flags = lm._loglikelihood_tokens([(("", ""), ctx, [best]),
                                      (("", ""), ctx, [(best + 1) % lm.cfg.vocab_size])])
    assert [g for _, g in flags] == [True, False]


def test_rolling_loglikelihood_sums_disjoint_windows(lm):
    text = CONTEXTS[2] * 3  # longer than one window
    tokens = lm.tok_encode(text)
    assert len(tokens) > 2 * MAX_LENGTH
    ref = sum(_reference(lm, *make_disjoint_window(w))[0] for w in get_rolling_token_windows(
        tokens, lm.prefix_token_id, MAX_LENGTH, 1))
    [got] = lm.loglikelihood_rolling([_request("loglikelihood_rolling", text)])
    assert got == pytest.approx(ref, rel=1e-5)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_strings(lm):
    kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    requests = [_request("generate_until", c, dict(kwargs)) for c in CONTEXTS[:3]]
    got = lm.generate_until(requests)
    prompts = [lm.tok_encode(c)[-(MAX_LENGTH - 6):] for c in CONTEXTS[:3]]  # room for 6
    assert len(lm.tok_encode(CONTEXTS[2])) > MAX_LENGTH - 6
    new = generate(lm.cfg, lm.trained.params, prompts, 6, stop_ids=(lm.eot_token_id,))
    assert got == [cut_at(lm.tok_decode(ids), ["\n"]) for ids in new]
    assert cut_at("a line. Next\nmore", ["\n", "."]) == "a line"


def test_tasks_run_offline_through_simple_evaluate(lm, tmp_path):
    for name, docs, task in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"tiny_{name}.yaml").write_text(task.format(path=data))
    results = run_tasks(lm, ["tiny_*"], include_path=tmp_path, default_tasks=False,
                        bootstrap_iters=0)["results"]
    # accuracy: the choice the adapter gives the highest log-likelihood is the label
    right = []
    for doc in MC_DOCS:
        scores = lm.loglikelihood([_request("loglikelihood", doc["question"], c)
                                   for c in doc["choices"]])
        right.append(int(np.argmax([s for s, _ in scores])) == doc["label"])
    assert results["tiny_mc"]["acc,none"] == pytest.approx(np.mean(right))
    outputs = lm.generate_until([_request("generate_until", d["prompt"],
                                          {"until": ["\n", "."], "max_gen_toks": 6,
                                           "do_sample": False}) for d in GEN_DOCS])
    expected = np.mean([o == d["answer"] for o, d in zip(outputs, GEN_DOCS)])
    assert "exact_match,none" in results["tiny_gen"]
    assert results["tiny_gen"]["exact_match,none"] == pytest.approx(expected)
    from lm_eval.api.registry import get_model

    assert get_model("boost_jax") is BoostLM  # simple_evaluate(model="boost_jax") finds it
    with pytest.raises(ConfigError, match="unknown lm-eval task 'tiny_nope'"):
        run_tasks(lm, ["tiny_nope"], include_path=tmp_path, default_tasks=False)


@pytest.mark.slow
def test_command_runs_tasks_from_an_include_path(tiny_run, tmp_path):
    import subprocess
    import sys

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(MC_TASK.format(path=data))
    out = subprocess.run([sys.executable, "-m", "boost_jax.eval", f"--workdir={tiny_run.workdir}",
                          "--tasks=tiny_mc", f"--include_path={tmp_path}", "--only_include_path",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["step"] == 4 and 0 <= got["results"]["tiny_mc"]["acc,none"] <= 1
