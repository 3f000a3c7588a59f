"""``python -m boost_jax.plot``: an alias of the command in boost_jax/commands/plot.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.plot", run_name="__main__", alter_sys=True)
