// CPU kernels. The worker compression and the server stage are one pass over memory each: the error
// update needs the scale, i.e. the global norm, so both write y (c) and leave the update to the
// next call, which applies it as it reads the buffer. Each pass is one streaming sweep over fixed blocks,
// parallelised with OpenMP. Per-block work is done by block functions in two flavours:
// AVX2 (chosen at run time when the CPU has it; the binary stays portable, no -march=native)
// and portable scalar code (any CPU, also the reference for the AVX2 path).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "onebit.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ONEBIT_X86 1
#endif

namespace onebit {
namespace {

constexpr int64_t kBlock = 8192;           // values per block (multiple of 8): 32 KiB of fp32
constexpr int64_t kParallelMin = 1 << 16;  // below this many values, threads cost more than they save

inline int threads_for(int64_t n, int nthreads) { return n >= kParallelMin && nthreads > 1 ? nthreads : 1; }

// The frozen variance's denominator of one segment, computed from v as it is read: d = (sqrt(v) *
// dscale) + eps, each operation rounded on its own (the floats a buffer of torch.sqrt(v, out=d),
// d.mul_(dscale), d.add_(eps) holds; dscale 1 where no scale is given, and x * 1 is x). v null:
// no denominator (momentum_source's unpreconditioned form).
struct Denom {
  const float* v;
  float eps, dscale;
  float at(int64_t i) const { return std::sqrt(v[i]) * dscale + eps; }
  // The same denominator with flat index i at [i - lo].
  Denom from(int64_t lo) const { return {v ? v + lo : nullptr, eps, dscale}; }
};

// Segment j's Denom from the entry points' flat v and per-segment rows eps and dscale (null: 1).
inline Denom denom_of(const float* v, const float* eps, const float* dscale, int64_t j) {
  return {v, v ? eps[j] : 0.0f, dscale ? dscale[j] : 1.0f};
}

// ---------------------------------------------------------------- block functions: scalar
// Each handles [lo, hi) with lo, hi multiples of 8 and returns the block's sum of squares.

// y = x + e_true (x read only below nx), out <- packed sign(y), and eo <- y unless eo is null.
// e_true = e, or with `pending` e - sp * sign(prev): the previous call's deferred error update,
// prev its packed output for these values. eo may be e and prev may be out (each byte of prev is
// read before the same byte of out is written).
double compress_block_scalar(const float* x, int64_t nx, const float* e, float* eo, const uint8_t* prev, bool pending,
                             float sp, int64_t lo, int64_t hi, uint8_t* out) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = lo; i < hi; i += 8) {
    const unsigned pb = pending ? prev[(i - lo) / 8] : 0u;
    uint8_t b = 0;
    for (int t = 0; t < 8; ++t) {
      const float et = !pending ? e[i + t] : ((pb >> t) & 1u) ? e[i + t] - sp : e[i + t] + sp;
      const float y = (i + t < nx ? x[i + t] : 0.0f) + et;
      if (eo) eo[i + t] = y;
      acc[t] += static_cast<double>(y) * y;
      b |= static_cast<uint8_t>(y >= 0.0f) << t;
    }
    out[(i - lo) / 8] = b;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// eo <- y - s * sign(y) with y = x + e recomputed (the same float add as the compress pass);
// eo may be e.
void update_block_scalar(const float* x, int64_t nx, const float* e, float* eo, int64_t lo, int64_t hi, float s) {
  for (int64_t i = lo; i < hi; ++i) {
    const float y = (i < nx ? x[i] : 0.0f) + e[i];
    eo[i] = y >= 0.0f ? y - s : y + s;
  }
}

// Server block: c = sum_r sign_r * w_r (rows in order) + e_true, eo <- c, out <- packed sign(c).
// With `pending`, e holds the previous call's c and e_true = e - sp * sign(prev) (prev: that
// call's packed output); otherwise e_true = e. eo may be e and prev may be out (each byte of prev
// is read before the same byte of out is written); eo null: c is not stored (a call whose error
// update waits for its commit, which runs the same reduction again with eo).
// lut[(r * 256 + b) * 8 + t] is what bit t of byte b of row r decodes to (+-w_r): one load
// per row and 8 values instead of 8 bit tests.
double reduce_block_scalar(const uint8_t* bits, int64_t W, int64_t row_stride, const float* lut, const float* e,
                           float* eo, int64_t lo, int64_t hi, const uint8_t* prev, uint8_t* out, bool pending,
                           float sp) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = lo; i < hi; i += 8) {
    float c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t r = 0; r < W; ++r) {
      const float* v = lut + (r * 256 + bits[r * row_stride + i / 8]) * 8;
      for (int t = 0; t < 8; ++t) c[t] += v[t];
    }
    const unsigned pb = pending ? prev[i / 8] : 0u;
    uint8_t ob = 0;
    for (int t = 0; t < 8; ++t) {
      const float et = !pending ? e[i + t] : ((pb >> t) & 1u) ? e[i + t] - sp : e[i + t] + sp;
      c[t] += et;
      if (eo) eo[i + t] = c[t];
      acc[t] += static_cast<double>(c[t]) * c[t];
      ob |= static_cast<uint8_t>(c[t] >= 0.0f) << t;
    }
    out[i / 8] = ob;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// out[i] = bit ? s : -s for i in [lo, hi) (hi may be unaligned: the end of the output).
void decode_block_scalar(const uint8_t* in, float s, float* out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) out[i] = ((in[(i - lo) / 8] >> ((i - lo) % 8)) & 1u) ? s : -s;
}

// 1-bit LAMB's compression-phase update of [lo, hi), all in one layer (see onebit.h);
// s <- the block's max d / (sqrt(vf) + eps), sum(up^2), sum(u^2). p may be null (no decay).
struct LambCoef {
  float scaling, beta1, ob1, beta2, ob2, eps, wd;  // ob = 1 - beta, rounded from double by the caller
  bool precond;                                    // x is x / d: scale it back (x * d) first
};

void lamb_block_scalar(const float* x, float* m, Denom d, float* vf, const float* p, float* u, int64_t lo,
                       int64_t hi, LambCoef c, double* s) {
  const float ob1 = c.ob1, ob2 = c.ob2;
  float rmax = 0.0f;
  double up2 = 0.0, u2 = 0.0;
  for (int64_t i = lo; i < hi; ++i) {
    const float di = d.at(i);
    const float mn = (c.precond ? x[i] * di : x[i]) / c.scaling;
    const float g = (mn - c.beta1 * m[i]) / ob1;
    const float v = vf[i] * c.beta2 + ob2 * (g * g);
    const float up = mn / di;
    const float uu = p ? up + c.wd * p[i] : up;
    rmax = std::max(rmax, di / (std::sqrt(v) + c.eps));
    up2 += static_cast<double>(up) * up;
    u2 += static_cast<double>(uu) * uu;
    m[i] = mn;
    vf[i] = v;
    u[i] = uu;
  }
  s[0] = rmax;
  s[1] = up2;
  s[2] = u2;
}

// Adam's step (no bias correction) of one parameter's values [lo, hi) of the flat buffers; the
// parameter's own storage p is indexed from 0 at lo, its gradient g like m (its value of flat
// index i is g[i]; null: every g is +0.0, the floats a buffer of zeros gives). v is read only
// when !update_v.
// ob1 = 1 - beta1 and ob2 = 1 - beta2 come rounded from double: 1 - 0.999f is 1.3e-5 (relative) off 0.001.
struct AdamCoef {
  float lr, beta1, ob1, beta2, ob2, eps, wd;
};

void adam_block_scalar(const float* g, float* m, float* v, float* p, int64_t lo, int64_t hi, AdamCoef c,
                       bool update_v) {
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = g ? g[i] : 0.0f;
    const float mi = m[i] * c.beta1 + c.ob1 * gi;
    const float vi = update_v ? v[i] * c.beta2 + c.ob2 * (gi * gi) : v[i];
    const float pi = p[i - lo];
    const float u = mi / (std::sqrt(vi) + c.eps) + c.wd * pi;
    m[i] = mi;
    if (update_v) v[i] = vi;
    p[i - lo] = pi - c.lr * u;
  }
}

// The exchange source of one segment's values [lo, hi): u = fma(g, a, m * b), then u / d where d is
// not null. torch's `torch.mul(m, b, out=u).add_(g, alpha=a)` rounds so on x86 (its CPU add with
// alpha is a fused multiply-add), and `u.div_(d)` is one division. g is indexed like m (its value
// of flat index i is g[i]); null: every g is +0.0, the same fma as a buffer of zeros.
void source_block_scalar(const float* m, const float* g, Denom d, float* u, int64_t lo, int64_t hi, float b,
                         float a) {
  for (int64_t i = lo; i < hi; ++i) {
    const float v = std::fma(g ? g[i] : 0.0f, a, m[i] * b);
    u[i] = d.v ? v / d.at(i) : v;
  }
}

// Segment k's own storage ptrs[k] (from 0 at flat index starts[k]; ptrs or ptrs[k] null: none),
// rebased so that flat index i is at [i].
inline const float* rebased(const float* const* ptrs, const int64_t* starts, int64_t k) {
  return ptrs && ptrs[k] ? ptrs[k] - starts[k] : nullptr;
}

