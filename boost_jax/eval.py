"""``python -m boost_jax.eval``: an alias of the command in boost_jax/commands/eval.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.eval", run_name="__main__", alter_sys=True)
