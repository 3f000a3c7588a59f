"""GPU targets for the deviceless compile (analysis/gpu_target.py): the names, the one-line
errors without the plugin or with an unknown target, a spec file, the specs read out of the
plugin's library, the topology flag. No plugin needed (the compile itself:
tests/compiled/test_gpu_report.py)."""

import pytest

from boost_jax.analysis import gpu_target
from boost_jax.config import ConfigError

SPEC = 'device_description_str: "NVIDIA H100 80GB HBM3"\ngpu_device_info {\n' \
       '  core_count: 132\n  device_memory_size: 84942979072\n}\n'


def test_unknown_target_and_missing_plugin_are_one_line_errors(monkeypatch):
    with pytest.raises(ConfigError, match="is not one of h100_sxm, h100_pcie, h200"):
        gpu_target.target_config("h900")
    monkeypatch.setattr(gpu_target.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[gpu_compile\]"'):
        gpu_target.target_config("h100_sxm")

    def no_namespace(name):  # no jax_plugins package installed at all
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(gpu_target.importlib.util, "find_spec", no_namespace)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[gpu_compile\]"'):
        gpu_target.target_config("h100_sxm")


def test_a_spec_file_and_the_specs_in_the_plugin(tmp_path):
    path = tmp_path / "h100.txtpb"
    path.write_text("# a comment\n" + SPEC)
    t = gpu_target.target_config(str(path))
    assert (t.device, t.memory_bytes) == ("NVIDIA H100 80GB HBM3", 84942979072)
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF\0" + ("# XLA\n" + SPEC).encode() + b"\0other\0")
    assert gpu_target._embedded_specs(lib) == {"NVIDIA H100 80GB HBM3": "# XLA\n" + SPEC}
    with pytest.raises(ConfigError, match="not an XLA GpuTargetConfigProto"):
        gpu_target._parse("x", "gpu_device_info {}")


def test_topology_flag():
    assert gpu_target.parse_topology("2x8") == (2, 8)
    for bad in ("8", "0x8", "2x", "2*8"):
        with pytest.raises(ConfigError, match="write HOSTSxGPUS"):
            gpu_target.parse_topology(bad)
