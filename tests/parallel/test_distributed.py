"""Where a multi-process run's settings come from: flags, environment, SLURM."""

import pytest

from boost_jax.config import ConfigError
from boost_jax.parallel.distributed import Cluster, detect, first_slurm_host


@pytest.mark.parametrize("nodelist, host", [
    ("node7", "node7"), ("gpu[012-015,20]", "gpu012"), ("a[3],b[1-2]", "a3"),
    ("nid001,nid002", "nid001")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_single_process_needs_nothing():
    assert detect(environ={}) is None


def test_flags_win_over_environment():
    env = {"BOOST_JAX_COORDINATOR": "h:1", "BOOST_JAX_NUM_PROCESSES": "4",
           "BOOST_JAX_PROCESS_ID": "3", "SLURM_NTASKS": "8", "SLURM_PROCID": "5",
           "SLURM_JOB_NODELIST": "x[1-2]"}
    assert detect("c:9", 2, 1, "0,1", environ=env) == Cluster("c:9", 2, 1, (0, 1))
    assert detect(environ=env) == Cluster("h:1", 4, 3)


def test_slurm_detection_drives_every_local_gpu():
    env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "gpu[08-11]",
           "SLURM_LOCALID": "0", "BOOST_JAX_COORDINATOR_PORT": "4000"}
    assert detect(environ=env) == Cluster("gpu08:4000", 4, 2, None)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_processes=2), "needs --coordinator_address"),
    (dict(coordinator="h:1", num_processes=2), "needs --num_processes and --process_id"),
    (dict(coordinator="h:1", num_processes=2, process_id=5), "--process_id=5 is not in [0, 2)"),
    (dict(coordinator="host", num_processes=2, process_id=0), "must be host:port"),
])
def test_bad_settings(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        detect(environ={}, **kwargs)


def _initialize(monkeypatch, **kwargs) -> list[tuple[str, object]]:
    """``distributed.initialize`` with the rendezvous, JAX's own initialisation and the device
    request stubbed out: the JAX settings it changes, in order."""
    import jax

    from boost_jax.parallel import distributed, mesh

    updates = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    monkeypatch.setattr(mesh, "request_host_devices", lambda n: None)
    monkeypatch.setattr(distributed, "host_rendezvous", lambda cluster, timeout: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: None)
    assert distributed.initialize(Cluster("h:1", 2, 0), 8, 1.0, 5, **kwargs) == 4
    return updates


def test_initialize_leaves_the_cpu_collectives_alone_unless_asked(monkeypatch):
    """A library caller (a GPU run, a test) keeps JAX's process-wide CPU collectives setting;
    only an explicit ``cpu_collectives`` (the CLI's, for CPU-only runs) sets it."""
    assert _initialize(monkeypatch) == []
    assert _initialize(monkeypatch, cpu_collectives="gloo") == [
        ("jax_cpu_collectives_implementation", "gloo")]

