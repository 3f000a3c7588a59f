#!/usr/bin/env bash
# Every GPU measurement of the project from one script, for a session with one lent GPU:
#
#   launch/gpu_session.sh STAGE[,STAGE...]  OUT_DIR
#
#   gputests  the GPU-only tests (BOOST_JAX_GPU_TESTS=1 pytest -m gpu on their three files)
#   tests     gputests, then the whole suite
#   step      bench step at the 1B shape: dense (fullrank) and svd/cola/lax (btp, TP=1), remat
#             none / lowrank, bf16, seq 4096, batch 4 (the paper's 1B row), median of 10 steps,
#             with the performance model's prediction for the same configuration beside it
#             (PREDICT=0: not), on the hardware profile of the GPU found (h200 on an H200, else
#             h100_sxm); the CoLA rows also write XLA's autotune results and the compiled
#             step's HLO. step:ARCH/REMAT+ARCH/REMAT... runs those rows only, in that order
#             (step:cola/none+dense/none)
#   micro     bench gpu: cuDNN vs XLA attention at seq 4096, Triton kernels vs XLA, profile
#   flags     one CoLA 1B step time per candidate XLA flag (boost_jax.gpu_settings), on and off
#   all       = step,micro,tests,flags (most wanted first)
#
# Stages join with commas (step,micro) and may repeat (step:cola/none,gputests,step:lax/none). Every call first installs what the image lacks: a lent
# machine goes back shortly after each call, and the next call gets a bare one. The stages then
# run in order under one time budget, BUDGET_S seconds (default 560, inside a 10-minute call):
# each command gets the time left, a command that cannot start in time is listed in
# skipped.txt, and whatever was written comes back in OUT_DIR/results.tgz (the device returns
# at most 8 files, 16 MiB each) with summary.txt, the tables, beside it; the CoLA rows' HLO
# dumps and autotune results go into hlo.tgz (the largest dumps left out to keep it under
# 15 MiB), the profile's trace stays behind (its top ops are in micro's table).
#
# Environment (defaults in brackets): BUDGET_S [560]; PYTHON [python3]; HARDWARE, the
# performance model's profile [from nvidia-smi: h200 on an H200, else h100_sxm]; the shape of
# step and flags: MODEL_SIZE [1b], LAYERS [24; lower it if a row runs out of memory], SEQ_LEN
# [4096], BATCH [4], STEPS [10], ATTENTION [cudnn: XLA's attention keeps the [b, h, s, s]
# scores of every layer, about 100 GiB at this shape without remat]; the rows of step: ARCHS ["cola dense svd lax"], REMATS ["none
# lowrank"; dense takes full for lowrank]; SITE [/tmp/boost_jax_site].
#
# The GPU image (Python 3.12, jax 0.11.2 + jax-cuda13-plugin, triton 3.6.0, torch, flax, optax,
# orbax, transformers, tokenizers, sentencepiece, tiktoken) has no package index: what
# boost_jax imports and the image lacks travels as cp312 wheels, downloaded where pip works
# (echo /wheels312/ >> .git/info/exclude, then carry wheels312; 30 MB):
#   pip download --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 -d wheels312 \
#     grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 psutil==7.2.2 gin-config==0.5.0 \
#     jax-triton==0.3.1 tensorboardX==2.6.5 matplotlib==3.11.2 contourpy==1.3.3 \
#     cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 pillow==13.0.0 pyparsing==3.3.3 \
#     python-dateutil==2.9.0.post0 six==1.17.0 orbax-checkpoint==0.12.8 nest-asyncio2==1.7.4
# (grain needs array-record and portpicker, portpicker psutil; orbax-checkpoint is the
# version the pins allow, with its nest-asyncio2, over whatever the image carries; jax-triton
# 0.3.1 needs jax>=0.8.2 and triton>=3.6, which the image's 0.11.2 and 3.6.0 meet; bench step
# draws its figures with matplotlib, the trainer writes TensorBoard events with tensorboardX.)
# They go into $SITE (not the image's environment), which joins this checkout on PYTHONPATH,
# so nothing is built; device.txt lists any module still missing. Without wheels312 (a CPU
# host, or an image that has them all) nothing is installed.
set -uo pipefail
usage="usage: launch/gpu_session.sh gputests|tests|step[:ARCH/REMAT+...]|micro|flags|all[,...] OUT_DIR"
stages="${1:?$usage}"
out="${2:?$usage}"
[[ $stages == all ]] && stages=step,micro,tests,flags
for stage in ${stages//,/ }; do
  case "${stage%%:*}" in
    gputests|tests|step|micro|flags) ;;
    *) echo "launch/gpu_session.sh: unknown stage $stage ($usage)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
