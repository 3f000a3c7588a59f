"""``python -m boost_jax.bench``: the benchmarks.

The command is boost_jax/commands/bench.py (every command lives in boost_jax/commands/);
this module keeps its documented name."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.bench", run_name="__main__", alter_sys=True)
