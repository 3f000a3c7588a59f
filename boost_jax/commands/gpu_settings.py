"""``python -m boost_jax.gpu_settings``: the XLA GPU flags and memory fraction the launchers set
(boost_jax/gpu_settings.py), as a table (flag, status, value, why) or, with ``--shell``, as the
export lines the launchers ``eval``.
"""

from __future__ import annotations

import shlex

from absl import app, flags

from boost_jax import cli
from boost_jax.gpu_settings import FLAGS_LIST, MEM_FRACTION, environment

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.shell:
        for k, v in environment(append=FLAGS.append).items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    width = max(len(f.name) for f in FLAGS_LIST)
    for f in FLAGS_LIST:
        print(f"{f.name:<{width}}  {f.status:<9}  {f.value or '(empty)'}: {f.why}")
    print(f"XLA_PYTHON_CLIENT_MEM_FRACTION={MEM_FRACTION}")
    return 0


if __name__ == "__main__":
    flags.DEFINE_bool("shell", False, "print export lines for a shell (what the launchers eval)")
    flags.DEFINE_bool("append", False, "--shell: append the user's XLA_FLAGS to these instead "
                      "of using them instead")
    cli.run_app("boost_jax.gpu_settings", main)