work="$(mktemp -d)/results"
mkdir -p "$work"
deadline=$((SECONDS + ${BUDGET_S:-560}))
py="${PYTHON:-python3}"
steps="${STEPS:-10}"
shape=(--gin_param="Model.size='${MODEL_SIZE:-1b}'" --gin_param="Model.n_layers=${LAYERS:-24}"
       --gin_param="Parallel.data=1" --gin_param="Parallel.tensor=1"
       --gin_param="Train.batch_size=${BATCH:-4}" --gin_param="Train.seq_len=${SEQ_LEN:-4096}"
       --gin_param="Train.dtype='bfloat16'" --gin_param="Parallel.attention='${ATTENTION:-cudnn}'")
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
if [[ -z ${HARDWARE:-} ]]; then  # the performance model's profile (analysis/hardware.py)
  case "$gpu" in
    *H200*) HARDWARE=h200 ;;
    *) HARDWARE=h100_sxm ;;  # an H100, and the nearest profile for anything else
  esac
fi
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/boost_jax_jax_cache}"
site="${SITE:-/tmp/boost_jax_site}"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

pack() {  # the tables beside the archive of everything but the dumps and traces
  cat "$work"/*.txt > "$out/summary.txt" 2>/dev/null
  tar czf "$out/results.tgz" -C "$(dirname "$work")" --exclude=hlo --exclude=trace \
    --exclude=autotune.textproto results
  # the dumps: every row's autotune results and, smallest first, HLO files up to ~15 MiB
  (cd "$work" && { ls -1 ./*/autotune.textproto 2>/dev/null
    find . -path '*/hlo/*' -name '*.txt' -type f -printf '%s %p\n' 2>/dev/null | sort -n |
      awk '{ total += $1; if (total < 60 * 2^20) print $2 }'; } > "$work/../dumps.lst"
    [[ -s ../dumps.lst ]] && tar czf "$out/hlo.tgz" -T ../dumps.lst)
  if [[ -f $out/hlo.tgz ]] && (($(stat -c %s "$out/hlo.tgz") > 15 * 2**20)); then
    echo "hlo.tgz over 15 MiB: removed" >> "$out/summary.txt"; rm -f "$out/hlo.tgz"
  fi
  rm -rf "$(dirname "$work")"
}
trap pack EXIT

timed() {  # timed NAME CMD...: CMD under the time left, its output in NAME.txt
  local name=$1 left=$((deadline - SECONDS))
  shift
  if ((left < 30)); then
    echo "$name: not started, $left s left of BUDGET_S" | tee -a "$work/skipped.txt"
    return 0
  fi
  echo "== $name" | tee -a "$work/$name.txt"
  local t0=$SECONDS
  timeout "$left" "$@" 2>&1 | tee -a "$work/$name.txt" | tail -15
  echo "$name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$work/$name.txt"
}

