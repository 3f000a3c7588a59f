"""Multi-process runs: ``jax.distributed`` set up from flags, the environment or SLURM.

Where the settings come from, first match wins:

1. flags ``--coordinator_address=host:port --num_processes=N --process_id=i``;
2. environment ``BOOST_JAX_COORDINATOR`` (host:port), ``BOOST_JAX_NUM_PROCESSES``,
   ``BOOST_JAX_PROCESS_ID``;
3. SLURM (``SLURM_NTASKS > 1``): rank ``SLURM_PROCID`` of ``SLURM_NTASKS``, coordinator on the
   first host of ``SLURM_JOB_NODELIST`` at port ``BOOST_JAX_COORDINATOR_PORT`` (default
   12355). Each task drives every GPU it sees -- JAX's own SLURM detection assumes one GPU
   per process (``local_device_ids=[SLURM_LOCALID]``), which would hide the others when a task
   owns a whole node; ``--local_device_ids`` overrides.

A single process (none of the above) needs no initialisation. Errors are one line before any
compilation: a process count the mesh cannot use, a coordinator that does not answer within
``--distributed_timeout`` seconds, or (on process 0) peers that do not all join within it.
Both are checked by a plain TCP rendezvous on the coordinator's port before JAX starts,
because JAX aborts the process with a native stack rather than raising when registration
times out. Once running, a process
whose peer died is terminated by JAX after ``--heartbeat_timeout`` seconds, so no process waits
forever.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time

import numpy as np

from boost_jax.errors import ConfigError

DEFAULT_PORT = 12355


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins a multi-process run."""

    coordinator: str  # host:port
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[012-015,20],cpu1`` -> ``gpu012``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ConfigError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "")


def detect(coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None, local_device_ids: str | None = None,
           environ: dict | None = None) -> Cluster | None:
    """The cluster this process belongs to, or None for a single-process run."""
    env = os.environ if environ is None else environ
    ids = tuple(int(i) for i in local_device_ids.split(",")) if local_device_ids else None
    coordinator = coordinator or env.get("BOOST_JAX_COORDINATOR")
    if num_processes is None and "BOOST_JAX_NUM_PROCESSES" in env:
        num_processes = int(env["BOOST_JAX_NUM_PROCESSES"])
    if process_id is None and "BOOST_JAX_PROCESS_ID" in env:
        process_id = int(env["BOOST_JAX_PROCESS_ID"])
    if coordinator is None and int(env.get("SLURM_NTASKS", "1")) > 1:
        port = int(env.get("BOOST_JAX_COORDINATOR_PORT", DEFAULT_PORT))
        coordinator = f"{first_slurm_host(env['SLURM_JOB_NODELIST'])}:{port}"
        num_processes = num_processes or int(env["SLURM_NTASKS"])
        process_id = int(env["SLURM_PROCID"]) if process_id is None else process_id
    if coordinator is None:
        if (num_processes or 1) > 1:
            raise ConfigError(f"--num_processes={num_processes} needs --coordinator_address")
        return None
    if num_processes is None or process_id is None:
        raise ConfigError("a multi-process run needs --num_processes and --process_id with "
                          f"--coordinator_address={coordinator}")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process_id={process_id} is not in [0, {num_processes})")
    if ":" not in coordinator:
        raise ConfigError(f"--coordinator_address={coordinator!r} must be host:port")
    return Cluster(coordinator, num_processes, process_id, ids)


HELLO = b"boost_jax rendezvous"  # a peer's greeting: HELLO <process_id> <num_processes>


def _connect(address: str, timeout: float) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=2.0)
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConfigError(f"could not reach the coordinator at {address} within "
                                  f"{timeout:g} s ({err.strerror or err})") from None
            time.sleep(0.5)


def join_rendezvous(cluster: Cluster, timeout: float) -> None:
    """A peer: greet process 0 and wait until it has heard from every process (ConfigError
    when process 0 is unreachable or gives up)."""
    conn = _connect(cluster.coordinator, timeout)
    with conn:
        conn.sendall(b"%s %d %d\n" % (HELLO, cluster.process_id, cluster.num_processes))
        conn.settimeout(2 * timeout + 5)  # process 0 waits up to ``timeout`` for the rest
        try:
            reply = conn.makefile("rb").readline()
        except OSError:
            reply = b""
    if reply.strip() != b"go":
        raise ConfigError(f"process 0 at {cluster.coordinator} gave up before all "
                          f"{cluster.num_processes} processes joined")


