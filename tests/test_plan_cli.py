"""``python -m boost_jax.plan`` in process: the table, ``--json``, one-line errors, and an
``--emit_gin`` file the trainer runs as it is."""

import json

import gin
import pytest
from absl import flags
from absl.testing import flagsaver

from boost_jax.commands import plan as plan_cli

FLAGS = flags.FLAGS


@pytest.fixture(scope="module", autouse=True)
def _plan_flags():
    """The planner's flags for this module only (other commands' tests expect them absent)."""
    before = set(FLAGS)
    plan_cli.define_flags()
    ours = {f.name for f in FLAGS.flags_by_module_dict().get(plan_cli.__name__, [])}
    yield
    for name in ours - before:  # not the trainer's, which the --emit_gin test defines
        delattr(FLAGS, name)


def _plan(capsys, gin_params, **values):
    capsys.readouterr()
    gin.clear_config()
    with flagsaver.flagsaver(gin_param=list(gin_params), gin_file=[], **values):
        code = plan_cli.main(["boost_jax.plan"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_ranks_13b_on_8_gpus(capsys):
    code, out, _ = _plan(capsys, ["Model.size='13b'"], gpus=8, batch=4, seq_len=4096,
                         json=True, top=5)
    assert code == 0
    result = json.loads(out)
    assert result["seconds"] < 30 and len(result["layouts"]) == 5
    times = [lay["step_s"] for lay in result["layouts"]]
    assert times == sorted(times)
    assert all(lay["memory_gib"] <= lay["budget_gib"] for lay in result["layouts"])
    assert {"parallel", "tokens_per_s", "mfu", "binding"} <= set(result["layouts"][0])


def test_table(capsys):
    code, out, _ = _plan(capsys, ["Model.size='7b'"], gpus=4, batch=4, seq_len=4096, top=3)
    assert code == 0 and "nothing compiled" in out and "binding" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("1 ")]) == 1


@pytest.mark.parametrize("values, needle", [
    (dict(), "--gpus is required"),
    (dict(gpus=4, hardware="tpu"), "--hardware='tpu' is not one of"),
    (dict(gpus=4, batch=0), "--batch=0 must be a positive integer"),
    (dict(gpus=1, batch=4, seq_len=4096), "no layout of 1 GPUs fits: the smallest layout "
                                          "needs"),
])
def test_errors_are_one_line(capsys, values, needle):
    code, _, err = _plan(capsys, ["Model.size='30b'"], **values)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("boost_jax.plan: error: ") and needle in err


def test_emitted_gin_trains(tmp_path, tiny_data, capsys):
    from boost_jax.commands import train as train_main

    path = tmp_path / "plan.gin"
    code, out, _ = _plan(capsys, ["Model.size='tiny'"], gpus=8, batch=8, seq_len=32,
                         dtype="float32", emit_gin=str(path))
    assert code == 0 and f"wrote {path}" in out
    gin.clear_config()
    bindings = [f"Data.path='{tiny_data}'", "Train.steps=2", "Train.eval_batches=0",
                "Train.log_every=1"]
    with flagsaver.flagsaver(workdir=str(tmp_path / "run"), gin_file=[str(path)],
                             gin_param=bindings):
        assert train_main.main(["boost_jax.train"]) == 0
    config = (tmp_path / "run" / "config.gin").read_text()
    first = [line for line in path.read_text().splitlines() if line.startswith("Parallel.")]
    assert all(line in config for line in first)