// momentum_source's segments as momentum_compress_cpu reads them: segment j holds the flat values
// [starts[j], ends[j]) (the segments tile the call's range in order), gradient g[j] (its own
// storage, from 0; null: zeros) and coefficients b[j], a[j]; value i of the call is flat index
// base + i.
struct MomentumSegments {
  const float* m;
  const float* const* g;
  const float* v;       // the frozen variance (null: no denominator)
  const float* eps;     // per segment, with v
  const float* dscale;  // per segment (null: 1)
  const int64_t* starts;
  const int64_t* ends;
  const float* b;
  const float* a;
  int64_t base;
};

// Segment k's value at flat index q into u[q].
inline void value1(const MomentumSegments& s, int64_t k, int64_t q, float* u) {
  source_block_scalar(s.m, rebased(s.g, s.starts, k), denom_of(s.v, s.eps, s.dscale, k), u, q, q + 1, s.b[k],
                      s.a[k]);
}

// 1-bit Adam's compression-phase update of one parameter's values [lo, hi) of the flat buffers; its
// storage p is indexed from 0 at lo. The roundings of the optimizer's torch ops: the decay
// `p.add_(p, alpha=nlw)` is fma(p, nlw, p) (applied unless nlw is +0.0); precond: `m = x * d`,
// `p.add_(x, alpha=nlr)` = fma(x, nlr, p); otherwise `m = x` (skipped when m is x) and
// `p.addcdiv_(x, d, value=nlr)` = p + (nlr * x) / d.
void frozen_block_scalar(const float* x, float* m, Denom d, float* p, int64_t lo, int64_t hi, float nlr,
                         float nlw, bool precond) {
  const bool decay = nlw != 0.0f || std::signbit(nlw);
  for (int64_t i = lo; i < hi; ++i) {
    float pi = p[i - lo];
    if (decay) pi = std::fma(pi, nlw, pi);
    const float xi = x[i];
    if (precond) {
      m[i] = xi * d.at(i);
      pi = std::fma(xi, nlr, pi);
    } else {
      if (m != x) m[i] = xi;
      pi = pi + (nlr * xi) / d.at(i);
    }
    p[i - lo] = pi;
  }
}

// One segment's coefficients of local_source: m's and g's factors, -weight_decay, -lr.
struct LocalSourceCoef {
  float b, a, nw, nlr;
};

// 0/1 Adam's sync-step exchange source of one segment's values [lo, hi) (p and acc may be null:
// no decay term, no accumulator term; g is indexed like m, null: every g is +0.0, as
// source_block_scalar's). The roundings of the optimizer's torch ops on x86 CPUs:
//   x = fma(g, a, m * b)                               torch.mul(m, b, out=x).add_(g, alpha=a)
//   precond: x = x / d;  x = fma(p, w, x)              div_(d); add_(p, alpha=w)
//   else:    x = fma(w * p, d, x)                      addcmul_(p, d, value=w)
//   x = x * nlr                                        mul_(nlr)
//   precond: x = x + acc;  else: x = fma(acc, d, x)    add_(acc); addcmul_(acc, d)
// The decay term is taken unless nw (= -w) is +0.0; torch's CPU addcmul_ is a fused
// multiply-add of (value * t1) and t2.
void local_source_block_scalar(const float* m, const float* g, Denom d, const float* p, const float* acc,
                               float* u, int64_t lo, int64_t hi, LocalSourceCoef c, bool precond) {
  const bool decay = p && (c.nw != 0.0f || std::signbit(c.nw));
  const float w = -c.nw;
  for (int64_t i = lo; i < hi; ++i) {
    const float di = d.at(i);
    float x = std::fma(g ? g[i] : 0.0f, c.a, m[i] * c.b);
    if (precond) {
      x = x / di;
      if (decay) x = std::fma(p[i], w, x);
    } else if (decay) {
      x = std::fma(w * p[i], di, x);
    }
    x = x * c.nlr;
    if (acc) x = precond ? x + acc[i] : std::fma(acc[i], di, x);
    u[i] = x;
  }
}

// local_source's segments as local_compress_cpu reads them (see MomentumSegments): segment j has
// gradient g[j] (null: zeros), parameter p[j] (its own storage from 0, as g[j]; p or p[j] null: no
// decay term) and coefficients c[j]; m, d and acc (null: no accumulator term) are flat.
struct LocalSegments {
  const float* m;
  const float* const* g;
  const float* v;       // the frozen variance
  const float* eps;     // per segment
  const float* dscale;  // per segment (null: 1)
  const float* const* p;
  const float* acc;
  const int64_t* starts;
  const int64_t* ends;
  const LocalSourceCoef* c;
  bool precond;
  int64_t base;
};

inline void value1(const LocalSegments& s, int64_t k, int64_t q, float* u) {
  local_source_block_scalar(s.m, rebased(s.g, s.starts, k), denom_of(s.v, s.eps, s.dscale, k),
                            rebased(s.p, s.starts, k), s.acc, u, q, q + 1, s.c[k], s.precond);
}

// Whether every value of g[lo, hi) is finite (g null: zeros, finite).
bool finite_block_scalar(const float* g, int64_t lo, int64_t hi) {
  if (!g) return true;
  bool ok = true;
  for (int64_t i = lo; i < hi; ++i) ok &= std::isfinite(g[i]);
  return ok;
}

// One parameter's coefficients of local_step: m's and g's factors, the decay (+0.0: none), -lr.
struct LocalStepCoef {
  float b, a, w, nlr;
};

// 0/1 Adam's local step of one parameter's values [lo, hi) (g, p indexed like m; g null: zeros).
// The roundings of the optimizer's torch ops on x86 CPUs:
//   m = fma(g, a, m * b)                 m.mul_(b).add_(g, alpha=a)
//   u = m / d;  u = fma(p, w, u)         torch.div(m, d, out=u); u.add_(p, alpha=w) (w > 0 only)
//   acc = fma(u, nlr, acc)               acc.add_(u, alpha=nlr)
//   p = fma(u, nlr, p)                   torch._foreach_add_(params, u, alpha=nlr)
void local_step_block_scalar(const float* g, float* m, Denom d, float* acc, float* p, int64_t lo, int64_t hi,
                             LocalStepCoef c) {
  const bool decay = c.w != 0.0f;
  for (int64_t i = lo; i < hi; ++i) {
    const float mi = std::fma(g ? g[i] : 0.0f, c.a, m[i] * c.b);
    const float pi = p[i];
    float u = mi / d.at(i);
    if (decay) u = std::fma(pi, c.w, u);
    m[i] = mi;
    acc[i] = std::fma(u, c.nlr, acc[i]);
    p[i] = std::fma(u, c.nlr, pi);
  }
}

// 0/1 Adam's update after a sync step's exchange of one parameter's values [lo, hi) (its storage
// p indexed from 0 at lo; p, floored and acc may be null). The roundings of the torch ops:
//   precond: m = (x * d) / nl;  synced = synced + x          torch.mul(x, d); torch.div(., nl); add_
//   else:    m = x / nl;        synced = synced + x / d      torch.div(x, nl); addcdiv_(x, d)
//   m = +0.0 where nl is +0.0 (no lr since the last sync) or floored[i] (masked_fill_);
//   p = synced; acc = 0.
void sync_block_scalar(const float* x, Denom d, const uint8_t* floored, float* m, float* synced, float* p,
                       float* acc, int64_t lo, int64_t hi, float nl, bool precond) {
  const bool zero = nl == 0.0f && !std::signbit(nl);
  for (int64_t i = lo; i < hi; ++i) {
    const float xi = x[i];
    const float di = d.at(i);
    float mi = precond ? xi * di : xi;
    mi = zero ? 0.0f : mi / nl;
    if (floored && floored[i]) mi = 0.0f;
    m[i] = mi;
    const float si = precond ? synced[i] + xi : synced[i] + xi / di;
    synced[i] = si;
    if (p) p[i - lo] = si;
    if (acc) acc[i] = 0.0f;
  }
}

#ifdef ONEBIT_X86
// ---------------------------------------------------------------- block functions: AVX2
// movemask of 8 lanes gives lane t -> bit t: exactly the wire format's LSB-first byte.

#define AVX2 __attribute__((target("avx2,fma")))

// Denom::at of the 8 values at flat index i: sqrt, multiply, add, each rounded on its own.
AVX2 inline __m256 denom8(const Denom& d, int64_t i) {
  const __m256 r = _mm256_mul_ps(_mm256_sqrt_ps(_mm256_loadu_ps(d.v + i)), _mm256_set1_ps(d.dscale));
  return _mm256_add_ps(r, _mm256_set1_ps(d.eps));
}

AVX2 inline __m256 byte_to_mask(unsigned b) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i v = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(b)), lanes);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, lanes));
}

AVX2 inline void accumulate_squares(__m256 y, __m256d& a0, __m256d& a1) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
  a0 = _mm256_fmadd_pd(lo, lo, a0);
  a1 = _mm256_fmadd_pd(hi, hi, a1);
}

AVX2 inline double hsum(__m256d a0, __m256d a1) {
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(a0, a1));
  return (t[0] + t[1]) + (t[2] + t[3]);
}

