// Integer codes with one float32 scale per block of values: the codec of a compressed gradient
// average (the warmup's), as wide as 4 or 8 bits. Portable scalar code; every element is
// computed with the same float32 operations as the torch twin (kernels/quantized.py), so that
// both give the same bits (-ffp-contract=off: no fused multiply-add).
//
// Per block of `block` values: s = max|y| / Q (Q = 2^(bits-1) - 1: 7 or 127), q = clamp(rint(y / s),
// -Q, Q) (rint: round half to even), q = 0 where s is 0 or not finite; the block decodes to s * q and its error is
// y - s * q. A row (one destination's chunk of m values, m a multiple of block): its m / block
// scales, then its codes: 8 bits as int8; 4 bits as q + 8 in a nibble, value 2k of the row in the
// low nibble of byte k and value 2k + 1 in the high one.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "onebit.h"

namespace onebit {
namespace {

inline int qmax(int bits) { return bits == 4 ? 7 : 127; }

// One block: y (block values) -> its scale, codes at `codes` (byte offset of the block's first
// value), and its error into eo (may be y, or null).
void encode_block(const float* y, int64_t block, int bits, float* scale, uint8_t* codes, float* eo) {
  const int Q = qmax(bits);
  float mx = 0.0f;
  for (int64_t i = 0; i < block; ++i) {  // a NaN propagates, as torch's amax: the scale says so
    const float a = std::fabs(y[i]);
    if (a > mx || a != a) mx = a;
    if (mx != mx) break;
  }
  const float s = mx / static_cast<float>(Q);
  *scale = s;
  const bool coded = s > 0.0f && std::isfinite(s);  // else every code 0: the scale is the news
  for (int64_t i = 0; i < block; ++i) {
    float q = 0.0f;
    if (coded) q = std::min(std::max(std::nearbyint(y[i] / s), -static_cast<float>(Q)), static_cast<float>(Q));
    const int qi = static_cast<int>(q);
    if (bits == 8) {
      codes[i] = static_cast<uint8_t>(static_cast<int8_t>(qi));
    } else if (i % 2 == 0) {
      codes[i / 2] = static_cast<uint8_t>(qi + 8);
    } else {
      codes[i / 2] = static_cast<uint8_t>(codes[i / 2] | ((qi + 8) << 4));
    }
    if (eo) {
      const float sq = s * q;
      eo[i] = y[i] - sq;
    }
  }
}

inline float code_at(const uint8_t* codes, int64_t i, int bits) {
  if (bits == 8) return static_cast<float>(static_cast<int8_t>(codes[i]));
  const unsigned b = codes[i / 2];
  return static_cast<float>(static_cast<int>(i % 2 ? b >> 4 : b & 15u) - 8);
}

inline int64_t code_bytes(int64_t values, int bits) { return values * bits / 8; }

}  // namespace

void quantize_cpu(const float* x, int64_t nx, const float* e, float* e_out, int64_t n, int bits, int64_t block,
                  uint8_t* rows, int64_t W, int64_t row_stride, int nthreads) {
  detail::check_quant("quantize_cpu", n, W, bits, block, row_stride);
  detail::require(nx >= 0 && nx <= n, "quantize_cpu", "0 <= nx <= n");
  const int64_t m = n / W, nb = m / block, nblocks = n / block;
#pragma omp parallel for schedule(static) num_threads(nthreads > 1 ? nthreads : 1)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * block, j = lo / m, k = (lo % m) / block;
    float y[detail::kMaxQuantBlock];
    for (int64_t i = 0; i < block; ++i) {
      const float xi = lo + i < nx ? x[lo + i] : 0.0f;
      y[i] = e ? xi + e[lo + i] : xi;
    }
    uint8_t* row = rows + j * row_stride;
    float scale;
    encode_block(y, block, bits, &scale, row + 4 * nb + code_bytes(k * block, bits), e_out ? e_out + lo : nullptr);
    std::memcpy(row + 4 * k, &scale, sizeof(float));
  }
}

void quantized_reduce_cpu(const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits, int64_t block,
                          const float* e, float* e_out, uint8_t* out_row, int nthreads) {
  detail::check_quant("quantized_reduce_cpu", m, 1, bits, block, row_stride);
  detail::require(W > 0, "quantized_reduce_cpu", "W > 0");
  const int64_t nb = m / block;
  const float fw = static_cast<float>(W);
#pragma omp parallel for schedule(static) num_threads(nthreads > 1 ? nthreads : 1)
  for (int64_t k = 0; k < nb; ++k) {
    float c[detail::kMaxQuantBlock] = {};
    for (int64_t r = 0; r < W; ++r) {  // rows in order: the same floats on every rank and device
      const uint8_t* row = rows + r * row_stride;
      float s;
      std::memcpy(&s, row + 4 * k, sizeof(float));
      const float w = s / fw;
      const uint8_t* codes = row + 4 * nb;
      for (int64_t i = 0; i < block; ++i) {
        const float v = w * code_at(codes, k * block + i, bits);
        c[i] += v;
      }
    }
    if (e)
      for (int64_t i = 0; i < block; ++i) c[i] += e[k * block + i];
    float scale;
    encode_block(c, block, bits, &scale, out_row + 4 * nb + code_bytes(k * block, bits),
                 e_out ? e_out + k * block : nullptr);
    std::memcpy(out_row + 4 * k, &scale, sizeof(float));
  }
}

void dequantize_cpu(const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits, int64_t block,
                    float* out, int64_t nout, int nthreads) {
  detail::check_quant("dequantize_cpu", m, 1, bits, block, row_stride);
  detail::require(W > 0 && nout >= 0 && nout <= W * m, "dequantize_cpu", "W > 0 and 0 <= nout <= W*m");
  const int64_t nb = m / block, total = W * nb;
#pragma omp parallel for schedule(static) num_threads(nthreads > 1 ? nthreads : 1)
  for (int64_t b = 0; b < total; ++b) {
    const int64_t j = b / nb, k = b % nb, lo = j * m + k * block;
    if (lo >= nout) continue;
    const uint8_t* row = rows + j * row_stride;
    float s;
    std::memcpy(&s, row + 4 * k, sizeof(float));
    const int64_t hi = std::min(lo + block, nout);
    for (int64_t i = lo; i < hi; ++i) out[i] = s * code_at(row + 4 * nb, k * block + (i - lo), bits);
  }
}

}  // namespace onebit
