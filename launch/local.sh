#!/usr/bin/env bash
# Start N training processes on this host and wait for all of them.
#
#   launch/local.sh N [python -m boost_jax.train flags...]
#   launch/local.sh 2 --gin_param=Parallel.data=2 --gin_param=Parallel.tensor=4 --workdir=runs/mp
#
# Each process joins one jax.distributed run (coordinator on 127.0.0.1, a free port) and, on
# a CPU-only host, simulates its share of the mesh's devices (gloo collectives between the
# processes). Output lines are prefixed with the process rank. A process that exits with
# 128 + SIGTERM/SIGINT stopped by an agreed signal: every other process stops after the same
# step, so the launcher waits for them (the heartbeat bounds the wait). If any process exits
# with another error, the others are stopped (SIGTERM, then SIGKILL after $GRACE seconds) and
# the launcher exits with that process's code -- it never waits on a half-dead job. A SIGTERM
# or SIGINT to the launcher is passed on to every process (each saves the same checkpoint).
set -uo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ || $1 -lt 1 ]]; then
  echo "launch/local.sh: error: the first argument must be the process count N >= 1, got '${1-}'; usage: launch/local.sh N [train flags...]" >&2
  exit 2
fi
n=$1; shift
python=${PYTHON:-python}
grace=${GRACE:-10}
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/boost_jax/jax_cache}"

pids=()
for ((i = 0; i < n; i++)); do
  "$python" -u -m boost_jax.train --coordinator_address="127.0.0.1:$port" --num_processes="$n" \
    --process_id="$i" "$@" > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  pids+=($!)
done

stop_all() {
  kill -TERM "${pids[@]}" 2>/dev/null
  for ((t = 0; t < grace * 10; t++)); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && return
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null
}
forward() {  # pass a signal on; the processes agree on a step, checkpoint and exit
  kill "-$1" "${pids[@]}" 2>/dev/null
  wait
  exit $((128 + $2))
}
trap 'forward INT 2' INT
trap 'forward TERM 15' TERM

status=0
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  wait -n -p done_pid "${running[@]}"
  code=$?
  running=("${running[@]/$done_pid}")
  running=(${running[@]})  # drop the emptied slot
  if [[ $code -eq 130 || $code -eq 143 ]]; then
    status=$code  # an agreed stop: the others are saving the same checkpoint
  elif [[ $code -ne 0 ]]; then
    echo "local.sh: process $done_pid exited with $code; stopping the others" >&2
    stop_all
    status=$code
    break
  fi
done
wait 2>/dev/null
exit $status
