"""``python -m boost_jax.tools.gpu_compile``: the train step compiled for GPUs on this host.

The command is boost_jax/commands/gpu_compile.py (every command lives in boost_jax/commands/);
this module keeps its documented name."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.gpu_compile", run_name="__main__", alter_sys=True)
