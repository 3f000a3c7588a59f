#!/usr/bin/env bash
# Every GPU measurement of the project from one script, for a session with one lent GPU:
#
#   launch/gpu_session.sh setup|tests|step|micro|flags|all  OUT_DIR
#
#   setup  install boost_jax and the wheels the GPU image lacks (wheels312/, see below)
#   tests  the GPU-only tests (BOOST_JAX_GPU_TESTS=1 pytest -m gpu) and the whole suite
#   step   bench step at the 1B shape: dense (fullrank) and svd/cola/lax (btp, TP=1), remat
#          none / lowrank, bf16, seq 4096, batch 4 (the paper's 1B row), median of 10 steps,
#          with the performance model's prediction for the same configuration beside it
#   micro  bench gpu: cuDNN vs XLA attention at seq 4096, Triton kernels vs XLA, profile
#   flags  one CoLA 1B step time per candidate XLA flag (boost_jax.gpu_settings), on and off
#
# Each stage writes under OUT_DIR (tables as .txt, rows as .json) and fits in one 10-minute
# device call. The GPU image has no package index: the packages it lacks travel as wheels,
# downloaded where pip works, for the image's Python 3.12 (echo /wheels312/ >>
# .git/info/exclude, then carry wheels312):
#   pip download --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 -d wheels312 grain==0.2.18 array-record==0.8.6 \
#     portpicker==1.6.0 gin-config==0.5.0 jax-triton==0.3.1 tensorboardX
# setup installs them into $SITE (not the image's environment) and every stage puts $SITE and
# this checkout on PYTHONPATH, so nothing needs building.
set -uo pipefail
stage="${1:?usage: launch/gpu_session.sh setup|tests|step|micro|flags|all OUT_DIR}"
out="${2:?usage: launch/gpu_session.sh setup|tests|step|micro|flags|all OUT_DIR}"
mkdir -p "$out"
py="${PYTHON:-python3}"
layers="${LAYERS:-24}"  # the 1B preset's 24 layers; lower it if a row runs out of memory
shape=(--gin_param="Model.size='1b'" --gin_param="Model.n_layers=$layers"
       --gin_param="Parallel.data=1" --gin_param="Parallel.tensor=1"
       --gin_param="Train.batch_size=4" --gin_param="Train.seq_len=4096"
       --gin_param="Train.dtype='bfloat16'")
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/boost_jax_jax_cache}"
site="${SITE:-/tmp/boost_jax_site}"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

setup() {
  if [[ -d wheels312 ]]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
      wheels312/*.whl || exit 1
  fi
  nvidia-smi -L | tee "$out/device.txt"
  "$py" -c "import jax, jax_triton; print(jax.__version__, jax.devices())" | tee -a "$out/device.txt"
}

tests() {
  BOOST_JAX_GPU_TESTS=1 "$py" -m pytest -m gpu -q -rs 2>&1 | tail -30 | tee "$out/tests_gpu.txt"
  "$py" -m pytest -q -x -n 8 -p no:cacheprovider 2>&1 | tail -15 | tee "$out/tests_all.txt"
}

step() {
  eval "$("$py" -m boost_jax.gpu_settings --shell)"
  for arch in dense svd cola lax; do
    plan=btp; [[ $arch == dense ]] && plan=fullrank
    for remat in none lowrank; do
      [[ $arch == dense && $remat == lowrank ]] && remat=full
      name="step_${arch}_${remat}"
      "$py" -m boost_jax.bench step --plans=$plan --steps=10 --out="$out/$name" "${shape[@]}" \
        --gin_param="Model.arch='$arch'" --gin_param="Parallel.remat='$remat'" \
        2>&1 | tail -8 | tee "$out/$name.txt"
      "$py" -m boost_jax.bench model --hardware=h100_sxm "${shape[@]}" \
        --gin_param="Model.arch='$arch'" --gin_param="Parallel.remat='$remat'" \
        --gin_param="Parallel.tp_plan='$plan'" 2>&1 | tail -12 | tee "$out/${name}_model.txt"
    done
  done
}

micro() {
  eval "$("$py" -m boost_jax.gpu_settings --shell)"
  "$py" -m boost_jax.bench gpu --out="$out" --steps=20 2>&1 | tee "$out/micro.txt"
}

flags() {
  local candidates
  candidates=$("$py" -c "from boost_jax import gpu_settings as g; print(' '.join(
    f'--{f.name}={f.value}' for f in g.FLAGS_LIST if f.status == 'candidate'))")
  local base
  base=$("$py" -c "from boost_jax import gpu_settings as g; print(g.flag_text())")
  for flag in "" $candidates; do
    XLA_FLAGS="$base $flag" "$py" -m boost_jax.bench step --plans=btp --steps=10 \
      --out="$out/flags" "${shape[@]}" --gin_param="Model.arch='cola'" 2>&1 | tail -4 \
      | sed "s|^|${flag:-baseline} |" | tee -a "$out/flags.txt"
  done
}

case "$stage" in
  setup) setup ;; tests) tests ;; step) step ;; micro) micro ;; flags) flags ;;
  all) setup; tests; step; micro; flags ;;
  *) echo "launch/gpu_session.sh: unknown stage $stage" >&2; exit 2 ;;
esac
