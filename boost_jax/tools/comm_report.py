"""``python -m boost_jax.tools.comm_report``: the communication report.

The command is boost_jax/commands/comm_report.py (every command lives in boost_jax/commands/);
this module keeps its documented name."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.comm_report", run_name="__main__", alter_sys=True)
