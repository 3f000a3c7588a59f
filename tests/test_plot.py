"""``python -m boost_jax.plot``: train and eval curves of several runs in one figure, written
next to the first run by default, and one-line errors for every user mistake."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from boost_jax.bench.plots import loss_curves
from boost_jax.commands.plot import PlotError, command, describe, parse_runs, plot, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _run_dir(path: Path, losses: list[float], tp: int = 1, config: bool = True,
             torn: bool = False) -> Path:
    """A fake workdir: train losses at steps 1..n, an eval every 2 steps, a trainer config."""
    path.mkdir()
    rows = []
    for step, loss in enumerate(losses, 1):
        rows.append({"step": step, "loss": loss, "grad_norm": 0.5, "mfu": None})
        if step % 2 == 0:
            rows.append({"step": step, "eval_loss": loss + 0.1, "eval_ppl": 2.0})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (path / "metrics.jsonl").write_text(text + ('{"step": 99, "lo' if torn else ""))
    if config:
        (path / "config.json").write_text(json.dumps({
            "Model": {"arch": "cola", "size": "tiny"}, "Train": {}, "Data": {},
            "Parallel": {"data": 4 // tp, "pipe": 1, "tensor": tp, "tp_plan": "btp"}}))
    return path


def _one_error_line(err: str) -> str:
    """The stderr of a failed command: exactly one ``boost_jax.plot: error:`` line."""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("boost_jax.plot: error: "), err
    return err


def test_writes_into_the_first_workdir_by_default(tmp_path):
    a = _run_dir(tmp_path / "dp4_tp1", [5.0, 4.0, 3.5, 3.2])
    b = _run_dir(tmp_path / "dp1_tp4", [5.0, 4.1, 3.4, 3.3], tp=4, torn=True)
    out = subprocess.run([sys.executable, "-m", "boost_jax.plot", str(a), f"tp4={b}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"wrote {a / 'loss.png'}: loss of dp4_tp1, tp4\n"
    assert (a / "loss.png").read_bytes()[:8] == PNG
    assert not (tmp_path / "loss.png").exists() and not (b / "loss.png").exists()
    # the torn last line a killed trainer leaves: skipped with one warning
    assert out.stderr.count("\n") == 1 and "warning" in out.stderr, out.stderr
    assert "skipped 1 unparsable line(s) (line 7;" in out.stderr


def test_figure_has_title_labels_and_train_and_eval_curves(tmp_path):
    a = _run_dir(tmp_path / "dp4_tp1", [5.0, 4.0, 3.5, 3.2])
    b = _run_dir(tmp_path / "dp1_tp4", [5.0, 4.1, 3.4, 3.3], tp=4)
    title = "\n".join(describe(label, w) for label, w in (("dp4_tp1", a), ("tp4", b)))
    assert title == ("dp4_tp1: cola tiny, no TP, data 4\n"
                     "tp4: cola tiny, btp TP, tensor 4")
    runs = {"dp4_tp1": read_metrics(a / "metrics.jsonl"),
            "tp4": read_metrics(b / "metrics.jsonl")}
    ax = loss_curves(runs, "loss", title).axes[0]
    assert ax.get_title(loc="left") == title
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "loss (nats/token)")
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["dp4_tp1 train", "dp4_tp1 eval", "tp4 train", "tp4 eval"]
    train, evals = lines["tp4 train"], lines["tp4 eval"]
    assert list(train.get_xdata()) == [1, 2, 3, 4] and train.get_linestyle() == "-"
    assert list(train.get_ydata()) == [5.0, 4.1, 3.4, 3.3]
    assert list(evals.get_xdata()) == [2, 4]
    assert list(evals.get_ydata()) == pytest.approx([4.2, 3.4])
    assert evals.get_linestyle() == "None" and evals.get_marker() == "o"
    assert train.get_color() == evals.get_color() != lines["dp4_tp1 train"].get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)


def test_one_run_other_metrics_and_out(tmp_path):
    a = _run_dir(tmp_path / "run", [5.0, 4.0], config=False)
    assert describe("run", a) == "run"  # no config.json: just the name
    ax = loss_curves({"run": read_metrics(a / "metrics.jsonl")}).axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["train", "eval"]
    ax = loss_curves({"run": read_metrics(a / "metrics.jsonl")}, "grad_norm").axes[0]
    assert ax.get_ylabel() == "gradient norm (L2, before clipping)"
    assert plot([str(a)], None, "eval_loss") == (a / "eval_loss.png", ["run"])
    (tmp_path / "figs").mkdir()
    assert plot([f"x={a}"], str(tmp_path / "figs"))[0] == tmp_path / "figs" / "loss.png"
    assert plot([str(a)], str(tmp_path / "l.pdf"))[0].read_bytes()[:5] == b"%PDF-"
    assert (a / "eval_loss.png").read_bytes()[:8] == PNG


def test_labels(tmp_path, monkeypatch):
    _run_dir(tmp_path / "lr=3e-3", [1.0])
    monkeypatch.chdir(tmp_path / "lr=3e-3")
    # the label defaults to the directory's name; a path with "=" in it is still a path
    assert parse_runs([".", "x=../lr=3e-3"]) == {"lr=3e-3": Path("."), "x": Path("../lr=3e-3")}
    assert parse_runs(["../lr=3e-3"]) == {"lr=3e-3": Path("../lr=3e-3")}
    with pytest.raises(PlotError, match="two runs are labelled 'a'"):
        parse_runs(["a=.", "a=."])


def test_user_mistakes_are_one_line_errors(tmp_path, capsys, monkeypatch):
    a = _run_dir(tmp_path / "a", [1.0, 0.9])
    (tmp_path / "empty").mkdir()
    cases = {"at least one run workdir": ([], None, "loss"),
             f"workdir {tmp_path / 'missing'} does not exist": ([str(tmp_path / "missing")],
                                                                None, "loss"),
             "empty has no metrics.jsonl": ([str(tmp_path / "empty")], None, "loss"),
             "no run logged 'mfu'": ([str(a)], None, "mfu"),
             "directory": ([str(a)], str(tmp_path / "nope" / "x.png"), "loss"),
             ".txt is not an image format": ([str(a)], str(tmp_path / "x.txt"), "loss")}
    for message, (args, out, metric) in cases.items():
        assert command(args, out, metric) == 2, message
        captured = capsys.readouterr()
        assert message in _one_error_line(captured.err) and not captured.out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "config.json", "empty",
                                                           "metrics.jsonl"]
    monkeypatch.setenv("BOOST_JAX_DEBUG", "1")  # the traceback instead
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        command([str(tmp_path / "empty")])


def test_error_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "boost_jax.plot", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and not out.stdout
    assert "missing does not exist" in _one_error_line(out.stderr)
    assert not list(tmp_path.iterdir())
