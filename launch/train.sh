#!/usr/bin/env bash
# Single-host launcher: one process driving every local device (all GPUs of this host, or
# simulated CPU devices when there is no accelerator).
#
#   launch/train.sh --gin_file=paper/7b_tp4.gin --workdir=runs/7b [more train flags]
#
# It enables the persistent compilation cache and, on GPU hosts, the XLA flags that let
# collectives overlap with compute. Any variable already set in the environment wins.
set -euo pipefail

export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/boost_jax/jax_cache}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # XLA_FLAGS and XLA_PYTHON_CLIENT_MEM_FRACTION from one place (python -m boost_jax.gpu_settings
  # lists them); a value you set wins
  eval "$("${PYTHON:-python}" -m boost_jax.gpu_settings --shell)"
fi
exec "${PYTHON:-python}" -m boost_jax.train "$@"
