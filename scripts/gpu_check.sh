#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, one command that checks the GPU path:
#   1. builds the extension with CUDA (ONEBIT_CUDA=ON: no CUDA kernels is a failure),
#   2. runs the GPU tests (pytest -m cuda) and the kernel tests on both devices,
#   3. benchmarks the kernels on the GPU (benchmarks/kernel_speed.py --device cuda) and the training
#      step of each algorithm next to torch's fused AdamW (benchmarks/gpu_step.py), and profiles
#      the step of fused AdamW, 1-bit Adam and 1-bit LAMB (device time in step(), kernels),
#   4. fits the demo GPT for 40 steps on 1 GPU with each algorithm (and on every GPU, when there
#      are several),
# then prints a summary table. Uses the Python that has a CUDA torch (PYTHON, default python3);
# installs nothing else: on a machine without internet access torch, Lightning and pytest must
# be there already. Under 10 minutes on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
declare -a SUMMARY=()
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, record ok/FAILED and seconds
  local name=$1
  shift
  local t0=$SECONDS
  echo "=== $name: $*"
  if "$@" >"$OUT/$name.log" 2>&1; then
    SUMMARY+=("| $name | ok | $((SECONDS - t0)) s |")
  else
    SUMMARY+=("| $name | FAILED (see $OUT/$name.log) | $((SECONDS - t0)) s |")
  fi
  tail -n 15 "$OUT/$name.log"
}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PY has no CUDA torch or sees no GPU (torch.cuda.is_available() is False)" >&2
  exit 2
fi
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
ENV_LINE=$($PY -c "import sys, torch, lightning; print(torch.cuda.get_device_name(0), 'x', torch.cuda.device_count(), '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| lightning', lightning.__version__, '| Python', sys.version.split()[0])")
echo "$ENV_LINE"

# --no-deps / --no-build-isolation: keep the machine's torch (and build with its pybind11/cmake).
step build env ONEBIT_CUDA=ON $PY -m pip install --no-deps --no-build-isolation -e .
step cuda_built $PY -c "import lightning_onebit.kernels as K; assert K.HAS_CUDA, 'built without CUDA'; print('CUDA kernels: yes')"
step gpu_tests $PY -m pytest -q -m cuda -rs tests/
step kernel_tests $PY -m pytest -q -x tests/kernels/test_kernels.py tests/exchange/test_comm.py
step bench_kernels $PY benchmarks/kernel_speed.py --device cuda --n 100000000 --repeat 20
# the rows the benchmark tables give (STEP_ROWS=.: every row, overlap and verdict variants too)
step bench_step $PY benchmarks/gpu_step.py --only "${STEP_ROWS:-fused|in step\(\), verdict=device}"
step profile_step $PY benchmarks/gpu_step.py --profile --only "fused|(1-bit Adam|1-bit LAMB), in step"
if ! $PY -c "import jsonargparse, docstring_parser, typeshed_client" 2>/dev/null; then
  echo "gpu_check: the fits use LightningCLI, which needs jsonargparse[signatures]" \
    "(pip install 'jsonargparse[signatures]'): skipping them" >&2
  SUMMARY+=("| fits | skipped: no jsonargparse[signatures] | 0 s |")
  FITS=""
else
  FITS="onebit_adam zero_one_adam onebit_lamb"
fi
for algo in $FITS; do
  step "fit_1gpu_$algo" $PY examples/train.py fit --config "examples/configs/$algo.yaml" \
    --trainer.accelerator gpu --trainer.devices 1 --trainer.max_steps 40 \
    --trainer.val_check_interval 20 --trainer.default_root_dir "$OUT/fit_1gpu_$algo"
  if [ "$GPUS" -gt 1 ]; then
    step "fit_${GPUS}gpu_$algo" $PY examples/train.py fit --config "examples/configs/$algo.yaml" \
      --trainer.accelerator gpu --trainer.devices "$GPUS" --trainer.max_steps 40 \
      --trainer.val_check_interval 20 --trainer.default_root_dir "$OUT/fit_${GPUS}gpu_$algo"
  fi
done

echo
echo "$ENV_LINE"
echo "| check | result | time |"
echo "|---|---|---:|"
printf '%s\n' "${SUMMARY[@]}"
grep -E '^\| (worker_compress|worker_deferred|momentum_source|source_compress|server_reduce|decompress|lamb_update|adam_update|fp32 copy|fp32 fill) ' \
  "$OUT/bench_kernels.log" || true
grep -E '^\|' "$OUT/bench_step.log" || true
grep -E '^(###|device:)' "$OUT/profile_step.log" || true
! printf '%s\n' "${SUMMARY[@]}" | grep -q FAILED
