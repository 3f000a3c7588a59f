"""``python -m boost_jax.plan``: an alias of the command in boost_jax/commands/plan.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("boost_jax.commands.plan", run_name="__main__", alter_sys=True)
