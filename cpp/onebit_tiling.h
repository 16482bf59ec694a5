// Segments tiling a flat range, as the CUDA worker pass walks them when it computes an exchange
// source's values as it reads them (onebit_cuda.cu: MomentumInput, LocalInput). Host and device
// code, so that cpp/test_kernels.cpp checks the walk on the CPU under the sanitizers.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define ONEBIT_HD __host__ __device__
#else
#define ONEBIT_HD
#endif

namespace onebit {

// P segments tiling the flat range [base, base + nx) in order (the caller checks it): segment j
// holds the flat values [starts[j], starts[j] + sizes[j]), starts[0] == base, starts[j + 1] ==
// starts[j] + sizes[j]; sizes may be 0. Value i of a call is flat index base + i.
struct Tiling {
  const int64_t* starts;
  const int64_t* sizes;
  int64_t P, base;

  // The segment holding flat index f in [base, base + nx): the last whose start is <= f. An empty
  // segment shares its start with the next one, so it is never the one found.
  ONEBIT_HD int64_t find(int64_t f) const {
    int64_t lo = 0, hi = P;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (starts[mid] <= f)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }

  // visit(k, j, f) for the values i + k (k = 0..3) below nx, in order: f = base + i + k, j its
  // segment. One binary search, then a walk over the segments that end inside the four values.
  template <class Visit>
  ONEBIT_HD void walk4(int64_t i, int64_t nx, Visit&& visit) const {
    if (i >= nx) return;
    const int64_t f = base + i;
    int64_t j = find(f), end = starts[j] + sizes[j];
    for (int k = 0; k < 4 && i + k < nx; ++k) {
      while (f + k >= end && j + 1 < P) {
        ++j;
        end = starts[j] + sizes[j];
      }
      visit(k, j, f + k);
    }
  }
};

}  // namespace onebit