setup() {  # the wheels (when there are any), then what this host is and still lacks
  if compgen -G "wheels312/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
      wheels312/*.whl || exit 1
  fi
  {
    echo "gpu: ${gpu:-none found}; performance model profile: $HARDWARE; $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$py" - <<'PY'
import importlib
import importlib.metadata as md
import jax
print("jax", jax.__version__, jax.devices())
dists = ("jaxlib", "flax", "optax", "orbax-checkpoint", "protobuf", "numpy", "triton",
         "jax-triton", "grain", "sentencepiece", "tokenizers", "transformers", "torch")
versions = []
for dist in dists:
    try:
        versions.append(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        versions.append(f"{dist} -")
print("versions:", ", ".join(versions))
names = ("grain", "gin", "tensorboardX", "matplotlib", "psutil", "jax_triton", "triton",
         "sentencepiece", "tokenizers", "safetensors", "tqdm", "orbax.checkpoint")
missing = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as err:  # jax_triton raises ImportError without a GPU jaxlib
        missing.append(f"{name} ({type(err).__name__}: {str(err).splitlines()[0][:80]})")
print("missing:", ", ".join(missing) or "none")
PY
  } 2>&1 | tee "$work/device.txt"
}

gputests() {
  BOOST_JAX_GPU_TESTS=1 timed tests_gpu "$py" -m pytest -m gpu -v -rs -rP -n 0 \
    -p no:cacheprovider tests/kernels/test_triton_gpu.py tests/models/test_attention_gpu.py \
    tests/parallel/test_plans_gpu.py
}

tests() {
  gputests
  timed tests_all "$py" -m pytest -q -n 8 -p no:cacheprovider
}

step() {  # step [ARCH/REMAT+...]: those rows, else every ARCHS x REMATS
  local rows="${1:-}" arch remat
  if [[ -z $rows ]]; then
    for arch in ${ARCHS:-cola dense svd lax}; do
      for remat in ${REMATS:-none lowrank}; do rows+="${rows:++}$arch/$remat"; done
    done
  fi
  eval "$("$py" -m boost_jax.gpu_settings --shell)"
  for row in ${rows//+/ }; do
    arch=${row%/*} remat=${row#*/}
    plan=btp; [[ $arch == dense ]] && plan=fullrank
    [[ $arch == dense && $remat == lowrank ]] && remat=full
    name="step_${arch}_${remat}"
    # the CoLA rows also keep XLA's autotune results and the compiled step's program, so
    # that a CPU host's deviceless compile (commands/gpu_compile.py) can load the former
    # (--xla_gpu_load_autotune_results_from) and be compared with the latter
    dumps=""
    [[ $arch == cola ]] && dumps="--xla_gpu_dump_autotune_results_to=$work/$name/autotune.textproto
      --xla_dump_to=$work/$name/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"
    XLA_FLAGS="$XLA_FLAGS ${dumps//$'\n'/ }" timed "$name" "$py" -m boost_jax.bench step \
      --plans=$plan --steps="$steps" --out="$work/$name" "${shape[@]}" \
      --gin_param="Model.arch='$arch'" --gin_param="Parallel.remat='$remat'" \
      --gin_param="Parallel.tp_plan='$plan'"
    [[ ${PREDICT:-1} == 0 ]] && continue
    timed "${name}_model" "$py" -m boost_jax.bench model --hardware="$HARDWARE" "${shape[@]}" \
      --gin_param="Model.arch='$arch'" --gin_param="Parallel.remat='$remat'" \
      --gin_param="Parallel.tp_plan='$plan'"
  done
}

micro() {
  eval "$("$py" -m boost_jax.gpu_settings --shell)"
  timed micro "$py" -m boost_jax.bench gpu --out="$work" --steps=20 \
    --gin_param="Parallel.attention='${ATTENTION:-cudnn}'"
}

flags() {
  local candidates base
  candidates=$("$py" -c "from boost_jax import gpu_settings as g; print(' '.join(
    f'--{f.name}={f.value}' for f in g.FLAGS_LIST if f.status == 'candidate'))")
  base=$("$py" -c "from boost_jax import gpu_settings as g; print(g.flag_text())")
  for flag in "" $candidates; do
    name="flags_${flag#--}"
    XLA_FLAGS="$base $flag" timed "${name//=/_}" "$py" -m boost_jax.bench step \
      --plans=btp --steps="$steps" --out="$work/flags" "${shape[@]}" \
      --gin_param="Model.arch='cola'"
  done
}

setup
for stage in ${stages//,/ }; do
  if [[ $stage == *:* ]]; then "${stage%%:*}" "${stage#*:}"; else "$stage"; fi
done