// Values from f to the next 32-byte boundary (0-7; f is 4-byte aligned): the AVX2 blocks that store
// with _mm256_stream_ps (no read for ownership of a line that is only written) start there.
inline int64_t aligned_gap(const float* f) {
  return static_cast<int64_t>((32 - (reinterpret_cast<std::uintptr_t>(f) & 31)) & 31) / 4;
}

AVX2 double compress_block_avx2(const float* x, int64_t nx, const float* e, float* eo, const uint8_t* prev,
                                bool pending, float sp, int64_t lo, int64_t hi, uint8_t* out) {
  const int64_t full = std::max(lo, std::min(hi, nx - nx % 8));  // x fully present below this
  if (full < hi) {  // the block holds the end of x: do the tail in scalar code
    double a = full > lo ? compress_block_avx2(x, nx, e, eo, prev, pending, sp, lo, full, out) : 0.0;
    const uint8_t* prev_tail = pending ? prev + (full - lo) / 8 : nullptr;
    return a + compress_block_scalar(x, nx, e, eo, prev_tail, pending, sp, full, hi, out + (full - lo) / 8);
  }
  // y is read again only by the next call: streamed stores (no read for ownership) where aligned
  const bool stream = eo && aligned_gap(eo + lo) == 0;
  const __m256 zero = _mm256_setzero_ps(), spv = _mm256_set1_ps(sp);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (int64_t i = lo; i < hi; i += 8) {
    __m256 et = _mm256_loadu_ps(e + i);
    if (pending) et = _mm256_blendv_ps(_mm256_add_ps(et, spv), _mm256_sub_ps(et, spv), byte_to_mask(*prev++));
    const __m256 y = _mm256_add_ps(_mm256_loadu_ps(x + i), et);
    if (stream) {
      _mm256_stream_ps(eo + i, y);
    } else if (eo) {
      _mm256_storeu_ps(eo + i, y);
    }
    *out++ = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(y, zero, _CMP_GE_OQ)));
    accumulate_squares(y, a0, a1);
  }
  if (stream) _mm_sfence();  // the streamed stores before anything this thread does next
  return hsum(a0, a1);
}

// local_source's coefficients of one segment in registers (see local_source_block_scalar).
struct LocalLanes {
  __m256 b, a, w, lr;
  bool decay;
};

AVX2 inline LocalLanes local_lanes(LocalSourceCoef c, bool with_p) {
  return {_mm256_set1_ps(c.b), _mm256_set1_ps(c.a), _mm256_set1_ps(-c.nw), _mm256_set1_ps(c.nlr),
          with_p && (c.nw != 0.0f || std::signbit(c.nw))};
}

// local_source_block_scalar's 8 values at i (g null: zeros), in registers.
AVX2 inline __m256 local_source8(const float* m, const float* g, const Denom& d, const float* p, const float* acc,
                                 int64_t i, const LocalLanes& l, bool precond) {
  const __m256 gi = g ? _mm256_loadu_ps(g + i) : _mm256_setzero_ps();
  const __m256 di = denom8(d, i);
  __m256 x = _mm256_fmadd_ps(gi, l.a, _mm256_mul_ps(_mm256_loadu_ps(m + i), l.b));
  if (precond) {
    x = _mm256_div_ps(x, di);
    if (l.decay) x = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), l.w, x);
  } else if (l.decay) {
    x = _mm256_fmadd_ps(_mm256_mul_ps(l.w, _mm256_loadu_ps(p + i)), di, x);
  }
  x = _mm256_mul_ps(x, l.lr);
  if (acc) {
    const __m256 ai = _mm256_loadu_ps(acc + i);
    x = precond ? _mm256_add_ps(x, ai) : _mm256_fmadd_ps(ai, di, x);
  }
  return x;
}

// A source's coefficients of one segment in registers, and its gradient (g[f]: flat index f).
struct MomentumLanes {
  __m256 b, a;
  const float* g;
  Denom d;
};

AVX2 inline MomentumLanes lanes_of(const MomentumSegments& s, int64_t j) {
  return {_mm256_set1_ps(s.b[j]), _mm256_set1_ps(s.a[j]), rebased(s.g, s.starts, j),
          denom_of(s.v, s.eps, s.dscale, j)};
}

// source_block_avx2's 8 values at flat index f, all in the segment of l.
AVX2 inline __m256 values8(const MomentumSegments& s, const MomentumLanes& l, int64_t f) {
  const __m256 gi = l.g ? _mm256_loadu_ps(l.g + f) : _mm256_setzero_ps();
  const __m256 x = _mm256_fmadd_ps(gi, l.a, _mm256_mul_ps(_mm256_loadu_ps(s.m + f), l.b));
  return l.d.v ? _mm256_div_ps(x, denom8(l.d, f)) : x;
}

struct LocalSegmentLanes {
  LocalLanes l;
  const float* g;
  const float* p;
  Denom d;
};

AVX2 inline LocalSegmentLanes lanes_of(const LocalSegments& s, int64_t j) {
  const float* p = rebased(s.p, s.starts, j);
  return {local_lanes(s.c[j], p != nullptr), rebased(s.g, s.starts, j), p, denom_of(s.v, s.eps, s.dscale, j)};
}

AVX2 inline __m256 values8(const LocalSegments& s, const LocalSegmentLanes& l, int64_t f) {
  return local_source8(s.m, l.g, l.d, l.p, s.acc, f, l.l, s.precond);
}

// A source's (MomentumSegments, LocalSegments) 8 values of call index i (flat index s.base + i), in
// registers: j is advanced to the segment holding the first of them; lanes holds segment seg's
// coefficients (reloaded when j moves on).
template <class Src, class Lanes>
AVX2 inline __m256 source8(const Src& s, int64_t i, int64_t& j, int64_t& seg, Lanes& lanes) {
  const int64_t f = s.base + i;
  while (f >= s.ends[j]) ++j;
  if (f + 8 <= s.ends[j]) {  // the 8 values in one segment
    if (j != seg) {
      seg = j;
      lanes = lanes_of(s, j);
    }
    return values8(s, lanes, f);
  }
  alignas(32) float t[8];  // across a segment boundary: value by value, each with its own segment
  for (int64_t q = f, k = j; q < f + 8; ++q) {
    while (q >= s.ends[k]) ++k;
    value1(s, k, q, t - f);
  }
  return _mm256_load_ps(t);
}

// compress_block_avx2 of a source's values (MomentumSegments, LocalSegments) for a block entirely
// below the input's end (nx - nx % 8), computed in registers as they are read: the same floats and
// sum. j: the segment holding the block's first value. eo null: y is not written.
template <class Src>
AVX2 double source_compress_block_avx2(const Src& s, int64_t j, const float* e, float* eo, const uint8_t* prev,
                                       bool pending, float sp, int64_t lo, int64_t hi, uint8_t* out) {
  const bool stream = eo && aligned_gap(eo + lo) == 0;  // (as compress_block_avx2)
  const __m256 zero = _mm256_setzero_ps(), spv = _mm256_set1_ps(sp);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t seg = -1;
  decltype(lanes_of(s, 0)) lanes{};
  for (int64_t i = lo; i < hi; i += 8) {
    const __m256 x = source8(s, i, j, seg, lanes);
    __m256 et = _mm256_loadu_ps(e + i);
    if (pending) et = _mm256_blendv_ps(_mm256_add_ps(et, spv), _mm256_sub_ps(et, spv), byte_to_mask(*prev++));
    const __m256 y = _mm256_add_ps(x, et);
    if (stream) {
      _mm256_stream_ps(eo + i, y);
    } else if (eo) {
      _mm256_storeu_ps(eo + i, y);
    }
    *out++ = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(y, zero, _CMP_GE_OQ)));
    accumulate_squares(y, a0, a1);
  }
  if (stream) _mm_sfence();
  return hsum(a0, a1);
}

// update_block_avx2 of a source's values for a block entirely below the input's end, computed in
// registers as source_compress_block_avx2 computes them: eo <- y - sc * sign(y), y = x + e (the
// compression's floats, recomputed). eo may be e. Returns the sum of y^2 as
// source_compress_block_avx2 returns it (the same floats give the same sum).
template <class Src>
AVX2 double source_update_block_avx2(const Src& s, int64_t j, const float* e, float* eo, int64_t lo, int64_t hi,
                                     float sc) {
  const __m256 zero = _mm256_setzero_ps(), sv = _mm256_set1_ps(sc);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t seg = -1;
  decltype(lanes_of(s, 0)) lanes{};
  for (int64_t i = lo; i < hi; i += 8) {
    const __m256 y = _mm256_add_ps(source8(s, i, j, seg, lanes), _mm256_loadu_ps(e + i));
    const __m256 ge = _mm256_cmp_ps(y, zero, _CMP_GE_OQ);
    _mm256_storeu_ps(eo + i, _mm256_blendv_ps(_mm256_add_ps(y, sv), _mm256_sub_ps(y, sv), ge));
    accumulate_squares(y, a0, a1);
  }
  return hsum(a0, a1);
}

