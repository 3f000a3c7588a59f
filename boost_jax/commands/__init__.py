"""Every command of the package, one module each, with its flags and its ``main``: ``train``,
``eval``, ``export``, ``generate``, ``plan``, ``plot``, ``prepare``, ``bench``, ``comm_report``,
``gpu_compile`` and ``gpu_settings``. Each runs as ``python -m boost_jax.commands.<name>`` and
under its documented name -- ``python -m boost_jax.<name>`` (train, eval, export, generate,
plan, plot, bench, gpu_settings), ``boost_jax.data.prepare``, ``boost_jax.tools.comm_report``,
``boost_jax.tools.gpu_compile`` -- a thin alias that runs it (``runpy``). They share one set-up
path (boost_jax/cli.py: gin flags, logging, devices, one-line errors)."""
