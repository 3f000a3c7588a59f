"""The trainer: optimizer, jitted step, checkpoints, metrics and the ``python -m`` entry point."""
