#!/usr/bin/env bash
# Build the C++ kernels with AddressSanitizer + UndefinedBehaviorSanitizer and run
# cpp/test_kernels.cpp (random sizes, strides and tails; exact-size buffers), on the AVX2 path
# and on the portable path. Usage: bash scripts/sanitize.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/sanitize}
cmake -S cpp -B "$BUILD" -DONEBIT_BUILD_MODULE=OFF -DONEBIT_BUILD_TESTS=ON -DONEBIT_CUDA=OFF \
  -DONEBIT_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" -j 2 >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
"$BUILD/onebit_cpp_test"
ONEBIT_NO_SIMD=1 "$BUILD/onebit_cpp_test"
