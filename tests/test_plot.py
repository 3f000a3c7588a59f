"""``python -m boost_jax.plot``: loss curves of several runs into one PNG."""

import json
import subprocess
import sys

import pytest

from boost_jax.plot import parse_runs


def _run_dir(path, losses):
    path.mkdir()
    rows = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)] + [{"step": 2,
                                                                          "eval_loss": 9.0}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_overlays_runs_into_a_png(tmp_path):
    a = _run_dir(tmp_path / "dp4_tp1", [5.0, 4.0, 3.5])
    b = _run_dir(tmp_path / "dp1_tp4", [5.0, 4.1, 3.4])
    out = subprocess.run([sys.executable, "-m", "boost_jax.plot", str(a), f"tp4={b}",
                          f"--out={tmp_path / 'loss.png'}"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loss of dp4_tp1, tp4" in out.stdout
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_runs_are_one_line_errors(tmp_path):
    a = _run_dir(tmp_path / "a", [1.0])
    assert parse_runs([f"x={a}", str(a)]) == {"x": a, "a": a}
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        parse_runs([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="two runs are labelled 'a'"):
        parse_runs([str(a), f"a={a}"])
    with pytest.raises(ValueError, match="at least one run"):
        parse_runs([])
    out = subprocess.run([sys.executable, "-m", "boost_jax.plot", str(a), "--metric=lr",
                          f"--out={tmp_path / 'x.png'}"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "has no 'lr' entries" in out.stderr
