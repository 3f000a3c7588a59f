"""``python -m boost_jax.generate`` on a tiny trained workdir: text out, one-line errors."""

import subprocess
import sys

import pytest

from boost_jax.commands import generate as cli
from tests.train.test_samples import SAMPLE_TOKENS, logged_samples, sampled_run  # noqa: F401


def _one_error_line(err: str) -> str:
    (line,) = err.splitlines()
    assert line.startswith("boost_jax.generate: error: ") and "Traceback" not in err
    return line


def test_the_command_prints_the_prompt_and_its_greedy_continuation(sampled_run):  # noqa: F811
    """The command line as a user runs it: the newest checkpoint's greedy texts, which are
    the samples the trainer logged at that step (the same batch: its compilation is reused)."""
    out = subprocess.run([sys.executable, "-m", "boost_jax.generate", f"--workdir={sampled_run}",
                          "--prompt=ROMEO:", "--prompt=The king",
                          f"--max_new_tokens={SAMPLE_TOKENS}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = logged_samples(sampled_run)[4]
    assert out.stdout == (f"=== prompt 1, sample 1 ===\n{first}\n"
                          f"=== prompt 2, sample 1 ===\n{second}\n")
    assert out.stderr == f"boost_jax.generate: {sampled_run} at step 4\n"


def test_sampling_is_seeded_with_a_header_per_sample(sampled_run, capsys):  # noqa: F811
    options = dict(step=2, max_new_tokens=4, temperature=0.9, top_p=0.8, num_samples=2)
    texts = []
    for seed in (1, 1, 2):
        assert cli.command(str(sampled_run), ["ROMEO:", "The king"], seed=seed, **options) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]
    headers = [line for line in texts[0].splitlines() if line.startswith("=== ")]
    assert headers == [f"=== prompt {i}, sample {j} ===" for i in (1, 2) for j in (1, 2)]
    assert texts[0].split("\n", 2)[1].startswith("ROMEO:")


@pytest.mark.parametrize("workdir, prompts, options, needle", [
    ("missing", ["a"], {}, "missing does not exist"),
    ("empty", ["a"], {}, "holds no checkpoint (train first"),
    ("run", ["a"], dict(step=3), "--step=3: RUN has checkpoints at steps 2, 4"),
    (None, ["a"], {}, "give the training run's --workdir"),
    ("run", [], {}, "give a --prompt"),
    ("run", [""], {}, "--prompt is empty"),
    ("run", ["a"], dict(max_new_tokens=0), "--max_new_tokens=0 must be a positive integer"),
    ("run", ["a"], dict(temperature=-0.5), "--temperature=-0.5 must be >= 0"),
    ("run", ["a"], dict(temperature=1.0, top_p=1.5), "--top_p=1.5 must be in (0, 1]"),
    ("run", ["a"], dict(num_samples=2), "--num_samples=2 with --temperature=0 (greedy)"),
    ("run", ["a"], dict(dtype="float16"), "--dtype='float16' is not one of"),
])
def test_mistakes_are_one_line_errors(sampled_run, tmp_path, capsys, workdir,  # noqa: F811
                                      prompts, options, needle):
    (tmp_path / "empty").mkdir()
    path = {"run": str(sampled_run), None: None}.get(workdir, str(tmp_path / str(workdir)))
    assert cli.command(path, prompts, **options) == 2
    captured = capsys.readouterr()
    assert needle.replace("RUN", str(sampled_run)) in _one_error_line(captured.err)
    assert not captured.out


def test_a_positional_argument_is_a_usage_error(capsys):
    assert cli.main(["boost_jax.generate", "ROMEO:"]) == 2
    assert 'the prompt goes in --prompt="..."' in _one_error_line(capsys.readouterr().err)
