"""The ``(data, pipe, tensor)`` device mesh, and simulated host devices on CPU-only machines."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from boost_jax.errors import ConfigError
from boost_jax.parallel.config import Parallel
from boost_jax.parallel.plans.base import DATA, MESH_AXES


def request_host_devices(n: int) -> bool:
    """Ask for ``n`` CPU devices; must run before JAX initialises its backends.

    Only the CPU backend is affected, so this is harmless on GPU hosts. Returns False when the
    backends are already up (the count can no longer change).
    """
    try:
        jax.config.update("jax_num_cpu_devices", n)
        return True
    except RuntimeError:
        return False


def make_mesh(parallel: Parallel, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh with axes ``("data", "pipe", "tensor")`` (all ``Auto``) over ``devices``.

    Raises ConfigError when the mesh size differs from the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if parallel.num_devices != len(devices):
        d, p, t = parallel.shape
        raise ConfigError(f"the mesh Parallel.data x pipe x tensor = {d} x {p} x {t} needs "
                          f"{parallel.num_devices} devices, but {len(devices)} are available")
    return jax.make_mesh(parallel.shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)


def local_batch_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the global batch this process feeds: those of the data shards
    its devices hold (processes that share a data shard load the same rows)."""
    axis = mesh.axis_names.index(DATA)
    mine = sorted({coords[axis] for coords, dev in np.ndenumerate(mesh.devices)
                   if dev.process_index == jax.process_index()})
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ConfigError(f"process {jax.process_index()} holds data shards {mine}, which are "
                          "not contiguous; order the devices so each process's are")
    per_shard = global_batch // mesh.shape[DATA]
    return mine[0] * per_shard, (mine[-1] + 1) * per_shard
