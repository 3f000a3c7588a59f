"""The error a bad configuration raises: the bottom of the package's import graph, so that any
module can raise it without importing the config (boost_jax/config.py re-exports it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, reported as one line before any compilation
    (boost_jax/cli.py turns it into ``<prog>: error: <line>`` and exit code 2)."""