def host_rendezvous(cluster: Cluster, timeout: float) -> None:
    """Process 0: wait on the coordinator's port until every peer has greeted, then release
    them (before JAX's coordination service takes the port). ConfigError after ``timeout`` s
    naming how many joined -- JAX itself would abort the process with a native stack."""
    port = int(cluster.coordinator.rsplit(":", 1)[1])
    dual = socket.has_dualstack_ipv6()
    server = socket.create_server(("", port), family=socket.AF_INET6 if dual else
                                  socket.AF_INET, dualstack_ipv6=dual)
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(peers) < cluster.num_processes - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, cluster.num_processes)) - set(peers))
                raise ConfigError(
                    f"{len(peers) + 1} of {cluster.num_processes} processes joined within "
                    f"{timeout:g} s (missing: process {', '.join(map(str, missing))}); check "
                    "that every process was started with the same --coordinator_address"
                ) from None
            conn.settimeout(5.0)
            try:
                words = conn.makefile("rb").readline().split()
                rank, count = int(words[-2]), int(words[-1])
            except (OSError, ValueError, IndexError):
                conn.close()  # not one of ours
                continue
            if count != cluster.num_processes:
                conn.close()
                raise ConfigError(f"process {rank} expects {count} processes, process 0 "
                                  f"{cluster.num_processes}")
            peers[rank] = conn
        for conn in peers.values():
            conn.sendall(b"go\n")
        for conn in peers.values():  # let the peers close first: the port stays free
            try:
                conn.recv(1)
            except OSError:
                pass
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def initialize(cluster: Cluster, devices_needed: int, timeout: float,
               heartbeat_timeout: int, cpu_collectives: str | None = None) -> int:
    """Join the run (before JAX touches any device); returns this process's device count.

    On a CPU-only host each process simulates ``devices_needed / num_processes`` devices (and
    talks to its peers through JAX's CPU collectives); that count must be whole.
    ``cpu_collectives`` (``"gloo"``, ``"mpi"``): set JAX's process-wide
    ``jax_cpu_collectives_implementation`` first; None (the default) leaves it as it is (JAX's
    default is gloo in jax 0.10.2). The entry point decides
    (:func:`boost_jax.cli.cpu_collectives`: gloo for CPU-only runs, never for GPU runs).
    """
    import jax

    from boost_jax.parallel.mesh import request_host_devices

    if devices_needed % cluster.num_processes:
        raise ConfigError(f"the mesh needs {devices_needed} devices, which {cluster.num_processes}"
                          " processes cannot share evenly")
    local = devices_needed // cluster.num_processes
    request_host_devices(local)  # only the CPU backend reads it
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if cluster.process_id == 0:  # process 0 hosts the coordinator itself
        host_rendezvous(cluster, timeout)
    else:
        join_rendezvous(cluster, timeout)
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
        process_id=cluster.process_id, local_device_ids=cluster.local_device_ids,
        initialization_timeout=int(timeout), heartbeat_timeout_seconds=heartbeat_timeout)
    return local


# --- decisions every process takes together -----------------------------------------------
def max_value(value: int) -> int:
    """The largest of every process's ``value`` (one all-gather; free in a single-process run).
    Every process must call it at the same point."""
    import jax

    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def gather_bytes(data: bytes) -> list[bytes]:
    """Every process's ``data``, in process order, on every process (two all-gathers: the
    lengths, then the bytes padded to the longest)."""
    import jax

    if jax.process_count() == 1:
        return [data]
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.int64(len(data)))).reshape(-1)
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [rows[i, :int(n)].tobytes() for i, n in enumerate(sizes)]


def lead_values(values: list[int]) -> list[int]:
    """Process 0's ``values`` on every process (each may pass its own list)."""
    import jax

    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(values))))
    padded = np.full(max(n, 1), -1, np.int64)  # the same shape on every process
    if jax.process_index() == 0:
        padded[:n] = values
    return [int(v) for v in multihost_utils.broadcast_one_to_all(padded)[:n]]


def barrier(name: str) -> None:
    """Wait until every process has reached ``name``."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