AVX2 void update_block_avx2(const float* x, int64_t nx, const float* e, float* eo, int64_t lo, int64_t hi, float s) {
  const int64_t full = std::max(lo, std::min(hi, nx));  // x present below this (any alignment)
  const __m256 zero = _mm256_setzero_ps(), sv = _mm256_set1_ps(s);
  int64_t i = lo;
  for (; i + 8 <= full; i += 8) {
    const __m256 y = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i));
    const __m256 ge = _mm256_cmp_ps(y, zero, _CMP_GE_OQ);
    _mm256_storeu_ps(eo + i, _mm256_blendv_ps(_mm256_add_ps(y, sv), _mm256_sub_ps(y, sv), ge));
  }
  if (i < hi) update_block_scalar(x, nx, e, eo, i, hi, s);
}

AVX2 double reduce_block_avx2(const uint8_t* bits, int64_t W, int64_t row_stride, const float* lut, const float* e,
                              float* eo, int64_t lo, int64_t hi, const uint8_t* prev, uint8_t* out, bool pending,
                              float sp) {
  const __m256 zero = _mm256_setzero_ps(), spv = _mm256_set1_ps(sp);
  const bool stream = eo && aligned_gap(eo + lo) == 0;  // c is read again only by the next call
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (int64_t i = lo; i < hi; i += 8) {
    __m256 c = zero;
    for (int64_t r = 0; r < W; ++r) c = _mm256_add_ps(c, _mm256_loadu_ps(lut + (r * 256 + bits[r * row_stride + i / 8]) * 8));
    __m256 et = _mm256_loadu_ps(e + i);
    if (pending) et = _mm256_blendv_ps(_mm256_add_ps(et, spv), _mm256_sub_ps(et, spv), byte_to_mask(prev[i / 8]));
    c = _mm256_add_ps(c, et);
    if (stream) {
      _mm256_stream_ps(eo + i, c);
    } else if (eo) {
      _mm256_storeu_ps(eo + i, c);
    }
    out[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(c, zero, _CMP_GE_OQ)));
    accumulate_squares(c, a0, a1);
  }
  if (stream) _mm_sfence();
  return hsum(a0, a1);
}

// Stream: non-temporal stores where out is aligned (decompress: the whole output is decoded before
// it is read); not for a block decoded into scratch that is read right after (SignRuns).
template <bool Stream>
AVX2 void decode_block_avx2(const uint8_t* in, float s, float* out, int64_t lo, int64_t hi) {
  const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
  int64_t i = lo;
  if (Stream && aligned_gap(out + lo) == 0) {
    for (; i + 8 <= hi; i += 8) _mm256_stream_ps(out + i, _mm256_blendv_ps(neg, pos, byte_to_mask(*in++)));
    _mm_sfence();
  } else {
    for (; i + 8 <= hi; i += 8) _mm256_storeu_ps(out + i, _mm256_blendv_ps(neg, pos, byte_to_mask(*in++)));
  }
  if (i < hi) decode_block_scalar(in, s, out, i, hi);
}

AVX2 void lamb_block_avx2(const float* x, float* m, Denom d, float* vf, const float* p, float* u,
                          int64_t lo, int64_t hi, LambCoef c, double* s) {
  const __m256 sc = _mm256_set1_ps(c.scaling), b1 = _mm256_set1_ps(c.beta1), ob1 = _mm256_set1_ps(c.ob1);
  const __m256 b2 = _mm256_set1_ps(c.beta2), ob2 = _mm256_set1_ps(c.ob2);
  const __m256 eps = _mm256_set1_ps(c.eps), wd = _mm256_set1_ps(c.wd);
  __m256 rmax = _mm256_setzero_ps();
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), b0 = _mm256_setzero_pd(), bb1 = _mm256_setzero_pd();
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 dd = denom8(d, i);
    const __m256 xi = c.precond ? _mm256_mul_ps(_mm256_loadu_ps(x + i), dd) : _mm256_loadu_ps(x + i);
    const __m256 mn = _mm256_div_ps(xi, sc);
    const __m256 g = _mm256_div_ps(_mm256_sub_ps(mn, _mm256_mul_ps(b1, _mm256_loadu_ps(m + i))), ob1);
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(vf + i), b2), _mm256_mul_ps(ob2, _mm256_mul_ps(g, g)));
    const __m256 up = _mm256_div_ps(mn, dd);
    const __m256 uu = p ? _mm256_add_ps(up, _mm256_mul_ps(wd, _mm256_loadu_ps(p + i))) : up;
    rmax = _mm256_max_ps(rmax, _mm256_div_ps(dd, _mm256_add_ps(_mm256_sqrt_ps(v), eps)));
    accumulate_squares(up, a0, a1);
    accumulate_squares(uu, b0, bb1);
    _mm256_storeu_ps(m + i, mn);
    _mm256_storeu_ps(vf + i, v);
    _mm256_storeu_ps(u + i, uu);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, rmax);
  double tail[3] = {0.0, 0.0, 0.0};
  if (i < hi) lamb_block_scalar(x, m, d, vf, p, u, i, hi, c, tail);
  float r = static_cast<float>(tail[0]);
  for (float q : t) r = std::max(r, q);
  s[0] = r;
  s[1] = hsum(a0, a1) + tail[1];
  s[2] = hsum(b0, bb1) + tail[2];
}

AVX2 void adam_block_avx2(const float* g, float* m, float* v, float* p, int64_t lo, int64_t hi, AdamCoef c,
                          bool update_v) {
  const __m256 b1 = _mm256_set1_ps(c.beta1), ob1 = _mm256_set1_ps(c.ob1);
  const __m256 b2 = _mm256_set1_ps(c.beta2), ob2 = _mm256_set1_ps(c.ob2);
  const __m256 eps = _mm256_set1_ps(c.eps), wd = _mm256_set1_ps(c.wd), lr = _mm256_set1_ps(c.lr);
  float* q = p - lo;  // q[i] is the parameter's value of flat index i
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 gi = g ? _mm256_loadu_ps(g + i) : _mm256_setzero_ps();
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1), _mm256_mul_ps(ob1, gi));
    __m256 vi = _mm256_loadu_ps(v + i);
    if (update_v) vi = _mm256_add_ps(_mm256_mul_ps(vi, b2), _mm256_mul_ps(ob2, _mm256_mul_ps(gi, gi)));
    const __m256 pi = _mm256_loadu_ps(q + i);
    const __m256 u = _mm256_add_ps(_mm256_div_ps(mi, _mm256_add_ps(_mm256_sqrt_ps(vi), eps)), _mm256_mul_ps(wd, pi));
    _mm256_storeu_ps(m + i, mi);
    if (update_v) _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(q + i, _mm256_sub_ps(pi, _mm256_mul_ps(lr, u)));
  }
  if (i < hi) adam_block_scalar(g, m, v, q + i, i, hi, c, update_v);
}


// Stream: u is not read back soon (the flat buffer: stores past the cache, no read for ownership);
// otherwise u is a tile the caller reads at once (plain stores).
template <bool Stream>
AVX2 void source_block_avx2(const float* m, const float* g, Denom d, float* u, int64_t lo, int64_t hi, float b,
                            float a) {
  const __m256 bv = _mm256_set1_ps(b), av = _mm256_set1_ps(a);
  const int64_t head = Stream ? std::min(hi, lo + aligned_gap(u + lo)) : lo;  // u + i 32-byte aligned from here
  if (lo < head) source_block_scalar(m, g, d, u, lo, head, b, a);
  int64_t i = head;
  for (; i + 8 <= hi; i += 8) {
    const __m256 gi = g ? _mm256_loadu_ps(g + i) : _mm256_setzero_ps();
    __m256 v = _mm256_fmadd_ps(gi, av, _mm256_mul_ps(_mm256_loadu_ps(m + i), bv));
    if (d.v) v = _mm256_div_ps(v, denom8(d, i));
    if (Stream) {
      _mm256_stream_ps(u + i, v);
    } else {
      _mm256_storeu_ps(u + i, v);
    }
  }
  if (Stream) _mm_sfence();  // the streamed stores before anything this thread does next
  if (i < hi) source_block_scalar(m, g, d, u, i, hi, b, a);
}

AVX2 void frozen_block_avx2(const float* x, float* m, Denom d, float* p, int64_t lo, int64_t hi, float nlr,
                            float nlw, bool precond) {
  const bool decay = nlw != 0.0f || std::signbit(nlw);
  const __m256 lr = _mm256_set1_ps(nlr), lw = _mm256_set1_ps(nlw);
  float* q = p - lo;  // q[i] is the parameter's value of flat index i
  const int64_t head = precond ? std::min(hi, lo + aligned_gap(m + lo)) : lo;  // m + i aligned from here
  if (lo < head) frozen_block_scalar(x, m, d, p, lo, head, nlr, nlw, precond);
  int64_t i = head;
  for (; i + 8 <= hi; i += 8) {
    __m256 pi = _mm256_loadu_ps(q + i);
    if (decay) pi = _mm256_fmadd_ps(pi, lw, pi);
    const __m256 xi = _mm256_loadu_ps(x + i);
    if (precond) {
      _mm256_stream_ps(m + i, _mm256_mul_ps(xi, denom8(d, i)));  // (not read this step)
      pi = _mm256_fmadd_ps(xi, lr, pi);
    } else {
      if (m != x) _mm256_storeu_ps(m + i, xi);
      pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(lr, xi), denom8(d, i)));
    }
    _mm256_storeu_ps(q + i, pi);
  }
  _mm_sfence();  // the streamed stores before anything this thread does next
  if (i < hi) frozen_block_scalar(x, m, d, q + i, i, hi, nlr, nlw, precond);
}

