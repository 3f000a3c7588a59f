"""The README's quickstart, run as written: the train command's loss curve against the golden
curve committed beside this test (``tests/golden/quickstart.json``), and the eval command's
perplexity against the number the README prints after it (``# perplexity 72.75``).

The commands are read from the README's quickstart block, so the test runs what a user copies.
They run in a temporary directory (``--workdir=runs/tiny`` is relative), on the bundled corpus
and the suite's corpus cache, without the suite's XLA flags (the trainer picks its devices;
XLA compiles at its default level, as for a user).

The golden curve is the train loss of every step (200) and the eval perplexity, recorded with
jax 0.12.0.1 (Python 3.12) by ``python tests/test_quickstart.py --record``; ``--compare``
prints how far a run is from it. Measured on 2026-11-27: CI's other stack, jax 0.10.2 (Python
3.11), is at most 9.5e-7 from it on any step (steps 1-20: equal) and prints the same
perplexity, so the tolerance is tight: 1e-4 per step (100x that gap) and the perplexity equal
to the README's to its printed 2 decimals.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

#: run on CI's newest stack too (.ci/run): what a second JAX can change
pytestmark = pytest.mark.jax_sensitive

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden") / "quickstart.json"

#: per-step |loss - golden| allowed (module docstring: 100x the gap between CI's two stacks)
LOSS_ATOL = 1e-4
#: the eval command prints the perplexity to 2 decimals
PERPLEXITY_ATOL = 0.01


def quickstart_commands() -> list[tuple[list[str], str]]:
    """The README quickstart block's commands as argument lists (continuation lines joined),
    each with its trailing comment."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"^## Quickstart.*?```bash\n(.*?)```", readme, re.S | re.M).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        code, _, comment = line.partition(" # ")
        commands.append((shlex.split(code), comment.strip()))
    return commands


def _env() -> dict[str, str]:
    """The suite's environment less its XLA flags (device count, compile level)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return env


def _run(argv: list[str], cwd: Path) -> str:
    assert argv[0] == "python"
    out = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=_env(), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def run_quickstart(cwd: Path) -> dict:
    """Run the quickstart's train and eval commands in ``cwd``: ``{"losses": [step 1, ...],
    "perplexity": float, "readme_perplexity": float}``."""
    (train, _), (evaluate, comment) = quickstart_commands()[:2]
    _run(train, cwd)
    workdir = cwd / next(a.split("=", 1)[1] for a in train if a.startswith("--workdir="))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    printed = re.search(r"^perplexity +([\d.]+)$", _run(evaluate, cwd), re.M)
    return {"losses": [losses[s] for s in sorted(losses)],
            "perplexity": float(printed.group(1)),
            "readme_perplexity": float(re.fullmatch(r"perplexity ([\d.]+)", comment).group(1))}


def test_quickstart_follows_the_golden_curve_and_prints_the_readme_perplexity(tmp_path):
    """Guards the README's quickstart numbers: the loss curve of its train command and the
    perplexity its eval command prints."""
    golden = json.loads(GOLDEN.read_text())
    got = run_quickstart(tmp_path)
    assert len(got["losses"]) == len(golden["losses"]) == 200
    gaps = [abs(a - b) for a, b in zip(got["losses"], golden["losses"])]
    worst = max(range(200), key=gaps.__getitem__)
    assert gaps[worst] <= LOSS_ATOL, (
        f"step {worst + 1}: loss {got['losses'][worst]:.6f}, golden {golden['losses'][worst]:.6f}")
    assert abs(got["perplexity"] - golden["perplexity"]) <= PERPLEXITY_ATOL
    assert abs(got["perplexity"] - got["readme_perplexity"]) <= PERPLEXITY_ATOL, (
        f"the quickstart prints perplexity {got['perplexity']}, the README says "
        f"{got['readme_perplexity']}")


def test_the_communication_report_describes_the_run_just_trained():
    """Issue 49: the quickstart's ``comm_report`` reads the trained run's operative config
    (``<workdir>/config.gin``: its data=2 x tensor=2 mesh), not the default configuration
    (tensor 4). Seen failing on the old README (``--gin_param="Model.size='tiny'"``)."""
    (train, _), *_, (report, _) = quickstart_commands()
    workdir = next(a.split("=", 1)[1] for a in train if a.startswith("--workdir="))
    assert report[:3] == ["python", "-m", "boost_jax.tools.comm_report"]
    assert f"--gin_file={workdir}/config.gin" in report


def main(argv: list[str]) -> None:
    """``--record``: run the quickstart and write the golden file (its curve, perplexity, the
    commands and the jax version); ``--compare FILE``: run it and write the gaps to a golden
    file recorded elsewhere (the numbers for ``drift``) to stdout."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        got = run_quickstart(Path(tmp))
    if argv[:1] == ["--record"]:
        GOLDEN.parent.mkdir(exist_ok=True)
        record = {"commands": [" ".join(c) for c, _ in quickstart_commands()[:2]],
                  "jax": jax.__version__, "python": sys.version.split()[0],
                  "perplexity": got["perplexity"], "losses": got["losses"]}
        GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    else:
        golden = json.loads(GOLDEN.read_text())
        gaps = [abs(a - b) for a, b in zip(got["losses"], golden["losses"])]
        print(json.dumps({"jax": jax.__version__, "steps_1_20": max(gaps[:20]),
                          "steps_1_200": max(gaps), "perplexity": got["perplexity"],
                          "golden_perplexity": golden["perplexity"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
