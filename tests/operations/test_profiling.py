"""A profiled window of train steps: the trace's files and its step annotations; the fields of
profiling and of the hang watchdog as config errors; what a resume may do with them."""

import dataclasses
import gzip
import json

import jax
import pytest

from boost_jax.config import ConfigError, Train
from boost_jax.config_fields import FREE
from boost_jax.train.loop import run
from tests.train.test_cli import _train_main
from tests.train.test_trainer import _config

OPERATIONS = ("profile_steps", "profile_start_step", "profile_processes", "hang_timeout_s")


def _traced_steps(workdir) -> list[int]:
    """The step numbers of the ``train`` step annotations in the run's trace."""
    (xplane,) = (workdir / "profile" / "process-0" / "plugins" / "profile").glob(
        "*/*.xplane.pb")  # TensorBoard's profile plugin reads this
    assert b"train" in xplane.read_bytes() and b"step_num" in xplane.read_bytes()
    (trace,) = xplane.parent.glob("*.trace.json.gz")  # Perfetto, chrome://tracing
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")


@pytest.mark.parametrize("start, count, traced", [(2, 2, [2, 3]), (4, 3, [4, 5])],
                         ids=["inside", "past_the_end"])
def test_a_window_of_steps_is_traced(tiny_data, tmp_path, start, count, traced):
    """Steps ``start`` .. ``start + count - 1`` of a 5-step run; a window reaching past the
    run's last step traces the steps up to it."""
    s = run(_config(tiny_data, 5, profile_start_step=start, profile_steps=count), tmp_path,
            jax.devices()[:1])
    assert s.step == 5
    assert _traced_steps(tmp_path) == traced


@pytest.mark.parametrize("values, needle", [
    (dict(profile_steps=-1), "Train.profile_steps=-1 must be >= 0 (0: no trace)"),
    (dict(profile_start_step=0), "Train.profile_start_step=0 must be >= 1"),
    (dict(steps=20, profile_steps=2, profile_start_step=21),
     "Train.profile_start_step=21 is after the run's last step (Train.steps=20): the trace "
     "would be empty"),
    (dict(profile_processes=()), "Train.profile_processes=() must name process indices >= 0"),
    (dict(profile_processes=(0, -1)), "Train.profile_processes=(0, -1) must name process "
                                      "indices >= 0"),
    (dict(profile_processes=0), "Train.profile_processes=0 must be a tuple of integers"),
    (dict(hang_timeout_s=-1.0), "Train.hang_timeout_s=-1.0 must be >= 0 (0: automatic) or "
                                "None (no watchdog)"),
    (dict(hang_timeout_s="5"), "Train.hang_timeout_s='5' must be a number or None"),
])
def test_bad_values_are_config_errors(values, needle):
    with pytest.raises(ConfigError) as err:
        Train(**values)
    assert needle in str(err.value).splitlines()[0]  # the line the command prints


def test_a_window_past_the_runs_end_is_allowed():
    """The window may reach past Train.steps (the trace stops with the run); profiling off,
    its other fields are not checked against the run."""
    Train(steps=20, profile_start_step=20, profile_steps=5)
    Train(steps=20, profile_start_step=50)


@pytest.mark.parametrize("bindings, needle", [
    (["Train.profile_steps=-2"], "Train.profile_steps=-2 must be >= 0"),
    (["Train.profile_steps=2", "Train.profile_processes=(0, 1)"],
     "Train.profile_processes=(0, 1) names process 1, but the run has 1 process(es) (indices "
     "0..0)"),
])
def test_bad_values_are_one_line_before_compiling(tmp_path, tiny_data, capsys, bindings,
                                                  needle):
    workdir = tmp_path / "run"
    code, out, err = _train_main(capsys, workdir, ["Model.size='tiny'",
                                                   f"Data.path='{tiny_data}'", *bindings])
    assert code == 2
    (error,) = [line for line in err.splitlines() if "error" in line]
    assert error.startswith("boost_jax.train: error: ") and needle in error
    assert "compiling" not in out and not (workdir / "checkpoints").exists()


def test_operations_fields_never_stop_a_resume():
    kinds = {f.name: f.metadata["resume"] for f in dataclasses.fields(Train)}
    assert {kinds[name] for name in OPERATIONS} == {FREE}
    defaults = Train()
    assert (defaults.profile_steps, defaults.profile_processes, defaults.hang_timeout_s) == (
        0, (0,), 0.0)


def test_a_trace_already_running_is_left_alone(tiny_data, tmp_path, caplog):
    """A caller profiling the whole run: the window is skipped with a warning, the run goes
    on, and the caller's trace is theirs to stop."""
    jax.profiler.start_trace(str(tmp_path / "callers"))
    try:
        s = run(_config(tiny_data, 3, profile_start_step=2, profile_steps=1), tmp_path / "run",
                jax.devices()[:1])
    finally:
        jax.profiler.stop_trace()
    assert s.step == 3
    assert any("no profile of steps 2..2" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "callers").rglob("*.xplane.pb"))