// Stream: as source_block_avx2's.
template <bool Stream>
AVX2 void local_source_block_avx2(const float* m, const float* g, Denom d, const float* p, const float* acc,
                                  float* u, int64_t lo, int64_t hi, LocalSourceCoef c, bool precond) {
  const LocalLanes l = local_lanes(c, p != nullptr);
  const int64_t head = Stream ? std::min(hi, lo + aligned_gap(u + lo)) : lo;  // u + i 32-byte aligned from here
  if (lo < head) local_source_block_scalar(m, g, d, p, acc, u, lo, head, c, precond);
  int64_t i = head;
  for (; i + 8 <= hi; i += 8) {
    const __m256 x = local_source8(m, g, d, p, acc, i, l, precond);
    if (Stream) {
      _mm256_stream_ps(u + i, x);  // (read by the exchange, not at once: no read for ownership)
    } else {
      _mm256_storeu_ps(u + i, x);
    }
  }
  if (Stream) _mm_sfence();  // the streamed stores before anything this thread does next
  if (i < hi) local_source_block_scalar(m, g, d, p, acc, u, i, hi, c, precond);
}

AVX2 bool finite_block_avx2(const float* g, int64_t lo, int64_t hi) {
  if (!g) return true;
  const __m256 zero = _mm256_setzero_ps();
  __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    all = _mm256_and_ps(all, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_EQ_OQ));  // x - x: NaN unless finite
  }
  return _mm256_movemask_ps(all) == 0xFF && finite_block_scalar(g, i, hi);
}

AVX2 void local_step_block_avx2(const float* g, float* m, Denom d, float* acc, float* p, int64_t lo, int64_t hi,
                                LocalStepCoef c) {
  const bool decay = c.w != 0.0f;
  const __m256 bv = _mm256_set1_ps(c.b), av = _mm256_set1_ps(c.a), wv = _mm256_set1_ps(c.w),
               lr = _mm256_set1_ps(c.nlr);
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 gi = g ? _mm256_loadu_ps(g + i) : _mm256_setzero_ps();
    const __m256 mi = _mm256_fmadd_ps(gi, av, _mm256_mul_ps(_mm256_loadu_ps(m + i), bv));
    const __m256 pi = _mm256_loadu_ps(p + i);
    __m256 u = _mm256_div_ps(mi, denom8(d, i));
    if (decay) u = _mm256_fmadd_ps(pi, wv, u);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(u, lr, _mm256_loadu_ps(acc + i)));
    _mm256_storeu_ps(p + i, _mm256_fmadd_ps(u, lr, pi));
  }
  if (i < hi) local_step_block_scalar(g, m, d, acc, p, i, hi, c);
}

AVX2 void sync_block_avx2(const float* x, Denom d, const uint8_t* floored, float* m, float* synced, float* p,
                          float* acc, int64_t lo, int64_t hi, float nl, bool precond) {
  const bool zero = nl == 0.0f && !std::signbit(nl);
  const __m256 nlv = _mm256_set1_ps(nl), z = _mm256_setzero_ps();
  float* q = p ? p - lo : nullptr;  // q[i] is the parameter's value of flat index i
  const int64_t head = std::min(hi, lo + aligned_gap(m + lo));  // m + i aligned from here
  // acc + i too when acc and m are equally aligned (the optimizer's flat buffers)
  const bool stream_acc =
      acc && ((reinterpret_cast<std::uintptr_t>(acc) - reinterpret_cast<std::uintptr_t>(m)) & 31) == 0;
  if (lo < head) sync_block_scalar(x, d, floored, m, synced, p, acc, lo, head, nl, precond);
  int64_t i = head;
  for (; i + 8 <= hi; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    __m256 mi = z;
    if (!zero) mi = _mm256_div_ps(precond ? _mm256_mul_ps(xi, denom8(d, i)) : xi, nlv);
    if (floored) {  // 8 bytes 0/1 -> lanes of all ones where set
      const __m128i f8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(floored + i));
      const __m256i f = _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(f8), _mm256_setzero_si256());
      mi = _mm256_andnot_ps(_mm256_castsi256_ps(f), mi);
    }
    _mm256_stream_ps(m + i, mi);  // (not read this step)
    const __m256 si = _mm256_loadu_ps(synced + i);
    const __m256 sn = precond ? _mm256_add_ps(si, xi) : _mm256_add_ps(si, _mm256_div_ps(xi, denom8(d, i)));
    _mm256_storeu_ps(synced + i, sn);
    if (q) _mm256_storeu_ps(q + i, sn);
    if (stream_acc) {
      _mm256_stream_ps(acc + i, z);  // (not read this step)
    } else if (acc) {
      _mm256_storeu_ps(acc + i, z);
    }
  }
  _mm_sfence();  // the streamed stores before anything this thread does next
  if (i < hi) sync_block_scalar(x, d, floored, m, synced, q ? q + i : nullptr, acc, i, hi, nl, precond);
}

#endif  // ONEBIT_X86

// ---------------------------------------------------------------- dispatch

struct Impl {
  double (*compress)(const float*, int64_t, const float*, float*, const uint8_t*, bool, float, int64_t, int64_t,
                     uint8_t*);
  double (*reduce)(const uint8_t*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t,
                   const uint8_t*, uint8_t*, bool, float);
  void (*decode)(const uint8_t*, float, float*, int64_t, int64_t);
  void (*decode_kept)(const uint8_t*, float, float*, int64_t, int64_t);  // no streaming stores
  void (*update)(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
  void (*lamb)(const float*, float*, Denom, float*, const float*, float*, int64_t, int64_t, LambCoef,
               double*);
  void (*adam)(const float*, float*, float*, float*, int64_t, int64_t, AdamCoef, bool);
  void (*source)(const float*, const float*, Denom, float*, int64_t, int64_t, float, float);
  void (*source_tile)(const float*, const float*, Denom, float*, int64_t, int64_t, float, float);
  // null: no fused form (momentum_compress_cpu fills a tile with source_tile and compresses it)
  double (*momentum_compress)(const MomentumSegments&, int64_t, const float*, float*, const uint8_t*, bool, float,
                              int64_t, int64_t, uint8_t*);
  void (*frozen)(const float*, float*, Denom, float*, int64_t, int64_t, float, float, bool);
  void (*local_source)(const float*, const float*, Denom, const float*, const float*, float*, int64_t, int64_t,
                       LocalSourceCoef, bool);
  void (*local_source_tile)(const float*, const float*, Denom, const float*, const float*, float*, int64_t,
                            int64_t, LocalSourceCoef, bool);
  // null: no fused form (as momentum_compress)
  double (*local_compress)(const LocalSegments&, int64_t, const float*, float*, const uint8_t*, bool, float, int64_t,
                           int64_t, uint8_t*);
  void (*sync)(const float*, Denom, const uint8_t*, float*, float*, float*, float*, int64_t, int64_t, float,
               bool);
  bool (*finite)(const float*, int64_t, int64_t);
  void (*local_step)(const float*, float*, Denom, float*, float*, int64_t, int64_t, LocalStepCoef);
  // null: no fused form (the update fills a tile with the source's tile and updates from it)
  double (*momentum_update)(const MomentumSegments&, int64_t, const float*, float*, int64_t, int64_t, float);
  double (*local_update)(const LocalSegments&, int64_t, const float*, float*, int64_t, int64_t, float);
};

const Impl& impl() {
  static const Impl chosen = [] {
#ifdef ONEBIT_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !std::getenv("ONEBIT_NO_SIMD"))
      return Impl{compress_block_avx2,
                  reduce_block_avx2,
                  decode_block_avx2<true>,
                  decode_block_avx2<false>,
                  update_block_avx2,
                  lamb_block_avx2,
                  adam_block_avx2,
                  source_block_avx2<true>,
                  source_block_avx2<false>,
                  source_compress_block_avx2<MomentumSegments>,
                  frozen_block_avx2,
                  local_source_block_avx2<true>,
                  local_source_block_avx2<false>,
                  source_compress_block_avx2<LocalSegments>,
                  sync_block_avx2,
                  finite_block_avx2,
                  local_step_block_avx2,
                  source_update_block_avx2<MomentumSegments>,
                  source_update_block_avx2<LocalSegments>};
#endif
    return Impl{compress_block_scalar,
                reduce_block_scalar,
                decode_block_scalar,
                decode_block_scalar,
                update_block_scalar,
                lamb_block_scalar,
                adam_block_scalar,
                source_block_scalar,
                source_block_scalar,
                nullptr,
                frozen_block_scalar,
                local_source_block_scalar,
                local_source_block_scalar,
                nullptr,
                sync_block_scalar,
                finite_block_scalar,
                local_step_block_scalar,
                nullptr,
                nullptr};
  }();
  return chosen;
}

// Blocks of at most kBlock values that never straddle two segments (parameters): segment j holds
// [starts[j], starts[j] + sizes[j]). Each value belongs to one block; returns the total count.
int64_t segment_blocks(int64_t P, const int64_t* starts, const int64_t* sizes, std::vector<int64_t>& owner,
                       std::vector<int64_t>& lows) {
  int64_t n = 0;
  for (int64_t j = 0; j < P; ++j) {
    for (int64_t lo = starts[j]; lo < starts[j] + sizes[j]; lo += kBlock) owner.push_back(j), lows.push_back(lo);
    n += sizes[j];
  }
  return n;
}

// The values [lo, hi) of the runs into buf[0, hi - lo) (every run's bits start on a byte).
void fill_from_runs(const SignRuns& xs, int64_t lo, int64_t hi, float* buf) {
  const auto decode = impl().decode_kept;
  for (int64_t k = std::upper_bound(xs.hi, xs.hi + xs.n, lo) - xs.hi; k < xs.n && xs.lo[k] < hi; ++k) {
    const int64_t r = xs.lo[k], b = std::min(hi, xs.hi[k]);
    const uint8_t* bits = xs.bits[k];
    const float s = xs.scale[k];
    int64_t a = std::max(lo, r);
    for (; a < b && (a - r) % 8 != 0; ++a) buf[a - lo] = ((bits[(a - r) / 8] >> ((a - r) % 8)) & 1u) ? s : -s;
    if (a < b) decode(bits + (a - r) / 8, s, buf, a - lo, b - lo);
  }
}

// Refuse runs (if any) that are not sorted, contiguous and non-empty, or that do not hold every
// value of the P segments [starts[j], starts[j] + sizes[j]).
void check_runs_cover(const char* what, const SignRuns* xs, int64_t P, const int64_t* starts, const int64_t* sizes) {
  if (!xs) return;
  bool ok = xs->n > 0;
  for (int64_t k = 0; ok && k < xs->n; ++k)
    ok = xs->hi[k] > xs->lo[k] && (!k || xs->lo[k] == xs->hi[k - 1]) && xs->bits[k];
  for (int64_t j = 0; ok && j < P; ++j)
    ok = sizes[j] <= 0 || (xs->lo[0] <= starts[j] && starts[j] + sizes[j] <= xs->hi[xs->n - 1]);
  detail::require(ok, what, "runs that tile every segment's values");
}

// Sum block partials in a fixed order and turn the sum of squares into the scale.
float finish_scale(const std::vector<double>& partial, int64_t n) {
  double total = 0.0;
  for (double p : partial) total += p;
  return static_cast<float>(std::sqrt(total) / std::sqrt(static_cast<double>(n)));
}

// The blocks of one worker compression (a block: at most kBlock values of one row of n / W), in
// parallel: block(lo, hi, byte) handles values [lo, hi) (byte: their first byte's offset in the
// rows of bits, row_stride bytes apart) and returns their sum of squares; returns the scale of
// the sum, the partials added in block order.
template <class Block>
float row_blocks(Block block, int64_t n, int64_t W, int64_t row_stride, int nthreads) {
  const int64_t m = n / W;
  const int64_t nb = (m + kBlock - 1) / kBlock;  // blocks per row: a block never straddles rows
  const int64_t total = nb * W;
  std::vector<double> partial(static_cast<size_t>(total));
  const int nt = threads_for(n, nthreads);

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t blk = 0; blk < total; ++blk) {
    const int64_t j = blk / nb, lo = j * m + (blk % nb) * kBlock;
    const int64_t hi = std::min(lo + kBlock, (j + 1) * m);
    partial[blk] = block(lo, hi, j * row_stride + (lo - j * m) / 8);
  }
  return finish_scale(partial, n);
}

