from absl import flags

from boost_jax import cli
from boost_jax.train import main

flags.adopt_module_key_flags(main)  # --help lists the trainer's flags, not only --helpfull
flags.adopt_module_key_flags(cli)
__doc__ = main.__doc__  # absl's --help prints the main module's docstring
main.run_app()
