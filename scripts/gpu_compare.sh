#!/usr/bin/env bash
# Before/after on one GPU, side by side in one run: the kernel benchmark and the training-step
# benchmark of two builds of the package, alternating (same machine, same minutes).
#
#   bash scripts/gpu_compare.sh BEFORE AFTER [OUT]
#
# BEFORE and AFTER are folders holding an installed lightning_onebit, each made with
#   ONEBIT_CUDA=ON pip install --no-deps --no-build-isolation --target DIR <checkout>
# (not editable: an editable install's import hook would shadow both). The benchmarks' scripts
# are this checkout's; they call only the public kernel and optimizer API. OUT (default
# runs/gpu_compare) gets one log per run and summary.md. ROUNDS (default 2): kernel benchmark
# rounds; STEP_ROWS: gpu_step.py's --only (default: fused AdamW and each algorithm in step()).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
BEFORE=$(realpath "$1")
AFTER=$(realpath "$2")
OUT=$(realpath -m "${3:-runs/gpu_compare}")
mkdir -p "$OUT"
WORK=$(mktemp -d)  # an empty working directory: the checkout's sources must not shadow a build
trap 'rm -rf "$WORK"' EXIT

for build in "$BEFORE" "$AFTER"; do
  if ! (cd "$WORK" && PYTHONPATH="$build" "$PY" -c \
    "import lightning_onebit.kernels as K, sys; sys.exit(0 if K.HAS_CUDA else 1)"); then
    echo "gpu_compare: $build has no lightning_onebit built with CUDA" >&2
    exit 2
  fi
done

bench() {  # bench NAME BUILD SCRIPT ARGS...: one benchmark run of one build, logged to OUT/NAME.log
  local name=$1 build=$2
  shift 2
  echo "=== $name"
  (cd "$WORK" && PYTHONPATH="$build" "$PY" "$REPO/$@") >"$OUT/$name.log" 2>&1
  grep -E '^\|' "$OUT/$name.log" || tail -n 20 "$OUT/$name.log"
}

KARGS=(benchmarks/kernel_speed.py --device cuda --n 100000000 --repeat 20)
SARGS=(benchmarks/gpu_step.py --only "${STEP_ROWS:-fused|in step\(\), verdict=device}")
for round in $(seq 1 "${ROUNDS:-2}"); do  # ROUNDS=0: the step benchmark only
  bench "kernels_before_$round" "$BEFORE" "${KARGS[@]}"
  bench "kernels_after_$round" "$AFTER" "${KARGS[@]}"
done
bench step_before "$BEFORE" "${SARGS[@]}"
bench step_after "$AFTER" "${SARGS[@]}"

{
  echo "# gpu_compare: $(cd "$WORK" && "$PY" -c "import torch; print(torch.cuda.get_device_name(0), '| torch', torch.__version__, 'CUDA', torch.version.cuda)")"
  echo
  echo "before: $BEFORE; after: $AFTER"
  for f in kernels_before_{1..9} kernels_after_{1..9} step_before step_after; do
    [ -f "$OUT/$f.log" ] || continue
    echo
    echo "## $f"
    grep -E '^(n = |\||\()' "$OUT/$f.log"
  done
} >"$OUT/summary.md"
cat "$OUT/summary.md"