// row_blocks of a worker compression: block(lo, hi, prev, out) compresses values [lo, hi) (prev:
// that block's bytes of prev_bits, null without pending; out: its bytes of bits).
template <class Block>
float compress_blocks(Block block, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride, const uint8_t* prev_bits,
                      bool pending, float* scale_out, int nthreads) {
  const auto rows = [&](int64_t lo, int64_t hi, int64_t byte) {
    return block(lo, hi, pending ? prev_bits + byte : nullptr, bits + byte);
  };
  const float s = row_blocks(rows, n, W, row_stride, nthreads);
  *scale_out = s;
  return s;
}

// The ends of a source's P segments, checked to tile [base, base + nx) in order (what: the caller).
std::vector<int64_t> tiling_ends(const char* what, int64_t P, const int64_t* starts, const int64_t* sizes,
                                 int64_t base, int64_t nx) {
  detail::check_segments(what, P);
  std::vector<int64_t> ends(static_cast<size_t>(P));
  int64_t at = base;
  for (int64_t j = 0; j < P; ++j) {
    detail::require(starts[j] == at && sizes[j] >= 0, what, "segments that tile [base, base + nx) in order");
    at = ends[j] = starts[j] + sizes[j];
  }
  detail::require(at == base + nx, what, "segments that tile [base, base + nx) in order");
  return ends;
}

// worker_compress_cpu of a source's values of flat [s.base, s.base + nx) (Src: MomentumSegments,
// LocalSegments; its P segments tile that range). fused(s, j, ...) computes a block's values in
// registers as it compresses them (null: no fused form); the other blocks (all of them without
// it, the one holding the input's tail with it) get their values into a tile first:
// tile(q, u, f0, f1) writes segment q's values of flat [f0, f1) to u[f0..f1), and the compression
// reads them from there. The same floats either way, never written to the source's buffer.
template <class Src, class Tile>
float source_compress_cpu(const Src& s, int64_t P, int64_t nx,
                          double (*fused)(const Src&, int64_t, const float*, float*, const uint8_t*, bool, float,
                                          int64_t, int64_t, uint8_t*),
                          Tile tile, const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W,
                          int64_t row_stride, const uint8_t* prev_bits, float prev_scale, bool pending,
                          float* scale_out, int nthreads) {
  const auto compress = impl().compress;
  const float sp = pending ? prev_scale : 0.0f;
  const int64_t whole = nx - nx % 8;  // blocks below this hold only whole groups of 8 input values
  const int64_t base = s.base, *starts = s.starts, *ends = s.ends;
  const auto block = [&](int64_t lo, int64_t hi, const uint8_t* prev, uint8_t* out) -> double {
    // the segment holding flat index base + lo (the first that ends after it)
    const int64_t j = std::upper_bound(ends, ends + P, base + lo) - ends;
    if (fused && hi <= whole) return fused(s, j, e, e_out, prev, pending, sp, lo, hi, out);
    alignas(32) float buf[kBlock];
    float* u = buf - (base + lo);  // u[f]: flat index f; buf[i - lo]: value i
    const int64_t end = base + std::min(hi, nx);
    for (int64_t q = j; q < P && starts[q] < end; ++q) {
      const int64_t f0 = std::max(base + lo, starts[q]), f1 = std::min(end, ends[q]);
      if (f0 < f1) tile(q, u, f0, f1);
    }
    return compress(buf - lo, nx, e, e_out, prev, pending, sp, lo, hi, out);
  };
  return compress_blocks(block, n, bits, W, row_stride, prev_bits, pending, scale_out, nthreads);
}

// worker_update_error_cpu of a source's values, block by block as source_compress_cpu compresses
// them (fused blocks where it fused them, elsewhere a tile of values filled by `tile`); returns
// the scale of the values it read, computed as source_compress_cpu computes it: the compression's
// scale, bit for bit, when the source's inputs did not change in between.
template <class Src, class Tile>
float source_update_error_cpu(const Src& s, int64_t P, int64_t nx,
                              double (*fused)(const Src&, int64_t, const float*, float*, int64_t, int64_t, float),
                              Tile tile, const float* e, float* e_out, int64_t n, int64_t W, float scale,
                              int nthreads) {
  const auto compress = impl().compress;
  const auto update = impl().update;
  const int64_t whole = nx - nx % 8;
  const int64_t base = s.base, *starts = s.starts, *ends = s.ends;
  const auto block = [&](int64_t lo, int64_t hi, int64_t) -> double {
    const int64_t j = std::upper_bound(ends, ends + P, base + lo) - ends;
    if (fused && hi <= whole) return fused(s, j, e, e_out, lo, hi, scale);
    alignas(32) float buf[kBlock];
    alignas(32) uint8_t signs[kBlock / 8];
    float* u = buf - (base + lo);  // u[f]: flat index f; buf[i - lo]: value i
    const int64_t end = base + std::min(hi, nx);
    for (int64_t q = j; q < P && starts[q] < end; ++q) {
      const int64_t f0 = std::max(base + lo, starts[q]), f1 = std::min(end, ends[q]);
      if (f0 < f1) tile(q, u, f0, f1);
    }
    // the compression's sum (it reads e before e_out is written), then the update
    const double sum = compress(buf - lo, nx, e, nullptr, nullptr, false, 0.0f, lo, hi, signs);
    update(buf - lo, nx, e, e_out, lo, hi, scale);
    return sum;
  };
  return row_blocks(block, n, W, 0, nthreads);  // the compression's blocks and order
}

// f(segments, tile) on momentum_source's segments of [base, base + nx) (checked to tile it, what:
// the caller) and the tile that fills values where no fused form applies.
template <class F>
auto with_momentum_source(const char* what, const float* m, const float* const* g, const float* v, const float* eps,
                          const float* dscale, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b,
                          const float* a, int64_t base, int64_t nx, F f) {
  const auto ends = tiling_ends(what, P, starts, sizes, base, nx);
  const MomentumSegments segs{m, g, v, eps, dscale, starts, ends.data(), b, a, base};
  const auto source_tile = impl().source_tile;
  const auto tile = [&](int64_t q, float* u, int64_t f0, int64_t f1) {
    source_tile(m, rebased(g, starts, q), denom_of(v, eps, dscale, q), u, f0, f1, b[q], a[q]);
  };
  return f(segs, tile);
}

