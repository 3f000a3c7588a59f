"""``python -m boost_jax.export``: an alias of the command in boost_jax/commands/export.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.export", run_name="__main__", alter_sys=True)
