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
  # latency hiding; FSDP's per-layer gathers and reduce-scatters pipelined across the layer loop
  export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true}"
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
fi
exec "${PYTHON:-python}" -m boost_jax.train "$@"
