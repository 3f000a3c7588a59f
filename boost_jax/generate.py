"""``python -m boost_jax.generate``: an alias of the command in boost_jax/commands/generate.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.generate", run_name="__main__", alter_sys=True)
