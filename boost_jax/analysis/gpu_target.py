"""GPU targets for XLA's deviceless compile: a cluster of mock GPUs on a CPU host.

XLA's GPU compiler runs without a GPU (``jax.experimental.topologies.get_topology_desc`` with
``platform="cuda"`` and a ``target_config``: an XLA ``GpuTargetConfigProto`` in text form). The
CUDA plugin (``pip install -e ".[gpu_compile]"``: ``jax-cuda13-plugin`` and
``jax-cuda13-pjrt`` at jax's own version, without NVIDIA's libraries) carries XLA's target
specs for the GPUs it knows (openxla/xla ``xla/backends/gpu/target_config/specs/*.txtpb``),
compiled into it; :func:`target_config` reads the one named (jax >= 0.12's plugin; 0.10.2's
carries none: pass the spec file's path instead). JAX must run on the CPU platform only
(``jax_platforms='cpu'`` before any backend starts: commands/gpu_compile.py's main sets it, the
test suite's conftest sets ``JAX_PLATFORMS``); otherwise the plugin's backend fails to start on
a host without CUDA and the topology is refused.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

from boost_jax.errors import ConfigError

#: target name -> the ``device_description_str`` of XLA's spec for it (the name the GPU
#: reports, as in XLA's spec files of the same name)
TARGETS = {
    "h100_sxm": "NVIDIA H100 80GB HBM3",
    "h100_pcie": "NVIDIA H100 PCIe",
    "h200": "NVIDIA H200 141GB HBM3e",
    "a100_sxm_80": "NVIDIA A100-SXM4-80GB",
    "a100_sxm_40": "NVIDIA A100-SXM4-40GB",
    "a100_pcie_80": "NVIDIA A100 80GB PCIe",
    "b200": "NVIDIA B200",
}
#: hardware profile (analysis/hardware.py) -> the target of its GPU (plan --verify, bench
#: memory --target and gpu_compile's communication beside the performance model's)
GPU_TARGETS = {"a100_80gb_4gpu": "a100_sxm_80", "h100_sxm": "h100_sxm", "h200": "h200"}
#: the inverse: target -> hardware profile
TARGET_PROFILES = {target: profile for profile, target in GPU_TARGETS.items()}
#: the pip packages of the deviceless compile (the ``gpu_compile`` extra: jax[cuda13-local])
PLUGIN = "jax_plugins.xla_cuda13"
INSTALL = 'pip install -e ".[gpu_compile]"'


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU model: its name, XLA's target config text, the GPU's name and memory."""

    name: str
    config: str  # GpuTargetConfigProto text
    device: str  # device_description_str
    memory_bytes: int  # gpu_device_info.device_memory_size


def _plugin_library() -> Path:
    try:
        spec = importlib.util.find_spec(PLUGIN)
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"compiling for a GPU on this host needs the CUDA plugin without "
                          f"NVIDIA's libraries: {INSTALL} (jax-cuda13-plugin and "
                          f"jax-cuda13-pjrt at jax's version)")
    (lib,) = Path(next(iter(spec.submodule_search_locations))).glob("xla_cuda_plugin*.so")
    return lib


def _embedded_specs(library: Path) -> dict[str, str]:
    """``device_description_str`` -> spec text of every target spec compiled into the
    plugin (each a NUL-terminated text proto in its read-only data)."""
    data = library.read_bytes()
    out = {}
    for m in re.finditer(rb'\ndevice_description_str: "([^"\n]*)"', data):
        start, end = data.rfind(b"\0", 0, m.start()) + 1, data.find(b"\0", m.end())
        text = data[start:end].decode("utf-8", errors="strict")
        if "gpu_device_info {" in text:
            out[m.group(1).decode()] = text
    return out


def _parse(name: str, text: str) -> Target:
    device = re.search(r'^device_description_str: "([^"]*)"', text, re.M)
    memory = re.search(r"^\s*device_memory_size: (\d+)", text, re.M)
    if device is None or memory is None:
        raise ConfigError(f"--target={name}: not an XLA GpuTargetConfigProto (no "
                          "device_description_str or device_memory_size)")
    return Target(name, text, device.group(1), int(memory.group(1)))


def target_config(name: str) -> Target:
    """The target ``name`` (a key of :data:`TARGETS`) from the installed CUDA plugin, or an
    XLA ``GpuTargetConfigProto`` text file at the path ``name``."""
    if name.endswith((".txtpb", ".textproto", ".pbtxt")) or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"--target={name}: no such file")
        return _parse(name, path.read_text())
    if name not in TARGETS:
        raise ConfigError(f"--target={name!r} is not one of {', '.join(TARGETS)} (or the path "
                          "of an XLA GpuTargetConfigProto text file)")
    specs = _embedded_specs(_plugin_library())
    if TARGETS[name] not in specs:
        import jax

        raise ConfigError(f"--target={name}: the CUDA plugin of jax {jax.__version__} carries "
                          "no spec for it (jax >= 0.12's does); pass the path of XLA's spec "
                          "file (openxla/xla xla/backends/gpu/target_config/specs/"
                          f"{name}.txtpb) instead")
    return _parse(name, specs[TARGETS[name]])


def parse_topology(text: str) -> tuple[int, int]:
    """``"HOSTSxGPUS"`` (e.g. ``"2x8"``: 2 hosts of 8 GPUs) -> ``(hosts, gpus_per_host)``."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ConfigError(f"--topology={text!r}: write HOSTSxGPUS, e.g. 1x8 or 2x8")
    return int(m.group(1)), int(m.group(2))


def topology(devices: int, gpus_per_node: int) -> str:
    """``"HOSTSxGPUS"`` of ``devices`` GPUs filling nodes of ``gpus_per_node`` (inverse of
    :func:`parse_topology`)."""
    return f"{-(-devices // gpus_per_node)}x{min(devices, gpus_per_node)}"


def gpu_devices(target: Target, hosts: int, gpus_per_host: int) -> list:
    """The mock devices of ``hosts`` x ``gpus_per_host`` GPUs of ``target`` (host-major, as a
    cluster's processes number them), for a mesh that ``jit(...).lower(...).compile()``
    compiles for without a GPU."""
    from jax.experimental import topologies

    _plugin_library()
    topo = topologies.get_topology_desc(platform="cuda", target_config=target.config,
                                        topology=f"1x{hosts}x{gpus_per_host}")
    return list(topo.devices)