// with_momentum_source's for local_source's segments.
template <class F>
auto with_local_source(const char* what, const float* m, const float* const* g, const float* v, const float* eps,
                       const float* dscale, const float* const* p, const float* acc, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b,
                       const float* a, const float* nw, const float* nlr, bool precond, int64_t base, int64_t nx,
                       F f) {
  const auto ends = tiling_ends(what, P, starts, sizes, base, nx);
  std::vector<LocalSourceCoef> coef(static_cast<size_t>(P));
  for (int64_t j = 0; j < P; ++j) coef[j] = {b[j], a[j], nw[j], nlr[j]};
  const LocalSegments segs{m, g, v, eps, dscale, p, acc, starts, ends.data(), coef.data(), precond, base};
  const auto source_tile = impl().local_source_tile;
  const auto tile = [&](int64_t q, float* u, int64_t f0, int64_t f1) {
    source_tile(m, rebased(g, starts, q), denom_of(v, eps, dscale, q), rebased(p, starts, q), acc, u, f0, f1, coef[q],
                precond);
  };
  return f(segs, tile);
}

}  // namespace

bool cpu_has_simd() { return impl().compress != compress_block_scalar; }

float worker_compress_cpu(const float* x, int64_t nx, const float* e, float* e_out, int64_t n, uint8_t* bits,
                          int64_t W, int64_t row_stride, const uint8_t* prev_bits, float prev_scale, bool pending,
                          float* scale_out, int nthreads) {
  detail::check_compress("worker_compress_cpu", nx, n, W);
  const auto compress = impl().compress;
  const float sp = pending ? prev_scale : 0.0f;
  const auto block = [&](int64_t lo, int64_t hi, const uint8_t* prev, uint8_t* out) {
    return compress(x, nx, e, e_out, prev, pending, sp, lo, hi, out);
  };
  return compress_blocks(block, n, bits, W, row_stride, prev_bits, pending, scale_out, nthreads);
}

float momentum_compress_cpu(const float* m, const float* const* g, const float* v, const float* eps,
                            const float* dscale, int64_t P, const int64_t* starts,
                            const int64_t* sizes, const float* b, const float* a, int64_t base, int64_t nx,
                            const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride,
                            const uint8_t* prev_bits, float prev_scale, bool pending, float* scale_out,
                            int nthreads) {
  detail::check_compress("momentum_compress_cpu", nx, n, W);
  return with_momentum_source("momentum_compress_cpu", m, g, v, eps, dscale, P, starts, sizes, b, a, base, nx,
                              [&](const MomentumSegments& segs, const auto& tile) {
                                return source_compress_cpu(segs, P, nx, impl().momentum_compress, tile, e, e_out,
                                                           n, bits, W, row_stride, prev_bits, prev_scale, pending,
                                                           scale_out, nthreads);
                              });
}

float local_compress_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale,
                         const float* const* p, const float* acc,
                         int64_t P, const int64_t* starts, const int64_t* sizes, const float* b, const float* a,
                         const float* nw, const float* nlr, bool precond, int64_t base, int64_t nx, const float* e,
                         float* e_out, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride,
                         const uint8_t* prev_bits, float prev_scale, bool pending, float* scale_out, int nthreads) {
  detail::check_compress("local_compress_cpu", nx, n, W);
  return with_local_source("local_compress_cpu", m, g, v, eps, dscale, p, acc, P, starts, sizes, b, a, nw, nlr, precond, base, nx,
                           [&](const LocalSegments& segs, const auto& tile) {
                             return source_compress_cpu(segs, P, nx, impl().local_compress, tile, e, e_out, n, bits,
                                                        W, row_stride, prev_bits, prev_scale, pending, scale_out,
                                                        nthreads);
                           });
}

float momentum_update_error_cpu(const float* m, const float* const* g, const float* v, const float* eps,
                                const float* dscale, int64_t P,
                                const int64_t* starts, const int64_t* sizes, const float* b, const float* a,
                                int64_t base, int64_t nx, const float* e, float* e_out, int64_t n, int64_t W,
                                float scale, int nthreads) {
  detail::check_compress("momentum_update_error_cpu", nx, n, W);
  return with_momentum_source("momentum_update_error_cpu", m, g, v, eps, dscale, P, starts, sizes, b, a, base, nx,
                              [&](const MomentumSegments& segs, const auto& tile) {
                                return source_update_error_cpu(segs, P, nx, impl().momentum_update, tile, e, e_out,
                                                               n, W, scale, nthreads);
                              });
}

float local_update_error_cpu(const float* m, const float* const* g, const float* v, const float* eps,
                             const float* dscale, const float* const* p,
                             const float* acc, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b,
                             const float* a, const float* nw, const float* nlr, bool precond, int64_t base,
                             int64_t nx, const float* e, float* e_out, int64_t n, int64_t W, float scale,
                             int nthreads) {
  detail::check_compress("local_update_error_cpu", nx, n, W);
  return with_local_source("local_update_error_cpu", m, g, v, eps, dscale, p, acc, P, starts, sizes, b, a, nw, nlr, precond, base,
                           nx, [&](const LocalSegments& segs, const auto& tile) {
                             return source_update_error_cpu(segs, P, nx, impl().local_update, tile, e, e_out, n, W,
                                                            scale, nthreads);
                           });
}

void worker_update_error_cpu(const float* x, int64_t nx, const float* e, float* e_out, int64_t n, float scale,
                             int nthreads) {
  detail::check_update("worker_update_error_cpu", nx, n);
  const auto update = impl().update;
  const int64_t nblk = (n + kBlock - 1) / kBlock;
  const int nt = threads_for(n, nthreads);
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t blk = 0; blk < nblk; ++blk) update(x, nx, e, e_out, blk * kBlock, std::min(n, (blk + 1) * kBlock), scale);
}

float server_reduce_cpu(const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales,
                        int64_t scale_stride, const float* e, float* e_out, int64_t m, const uint8_t* prev_bits,
                        float prev_scale, uint8_t* out_bits, float* scale_out, bool pending, int nthreads) {
  detail::check_reduce("server_reduce_cpu", W, m);
  // Decode table: 8 KiB per row, built once per call (W * 2048 floats), shared by all threads.
  std::vector<float> lut(static_cast<size_t>(W) * 256 * 8);
  for (int64_t r = 0; r < W; ++r) {
    const float w = scales[r * scale_stride] / static_cast<float>(W);
    for (int b = 0; b < 256; ++b)
      for (int t = 0; t < 8; ++t) lut[(r * 256 + b) * 8 + t] = ((b >> t) & 1) ? w : -w;
  }
  const float sp = pending ? prev_scale : 0.0f;
  const int64_t nblk = (m + kBlock - 1) / kBlock;
  std::vector<double> partial(static_cast<size_t>(nblk));
  const int nt = threads_for(m, nthreads);
  const auto reduce = impl().reduce;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t blk = 0; blk < nblk; ++blk)
    partial[blk] = reduce(bits, W, row_stride, lut.data(), e, e_out, blk * kBlock, std::min(m, (blk + 1) * kBlock),
                          prev_bits, out_bits, pending, sp);
  // No second pass: the error update e <- c - s * sign(c) is left pending (one sweep over e
  // instead of two; the next call applies it, or kernels.finish_pending for checkpoints).
  const float s = finish_scale(partial, m);
  *scale_out = s;
  return s;
}

void decompress_cpu(const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales, int64_t scale_stride,
                    int64_t m, float* out, int64_t nout, int nthreads) {
  detail::check_decompress("decompress_cpu", W, m, nout);
  const int64_t nb = (m + kBlock - 1) / kBlock;
  const int64_t total = nb * W;
  const int nt = threads_for(nout, nthreads);
  const auto decode = impl().decode;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t blk = 0; blk < total; ++blk) {
    const int64_t j = blk / nb, lo = j * m + (blk % nb) * kBlock;
    const int64_t hi = std::min(std::min(lo + kBlock, (j + 1) * m), nout);
    if (lo < hi) decode(bits + j * row_stride + (lo - j * m) / 8, scales[j * scale_stride], out, lo, hi);
  }
}

