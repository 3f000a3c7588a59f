"""The documented names ``python -m boost_jax.tools.comm_report`` and
``boost_jax.tools.gpu_compile`` (the commands themselves: boost_jax/commands/)."""
