"""The package's commands that belong to no one library package: ``eval``, ``export``,
``generate``, ``plan`` and ``plot``, each run as ``python -m boost_jax.<name>`` (a thin alias at
the package top) or ``python -m boost_jax.commands.<name>``. The other commands live with their
library: ``python -m boost_jax.train`` (train/), ``boost_jax.bench`` (bench/),
``boost_jax.data.prepare`` (data/) and ``boost_jax.tools.comm_report`` (tools/)."""