void lamb_frozen_update_cpu(const float* x, float* m, const float* v, const float* dscale, float* vf,
                            const float* const* p, float* u, int64_t L, const int64_t* offsets, const float* scaling,
                            const float* beta1, const float* ob1, const float* beta2, const float* ob2,
                            const float* eps, const float* wd, bool precond,
                            double* stats, int nthreads, const SignRuns* xs) {
  detail::check_lamb("lamb_frozen_update_cpu", L);
  const int64_t all = L ? offsets[L] - offsets[0] : 0;
  check_runs_cover("lamb_frozen_update_cpu", xs, L ? 1 : 0, offsets, &all);
  // Blocks never straddle layers; partials are folded per layer in block order (thread-count independent).
  std::vector<int64_t> first(static_cast<size_t>(L) + 1, 0), lows;
  for (int64_t k = 0; k < L; ++k) {
    first[k] = static_cast<int64_t>(lows.size());
    for (int64_t lo = offsets[k]; lo < offsets[k + 1]; lo += kBlock) lows.push_back(lo);
  }
  first[L] = static_cast<int64_t>(lows.size());
  std::vector<int64_t> layer(lows.size());
  for (int64_t k = 0; k < L; ++k)
    for (int64_t b = first[k]; b < first[k + 1]; ++b) layer[b] = k;
  const int64_t nblk = static_cast<int64_t>(lows.size());
  std::vector<double> part(static_cast<size_t>(3 * nblk));
  const int nt = threads_for(offsets[L] - offsets[0], nthreads);
  const auto lamb = impl().lamb;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t k = layer[b], lo = lows[b], hi = std::min(lo + kBlock, offsets[k + 1]);
    const LambCoef c{scaling[k], beta1[k], ob1[k], beta2[k], ob2[k], eps[k], wd[k], precond};
    const float* pk = rebased(p, offsets, k);  // pk[i]: the layer's parameter at flat index i
    const Denom d = denom_of(v, eps, dscale, k);
    if (xs) {  // the same addresses but x's, indexed from lo: the block's floats do not change
      alignas(32) float buf[kBlock];
      fill_from_runs(*xs, lo, hi, buf);
      lamb(buf, m + lo, d.from(lo), vf + lo, pk ? pk + lo : nullptr, u + lo, 0, hi - lo, c, &part[3 * b]);
    } else {
      lamb(x, m, d, vf, pk, u, lo, hi, c, &part[3 * b]);
    }
  }
  for (int64_t k = 0; k < L; ++k) {
    double* s = stats + 3 * k;
    s[0] = first[k] == first[k + 1] ? 1.0 : 0.0;
    s[1] = s[2] = 0.0;
    for (int64_t b = first[k]; b < first[k + 1]; ++b) {
      s[0] = std::max(s[0], part[3 * b]);
      s[1] += part[3 * b + 1];
      s[2] += part[3 * b + 2];
    }
  }
}

void adam_update_cpu(const float* const* g, float* m, float* v, float* const* params, int64_t P, const int64_t* starts,
                     const int64_t* sizes, const float* lr, const float* beta1, const float* ob1, const float* beta2,
                     const float* ob2, const float* eps, const float* wd, bool update_v, int nthreads) {
  detail::check_adam("adam_update_cpu", P);
  // Blocks never straddle parameters; each value is written by one block (no reductions).
  std::vector<int64_t> owner, lows;
  int64_t n = 0;
  for (int64_t j = 0; j < P; ++j) {
    for (int64_t lo = starts[j]; lo < starts[j] + sizes[j]; lo += kBlock) owner.push_back(j), lows.push_back(lo);
    n += sizes[j];
  }
  const int64_t nblk = static_cast<int64_t>(lows.size());
  const int nt = threads_for(n, nthreads);
  const auto adam = impl().adam;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t j = owner[b], lo = lows[b], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    adam(rebased(g, starts, j), m, v, params[j] + (lo - starts[j]), lo, hi,
         AdamCoef{lr[j], beta1[j], ob1[j], beta2[j], ob2[j], eps[j], wd[j]}, update_v);
  }
}

void momentum_source_cpu(const float* m, const float* const* g, const float* v, const float* eps,
                         const float* dscale, float* u, int64_t P,
                         const int64_t* starts, const int64_t* sizes, const float* b, const float* a, int nthreads) {
  detail::check_segments("momentum_source_cpu", P);
  std::vector<int64_t> owner, lows;
  const int64_t n = segment_blocks(P, starts, sizes, owner, lows);
  const int64_t nblk = static_cast<int64_t>(lows.size());
  const int nt = threads_for(n, nthreads);
  const auto source = impl().source;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t k = 0; k < nblk; ++k) {
    const int64_t j = owner[k], lo = lows[k], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    source(m, rebased(g, starts, j), denom_of(v, eps, dscale, j), u, lo, hi, b[j], a[j]);
  }
}

void frozen_adam_update_cpu(const float* x, float* m, const float* v, const float* eps, const float* dscale,
                            float* const* params, int64_t P,
                            const int64_t* starts, const int64_t* sizes, const float* nlr, const float* nlw,
                            bool precond, int nthreads, const SignRuns* xs) {
  detail::check_segments("frozen_adam_update_cpu", P);
  std::vector<int64_t> owner, lows;
  const int64_t n = segment_blocks(P, starts, sizes, owner, lows);
  check_runs_cover("frozen_adam_update_cpu", xs, P, starts, sizes);
  const int64_t nblk = static_cast<int64_t>(lows.size());
  const int nt = threads_for(n, nthreads);
  const auto frozen = impl().frozen;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t k = 0; k < nblk; ++k) {
    const int64_t j = owner[k], lo = lows[k], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    float* pj = params[j] + (lo - starts[j]);
    const Denom d = denom_of(v, eps, dscale, j);
    if (xs) {  // as in lamb_frozen_update_cpu
      alignas(32) float buf[kBlock];
      fill_from_runs(*xs, lo, hi, buf);
      frozen(buf, m + lo, d.from(lo), pj, 0, hi - lo, nlr[j], nlw[j], precond);
    } else {
      frozen(x, m, d, pj, lo, hi, nlr[j], nlw[j], precond);
    }
  }
}

void local_source_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale,
                      const float* const* p, const float* acc, float* u,
                      int64_t P, const int64_t* starts, const int64_t* sizes, const float* b, const float* a,
                      const float* nw, const float* nlr, bool precond, int nthreads) {
  detail::check_segments("local_source_cpu", P);
  std::vector<int64_t> owner, lows;
  const int64_t n = segment_blocks(P, starts, sizes, owner, lows);
  const int64_t nblk = static_cast<int64_t>(lows.size());
  const int nt = threads_for(n, nthreads);
  const auto source = impl().local_source;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t k = 0; k < nblk; ++k) {
    const int64_t j = owner[k], lo = lows[k], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    source(m, rebased(g, starts, j), denom_of(v, eps, dscale, j), rebased(p, starts, j), acc, u, lo, hi,
           LocalSourceCoef{b[j], a[j], nw[j], nlr[j]}, precond);
  }
}

void sync_update_cpu(const float* x, const float* v, const float* eps, const float* dscale, const uint8_t* floored,
                     float* m, float* synced,
                     float* const* params, float* acc, int64_t P, const int64_t* starts, const int64_t* sizes,
                     const float* nl, bool precond, int nthreads, const SignRuns* xs) {
  detail::check_segments("sync_update_cpu", P);
  std::vector<int64_t> owner, lows;
  const int64_t n = segment_blocks(P, starts, sizes, owner, lows);
  check_runs_cover("sync_update_cpu", xs, P, starts, sizes);
  const int64_t nblk = static_cast<int64_t>(lows.size());
  const int nt = threads_for(n, nthreads);
  const auto sync = impl().sync;

#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t k = 0; k < nblk; ++k) {
    const int64_t j = owner[k], lo = lows[k], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    float* p = params ? params[j] + (lo - starts[j]) : nullptr;
    const Denom d = denom_of(v, eps, dscale, j);
    if (xs) {  // as in lamb_frozen_update_cpu
      alignas(32) float buf[kBlock];
      fill_from_runs(*xs, lo, hi, buf);
      sync(buf, d.from(lo), floored ? floored + lo : nullptr, m + lo, synced + lo, p, acc ? acc + lo : nullptr, 0,
           hi - lo, nl[j], precond);
    } else {
      sync(x, d, floored, m, synced, p, acc, lo, hi, nl[j], precond);
    }
  }
}

bool local_step_cpu(const float* const* g, float* m, const float* v, const float* eps, const float* dscale,
                    float* acc, float* const* params, int64_t P,
                    const int64_t* starts, const int64_t* sizes, const float* b, const float* a, const float* w,
                    const float* nlr, int nthreads) {
  detail::check_segments("local_step_cpu", P);
  std::vector<int64_t> owner, lows;
  const int64_t n = segment_blocks(P, starts, sizes, owner, lows);
  const int64_t nblk = static_cast<int64_t>(lows.size());
  const int nt = threads_for(n, nthreads);
  const Impl& k = impl();
  // g[j], params[j] - starts[j]: indexed by flat index (their own storage, from 0 at starts[j])
  const auto grad = [&](int64_t j) { return rebased(g, starts, j); };
  std::vector<uint8_t> finite(static_cast<size_t>(nblk));
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t q = 0; q < nblk; ++q) {
    const int64_t j = owner[q], lo = lows[q], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    finite[q] = k.finite(grad(j), lo, hi);
  }
  // a rank with a non-finite gradient sits the step out: nothing is written
  if (std::find(finite.begin(), finite.end(), 0) != finite.end()) return false;
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t q = 0; q < nblk; ++q) {
    const int64_t j = owner[q], lo = lows[q], hi = std::min(lo + kBlock, starts[j] + sizes[j]);
    k.local_step(grad(j), m, denom_of(v, eps, dscale, j), acc, params[j] - starts[j], lo, hi,
                 LocalStepCoef{b[j], a[j], w[j], nlr[j]});
  }
  return true;
}

}  // namespace onebit
