// Standalone checks of the CPU kernels, meant to run under AddressSanitizer/UBSan or valgrind
// (scripts/sanitize.sh; tests/test_sanitizers.py runs it). Every buffer is a separate heap
// allocation of exactly the size the kernel may touch, so any out-of-bounds read or write is
// reported. The numerical checks are self-contained (no torch): decode(encode(y)) + e == y.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "onebit.h"
#include "onebit_tiling.h"

namespace {

int failures = 0;

void check(bool ok, const char* what, int64_t a, int64_t b) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL %s (%lld, %lld)\n", what, static_cast<long long>(a), static_cast<long long>(b));
  }
}

template <class T>
std::unique_ptr<T[]> buf(int64_t n) { return std::unique_ptr<T[]>(new T[static_cast<size_t>(n > 0 ? n : 1)]); }

// The variance whose denominator the kernels compute as d (eps 0, no scale): v = d * d, whose
// correctly rounded square root is d itself (d > 0, no overflow or underflow).
std::unique_ptr<float[]> squares(const float* d, int64_t n) {
  auto v = buf<float>(n);
  for (int64_t i = 0; i < n; ++i) v[i] = d[i] * d[i];
  return v;
}

// The deferred form of the worker compression against the two-call form, bit for bit, over two
// calls: call 1 writes y (e_out) where the two-call form wrote the error e1 = y - s * sign(y);
// call 2 applies that update as it reads (pending, in place: e_out = e and prev_bits = bits).
// e0: the error before call 1; e1, bits1, s1: the two-call form's results of call 1 on x.
void check_deferred(std::mt19937& rng, const float* x, int64_t nx, const float* e0, const float* e1,
                    const uint8_t* bits1, float s1, int64_t W, int64_t m, int64_t stride, int nthreads) {
  const int64_t n = W * m, nbytes = (W - 1) * stride + m / 8;
  std::normal_distribution<float> normal;
  auto d = buf<float>(n);
  auto dbits = buf<uint8_t>(nbytes);
  for (int64_t i = 0; i < nbytes; ++i) dbits[i] = 0xA5;
  float ds = -1.0f;
  const float a = onebit::worker_compress_cpu(x, nx, e0, d.get(), n, dbits.get(), W, stride, nullptr, 0.0f, false,
                                              &ds, nthreads);
  check(a == s1 && ds == s1, "deferred: scale", W, m);
  check(std::memcmp(dbits.get(), bits1, nbytes) == 0, "deferred: bits (and padding) as the two-call form", W, m);
  for (int64_t i = 0; i < n; ++i) check(d[i] == (i < nx ? x[i] : 0.0f) + e0[i], "deferred: e_out = y", W, i);
  // call 2 on a fresh x2: the two-call form from e1, the deferred one from d in place
  auto x2 = buf<float>(nx);
  auto e2 = buf<float>(n);
  auto bits2 = buf<uint8_t>(nbytes);
  for (int64_t i = 0; i < nx; ++i) x2[i] = normal(rng);
  std::memcpy(e2.get(), e1, sizeof(float) * n);
  std::memcpy(bits2.get(), bits1, nbytes);
  float s2 = 0.0f;
  onebit::worker_compress_cpu(x2.get(), nx, e2.get(), nullptr, n, bits2.get(), W, stride, nullptr, 0.0f, false, &s2,
                              nthreads);
  onebit::worker_update_error_cpu(x2.get(), nx, e2.get(), e2.get(), n, s2, nthreads);
  const float b = onebit::worker_compress_cpu(x2.get(), nx, d.get(), d.get(), n, dbits.get(), W, stride,
                                              dbits.get(), ds, true, &ds, nthreads);
  check(b == s2 && ds == s2, "pending: scale", W, m);
  check(std::memcmp(dbits.get(), bits2.get(), nbytes) == 0, "pending: bits", W, m);
  for (int64_t j = 0; j < W; ++j) {
    for (int64_t k = 0; k < m; ++k) {
      const int64_t i = j * m + k;
      const bool bit = (dbits[j * stride + k / 8] >> (k % 8)) & 1;
      check((bit ? d[i] - s2 : d[i] + s2) == e2[i], "pending: the true error as the two-call form's", j, k);
    }
  }
}

void run_case(std::mt19937& rng, int64_t W, int64_t m, int64_t nx, int64_t pad, int nthreads) {
  const int64_t n = W * m, row = m / 8, stride = row + pad;
  std::normal_distribution<float> normal;
  auto x = buf<float>(nx);
  auto e = buf<float>(n);
  auto y = buf<float>(n);
  for (int64_t i = 0; i < nx; ++i) x[i] = (i % 13 == 0) ? (i % 2 ? -0.0f : 0.0f) : normal(rng);
  for (int64_t i = 0; i < n; ++i) e[i] = 0.1f * normal(rng);
  for (int64_t i = 0; i < n; ++i) y[i] = (i < nx ? x[i] : 0.0f) + e[i];
  auto e0 = buf<float>(n);  // the error before the call, for the deferred form below
  std::memcpy(e0.get(), e.get(), sizeof(float) * n);
  // rows of `row` bytes, `pad` bytes apart: the bytes in between must stay untouched
  auto bits = buf<uint8_t>((W - 1) * stride + row);
  for (int64_t i = 0; i < (W - 1) * stride + row; ++i) bits[i] = 0xA5;
  float scale = -1.0f;
  const float s = onebit::worker_compress_cpu(x.get(), nx, e.get(), nullptr, n, bits.get(), W, stride, nullptr, 0.0f,
                                              false, &scale, nthreads);
  check(s == scale && s >= 0.0f, "scale written", W, m);
  for (int64_t i = 0; i < n; ++i) check(e[i] + (i < nx ? x[i] : 0.0f) == y[i], "compress leaves e alone", W, i);
  onebit::worker_update_error_cpu(x.get(), nx, e.get(), e.get(), n, s, nthreads);
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(y[i]) * y[i];
  check(std::fabs(s - std::sqrt(ss / double(n))) <= 1e-6 * s + 1e-30, "scale value", W, m);
  for (int64_t j = 0; j < W; ++j) {
    for (int64_t p = row; p < stride && j < W - 1; ++p) check(bits[j * stride + p] == 0xA5, "padding untouched", j, p);
    for (int64_t k = 0; k < m; ++k) {
      const bool bit = (bits[j * stride + k / 8] >> (k % 8)) & 1;
      check(bit == (y[j * m + k] >= 0.0f), "sign bit", j, k);
      const float back = e[j * m + k] + (bit ? s : -s);
      check(std::fabs(back - y[j * m + k]) <= 1e-6f * (std::fabs(y[j * m + k]) + s), "error feedback", j, k);
    }
  }
  check_deferred(rng, x.get(), nx, e0.get(), e.get(), bits.get(), s, W, m, stride, nthreads);
  // decompress into an output shorter than W*m (the padding is dropped): exact size allocation
  const int64_t nout = n - (n > 3 ? 3 : 0);
  auto out = buf<float>(nout);
  auto scales = buf<float>(2 * W);  // strided scales
  for (int64_t j = 0; j < W; ++j) scales[2 * j] = 0.5f + j;
  onebit::decompress_cpu(bits.get(), W, stride, scales.get(), 2, m, out.get(), nout, nthreads);
  for (int64_t i = 0; i < nout; ++i) {
    const int64_t j = i / m, k = i % m;
    const bool bit = (bits[j * stride + k / 8] >> (k % 8)) & 1;
    check(out[i] == (bit ? scales[2 * j] : -scales[2 * j]), "decompress", j, k);
  }
  // server reduce twice (the second call applies the first one's deferred error update)
  auto se = buf<float>(m);
  auto ob = buf<uint8_t>(row);
  std::vector<double> eager(static_cast<size_t>(m));
  for (int64_t k = 0; k < m; ++k) eager[k] = se[k] = 0.05f * normal(rng);
  float sscale = 0.0f;
  for (int call = 0; call < 2; ++call) {
    const float s2 = onebit::server_reduce_cpu(bits.get(), W, stride, scales.get(), 2, se.get(), se.get(), m,
                                               ob.get(), sscale, ob.get(), &sscale, call > 0, nthreads);
    double norm = 0;
    std::vector<double> c(static_cast<size_t>(m));
    for (int64_t k = 0; k < m; ++k) {
      double v = 0;
      for (int64_t r = 0; r < W; ++r) v += ((bits[r * stride + k / 8] >> (k % 8)) & 1 ? 1.0 : -1.0) * scales[2 * r] / W;
      c[k] = v + eager[k];
      norm += c[k] * c[k];
    }
    check(std::fabs(s2 - std::sqrt(norm / double(m))) <= 1e-5 * s2, "server scale", W, call);
    for (int64_t k = 0; k < m; ++k) {
      const bool bit = (ob[k / 8] >> (k % 8)) & 1;
      check(bit == (c[k] >= 0) || std::fabs(c[k]) < 1e-6, "server bit", call, k);
      check(std::fabs(se[k] - c[k]) <= 1e-5 * (std::fabs(c[k]) + s2), "server accumulator", call, k);
      eager[k] = c[k] - (bit ? s2 : -s2);
    }
  }
}

// Segment k of `flat` ([starts[k], starts[k] + sizes[k])) copied into an exact-size buffer of its own
// (kept in `own`), one pointer per segment; every `none`-th one (k % none == none - 1) null.
std::vector<const float*> own_copies(const float* flat, const std::vector<int64_t>& starts,
                                     const std::vector<int64_t>& sizes, std::vector<std::unique_ptr<float[]>>& own,
                                     size_t none) {
  std::vector<const float*> ptrs;
  for (size_t k = 0; k < sizes.size(); ++k) {
    own.push_back(buf<float>(sizes[k]));
    std::memcpy(own.back().get(), flat + starts[k], 4 * sizes[k]);
    ptrs.push_back(k % none == none - 1 ? nullptr : own.back().get());
  }
  return ptrs;
}

// 1-bit LAMB update on exact-size buffers (each layer's parameter its own; with decay, every third
// layer's missing: no decay term there): values against a double evaluation, and stats (precond:
// x scaled back by d first, the product rounded to float).
void run_lamb_case(std::mt19937& rng, const std::vector<int64_t>& sizes, bool decay, bool precond, int nthreads) {
  const int64_t L = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> off(1, 0);
  for (int64_t s : sizes) off.push_back(off.back() + s);
  const int64_t n = off.back();
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  auto x = buf<float>(n), m = buf<float>(n), d = buf<float>(n), vf = buf<float>(n), p = buf<float>(n),
       u = buf<float>(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = normal(rng), m[i] = normal(rng), d[i] = uni(rng), vf[i] = uni(rng), p[i] = normal(rng);
  }
  std::vector<float> x0(x.get(), x.get() + n), m0(m.get(), m.get() + n), vf0(vf.get(), vf.get() + n);
  std::vector<float> sc(L), b1(L), ob1(L), b2(L), ob2(L), eps(L), wd(L);
  for (int64_t k = 0; k < L; ++k) sc[k] = 2 * uni(rng), b1[k] = 0.9f, b2[k] = 0.999f, eps[k] = 1e-6f,
                                  wd[k] = decay ? 0.01f * k : 0.0f, ob1[k] = float(1.0 - 0.9), ob2[k] = float(1.0 - 0.999);
  auto stats = buf<double>(3 * L);
  std::vector<std::unique_ptr<float[]>> own;
  const std::vector<const float*> ps = own_copies(p.get(), off, sizes, own, 3);
  const auto dv = squares(d.get(), n);
  onebit::lamb_frozen_update_cpu(x.get(), m.get(), dv.get(), nullptr, vf.get(), decay ? ps.data() : nullptr, u.get(),
                                 L, off.data(), sc.data(), b1.data(), ob1.data(), b2.data(), ob2.data(), eps.data(),
                                 wd.data(), precond, stats.get(), nthreads);
  for (int64_t k = 0; k < L; ++k)  // the kernel's denominator: sqrt(d * d) + eps
    for (int64_t i = off[k]; i < off[k + 1]; ++i) d[i] = d[i] + eps[k];
  for (int64_t k = 0; k < L; ++k) {
    double rmax = off[k] == off[k + 1] ? 1.0 : 0.0, up2 = 0, u2 = 0;
    for (int64_t i = off[k]; i < off[k + 1]; ++i) {
      const float xs = precond ? x0[i] * d[i] : x0[i];
      const double mn = double(xs) / sc[k], g = (mn - double(b1[k]) * m0[i]) / (1.0 - 0.9);
      const double v = double(b2[k]) * vf0[i] + (1.0 - 0.999) * g * g;
      const double up = mn / d[i], uu = up + (decay && ps[k] ? double(wd[k]) * p[i] : 0.0);
      rmax = std::fmax(rmax, d[i] / (std::sqrt(v) + eps[k]));
      up2 += up * up, u2 += uu * uu;
      check(std::fabs(m[i] - mn) <= 1e-6 * std::fabs(mn) + 1e-30, "lamb m", k, i);
      check(std::fabs(vf[i] - v) <= 1e-5 * v, "lamb v_fresh", k, i);
      check(std::fabs(u[i] - uu) <= 1e-5 * (std::fabs(uu) + std::fabs(up)), "lamb u", k, i);
    }
    check(std::fabs(stats[3 * k] - rmax) <= 1e-5 * rmax, "lamb ratio max", k, 0);
    check(std::fabs(stats[3 * k + 1] - up2) <= 1e-5 * up2, "lamb ||u_prelim||^2", k, 0);
    check(std::fabs(stats[3 * k + 2] - u2) <= 1e-5 * u2, "lamb ||u||^2", k, 0);
  }
}

// 1-bit Adam's, LAMB's and 0/1 Adam's sync updates reading x from SignRuns (runs of random lengths, each run's bits
// a heap buffer of exactly ceil(len / 8) bytes) against the same calls on the decoded x, bit for bit.
void run_sign_runs_case(std::mt19937& rng, const std::vector<int64_t>& sizes, int nthreads) {
  const int64_t L = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> off(1, 0);
  for (int64_t s : sizes) off.push_back(off.back() + s);
  const int64_t n = off.back();
  std::vector<int64_t> lo, hi;
  std::vector<std::unique_ptr<uint8_t[]>> bytes;
  std::vector<const uint8_t*> bits;
  std::vector<float> scale;
  auto x = buf<float>(n);
  std::uniform_int_distribution<int64_t> len(1, 20000);
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  for (int64_t a = 0; a < n;) {
    const int64_t b = std::min(n, a + (len(rng) % 3 == 0 ? len(rng) % 9 + 1 : len(rng)));
    bytes.push_back(buf<uint8_t>((b - a + 7) / 8));
    for (int64_t q = 0; q < (b - a + 7) / 8; ++q) bytes.back()[q] = static_cast<uint8_t>(rng());
    lo.push_back(a), hi.push_back(b), bits.push_back(bytes.back().get()), scale.push_back(uni(rng));
    for (int64_t i = a; i < b; ++i) x[i] = ((bits.back()[(i - a) / 8] >> ((i - a) % 8)) & 1) ? scale.back() : -scale.back();
    a = b;
  }
  const onebit::SignRuns runs{static_cast<int64_t>(lo.size()), lo.data(), hi.data(), bits.data(), scale.data()};
  auto fill = [&](std::unique_ptr<float[]>& t, float lo_, float hi_) {
    std::uniform_real_distribution<float> r(lo_, hi_);
    for (int64_t i = 0; i < n; ++i) t[i] = r(rng);
  };
  auto m = buf<float>(n), d = buf<float>(n), vf = buf<float>(n), p = buf<float>(n);
  fill(m, -1.0f, 1.0f), fill(d, 0.1f, 1.0f), fill(vf, 0.1f, 1.0f), fill(p, -1.0f, 1.0f);
  std::vector<float> sc(L), b1(L, 0.9f), ob1(L, float(1.0 - 0.9)), b2(L, 0.999f), ob2(L, float(1.0 - 0.999));
  std::vector<float> eps(L, 1e-6f), wd(L), nlr(L), nlw(L);
  for (int64_t k = 0; k < L; ++k) sc[k] = 2 * uni(rng), wd[k] = 0.01f * k, nlr[k] = -1e-3f * uni(rng), nlw[k] = nlr[k] * wd[k];
  std::vector<std::unique_ptr<float[]>> own;
  const std::vector<const float*> ps = own_copies(p.get(), off, sizes, own, 4);
  for (bool precond : {false, true}) {
    std::vector<float> m1(m.get(), m.get() + n), m2 = m1, v1(vf.get(), vf.get() + n), v2 = v1, u1(n), u2(n);
    std::vector<double> s1(3 * L), s2(3 * L);
    onebit::lamb_frozen_update_cpu(x.get(), m1.data(), d.get(), nullptr, v1.data(), ps.data(), u1.data(), L, off.data(),
                                   sc.data(), b1.data(), ob1.data(), b2.data(), ob2.data(), eps.data(), wd.data(),
                                   precond, s1.data(), nthreads);
    onebit::lamb_frozen_update_cpu(nullptr, m2.data(), d.get(), nullptr, v2.data(), ps.data(), u2.data(), L, off.data(),
                                   sc.data(), b1.data(), ob1.data(), b2.data(), ob2.data(), eps.data(), wd.data(),
                                   precond, s2.data(), nthreads, &runs);
    for (int64_t i = 0; i < n; ++i) {
      check(std::memcmp(&m1[i], &m2[i], 4) == 0 && std::memcmp(&v1[i], &v2[i], 4) == 0 &&
                std::memcmp(&u1[i], &u2[i], 4) == 0, "lamb from runs", precond, i);
    }
    check(std::memcmp(s1.data(), s2.data(), 8 * 3 * L) == 0, "lamb stats from runs", precond, 0);
    // 1-bit Adam: the layers as parameters, each its own exact-size buffer
    std::vector<std::unique_ptr<float[]>> own1, own2;
    std::vector<float*> ptr1, ptr2;
    for (int64_t k = 0; k < L; ++k) {
      own1.push_back(buf<float>(sizes[k])), own2.push_back(buf<float>(sizes[k]));
      std::memcpy(own1.back().get(), p.get() + off[k], 4 * sizes[k]);
      std::memcpy(own2.back().get(), p.get() + off[k], 4 * sizes[k]);
      ptr1.push_back(own1.back().get()), ptr2.push_back(own2.back().get());
    }
    std::vector<float> a1(m.get(), m.get() + n), a2 = a1;
    onebit::frozen_adam_update_cpu(x.get(), a1.data(), d.get(), eps.data(), nullptr, ptr1.data(), L, off.data(), sizes.data(), nlr.data(),
                                   nlw.data(), precond, nthreads);
    onebit::frozen_adam_update_cpu(nullptr, a2.data(), d.get(), eps.data(), nullptr, ptr2.data(), L, off.data(), sizes.data(), nlr.data(),
                                   nlw.data(), precond, nthreads, &runs);
    check(std::memcmp(a1.data(), a2.data(), 4 * n) == 0, "frozen m from runs", precond, 0);
    for (int64_t k = 0; k < L; ++k)
      check(std::memcmp(ptr1[k], ptr2[k], 4 * sizes[k]) == 0, "frozen p from runs", precond, k);
    // 0/1 Adam's sync (the parameters' buffers again, from where 1-bit Adam left them)
    std::vector<uint8_t> floored(n);
    for (int64_t i = 0; i < n; ++i) floored[i] = rng() % 5 == 0;
    std::vector<float> y1(m.get(), m.get() + n), y2 = y1, z1(p.get(), p.get() + n), z2 = z1, c1(n, 1.0f), c2 = c1;
    onebit::sync_update_cpu(x.get(), d.get(), eps.data(), nullptr, floored.data(), y1.data(), z1.data(), ptr1.data(), c1.data(), L,
                            off.data(), sizes.data(), nlr.data(), precond, nthreads);
    onebit::sync_update_cpu(nullptr, d.get(), eps.data(), nullptr, floored.data(), y2.data(), z2.data(), ptr2.data(), c2.data(), L,
                            off.data(), sizes.data(), nlr.data(), precond, nthreads, &runs);
    check(y1 == y2 && z1 == z2 && c1 == c2, "sync from runs", precond, 0);
    for (int64_t k = 0; k < L; ++k)
      check(std::memcmp(ptr1[k], ptr2[k], 4 * sizes[k]) == 0, "sync p from runs", precond, k);
  }
}

// Segment starts for `sizes` laid out with a gap of 3 values before each; `n` receives the total.
std::vector<int64_t> gapped_starts(const std::vector<int64_t>& sizes, int64_t& n) {
  std::vector<int64_t> starts;
  n = 0;
  for (int64_t s : sizes) starts.push_back(n + 3), n += s + 3;
  return starts;
}

// Parameters as separate heap buffers with a gap between their flat ranges (untouched values).
// own_grads: each gradient in an exact-size buffer of its own, every third one missing (null:
// zeros); otherwise the gradients' table points into one flat buffer.
void run_adam_case(std::mt19937& rng, const std::vector<int64_t>& sizes, bool update_v, bool own_grads,
                   int nthreads) {
  const int64_t P = static_cast<int64_t>(sizes.size());
  int64_t n = 0;
  const std::vector<int64_t> starts = gapped_starts(sizes, n);
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  auto g = buf<float>(n), m = buf<float>(n), v = buf<float>(n);
  for (int64_t i = 0; i < n; ++i) g[i] = normal(rng), m[i] = 0.1f * normal(rng), v[i] = uni(rng);
  std::vector<float> m0(m.get(), m.get() + n), v0(v.get(), v.get() + n);
  std::vector<std::unique_ptr<float[]>> ps;
  std::vector<std::vector<float>> p0;
  std::vector<float*> ptrs;
  for (int64_t s : sizes) {
    ps.push_back(buf<float>(s));
    for (int64_t i = 0; i < s; ++i) ps.back()[i] = normal(rng);
    p0.emplace_back(ps.back().get(), ps.back().get() + s);
    ptrs.push_back(ps.back().get());
  }
  std::vector<float> lr(P), b1(P), ob1(P), b2(P), ob2(P), eps(P), wd(P);
  for (int64_t j = 0; j < P; ++j) lr[j] = 1e-3f * (j + 1), b1[j] = 0.9f, b2[j] = 0.99f, eps[j] = 1e-6f,
                                  wd[j] = 0.01f * (j % 2), ob1[j] = 1.0f - b1[j], ob2[j] = 1.0f - b2[j];
  std::vector<std::unique_ptr<float[]>> gs;
  std::vector<const float*> gptr;
  for (int64_t j = 0; j < P; ++j) {
    if (!own_grads) {
      gptr.push_back(g.get() + starts[j]);
    } else if (j % 3 == 2) {
      for (int64_t k = 0; k < sizes[j]; ++k) g[starts[j] + k] = 0.0f;  // what the reference reads
      gptr.push_back(nullptr);
    } else {
      gs.push_back(buf<float>(sizes[j]));
      std::copy(g.get() + starts[j], g.get() + starts[j] + sizes[j], gs.back().get());
      gptr.push_back(gs.back().get());
    }
  }
  onebit::adam_update_cpu(gptr.data(), m.get(), v.get(), ptrs.data(), P, starts.data(), sizes.data(), lr.data(),
                          b1.data(), ob1.data(), b2.data(), ob2.data(), eps.data(), wd.data(), update_v, nthreads);
  std::vector<bool> inside(static_cast<size_t>(n), false);
  for (int64_t j = 0; j < P; ++j) {
    for (int64_t k = 0; k < sizes[j]; ++k) {
      const int64_t i = starts[j] + k;
      inside[i] = true;
      const double mn = double(b1[j]) * m0[i] + double(ob1[j]) * g[i];
      const double vn = update_v ? double(b2[j]) * v0[i] + double(ob2[j]) * double(g[i]) * g[i] : v0[i];
      const double u = mn / (std::sqrt(vn) + eps[j]) + double(wd[j]) * p0[j][k];
      const double pn = p0[j][k] - double(lr[j]) * u;
      check(std::fabs(m[i] - mn) <= 1e-6 * (std::fabs(mn) + std::fabs(g[i])), "adam m", j, k);
      check(std::fabs(v[i] - vn) <= 1e-6 * vn, "adam v", j, k);
      check(std::fabs(ps[j][k] - pn) <= 1e-6 * (std::fabs(pn) + 1e-3), "adam p", j, k);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    if (!inside[i]) check(m[i] == m0[i] && v[i] == v0[i], "adam gap untouched", i, 0);
}

// One gradient per segment in an exact-size buffer of its own (kept in gs), every third one
// missing (null: zeros): the source kernels' pointer table.
std::vector<const float*> segment_grads(std::mt19937& rng, const std::vector<int64_t>& sizes,
                                        std::vector<std::unique_ptr<float[]>>& gs) {
  std::normal_distribution<float> normal;
  std::vector<const float*> ptrs;
  for (size_t j = 0; j < sizes.size(); ++j) {
    gs.push_back(buf<float>(sizes[j]));
    for (int64_t k = 0; k < sizes[j]; ++k) gs.back()[k] = 1e-3f * normal(rng);
    ptrs.push_back(j % 3 == 1 ? nullptr : gs.back().get());
  }
  return ptrs;
}

// momentum_source_cpu with each segment's gradient in an exact-size buffer of its own (every
// third one missing: zeros): u must be fma(g, a, m * b) [/ d] bit for bit (the AVX2 path rounds
// as the scalar one), +0.0 for a missing g included, and the gaps untouched.
void run_source_case(std::mt19937& rng, const std::vector<int64_t>& sizes, bool divide, int nthreads) {
  const int64_t P = static_cast<int64_t>(sizes.size());
  int64_t n = 0;
  const std::vector<int64_t> starts = gapped_starts(sizes, n);
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  auto m = buf<float>(n), d = buf<float>(n), u = buf<float>(n);
  for (int64_t i = 0; i < n; ++i) m[i] = i % 5 ? 0.1f * normal(rng) : (i % 2 ? -0.0f : 0.0f), d[i] = uni(rng);
  for (int64_t i = 0; i < n; ++i) u[i] = 12345.0f;
  std::vector<std::unique_ptr<float[]>> gs;
  const std::vector<const float*> ptrs = segment_grads(rng, sizes, gs);
  std::vector<float> b(P), a(P);
  for (int64_t j = 0; j < P; ++j) {
    b[j] = j % 4 == 2 ? -0.9f : 0.9f, a[j] = j % 4 == 3 ? -0.1f : 0.1f * (j + 1);
  }
  const auto dv = squares(d.get(), n);
  const std::vector<float> eps0(P, 0.0f);
  onebit::momentum_source_cpu(m.get(), ptrs.data(), divide ? dv.get() : nullptr, eps0.data(), nullptr, u.get(), P,
                              starts.data(), sizes.data(), b.data(), a.data(), nthreads);
  std::vector<bool> inside(static_cast<size_t>(n), false);
  for (int64_t j = 0; j < P; ++j) {
    for (int64_t k = 0; k < sizes[j]; ++k) {
      const int64_t i = starts[j] + k;
      inside[i] = true;
      float want = std::fma(ptrs[j] ? ptrs[j][k] : 0.0f, a[j], m[i] * b[j]);
      if (divide) want = want / d[i];
      check(std::memcmp(&u[i], &want, sizeof(float)) == 0, "source bits", j, k);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    if (!inside[i]) check(u[i] == 12345.0f, "source gap untouched", i, 0);
}

// momentum_compress_cpu against momentum_source_cpu into u, then worker_compress_cpu of u: the same
// bits (row padding untouched), scale and y, bit for bit. The segments tile [base, base + nx) (every
// third gradient missing), every buffer of exact size: m and d end at base + nx, u is not written.
void run_source_compress_case(std::mt19937& rng, const std::vector<int64_t>& sizes, int64_t W, bool divide,
                              bool pending, int nthreads) {
  const int64_t P = static_cast<int64_t>(sizes.size()), base = 3;
  std::vector<int64_t> starts(P);
  int64_t nx = 0;
  for (int64_t j = 0; j < P; ++j) starts[j] = base + nx, nx += sizes[j];
  const int64_t n = (nx + 8 * W - 1) / (8 * W) * 8 * W, m = n / W, stride = m / 8 + 2, nbytes = (W - 1) * stride + m / 8;
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  auto mm = buf<float>(base + nx), d = buf<float>(base + nx), u = buf<float>(base + nx);
  for (int64_t i = 0; i < base + nx; ++i) mm[i] = i % 5 ? 0.1f * normal(rng) : (i % 2 ? -0.0f : 0.0f), d[i] = uni(rng);
  std::vector<std::unique_ptr<float[]>> gs;
  const std::vector<const float*> ptrs = segment_grads(rng, sizes, gs);
  std::vector<float> b(P), a(P);
  for (int64_t j = 0; j < P; ++j) {
    b[j] = j % 4 == 2 ? -0.9f : 0.9f, a[j] = 0.1f * (j + 1);
  }
  auto e = buf<float>(n), y1 = buf<float>(n), y2 = buf<float>(n);
  auto prev = buf<uint8_t>(nbytes), bits1 = buf<uint8_t>(nbytes), bits2 = buf<uint8_t>(nbytes);
  for (int64_t i = 0; i < n; ++i) e[i] = normal(rng);
  for (int64_t i = 0; i < nbytes; ++i) prev[i] = static_cast<uint8_t>(rng()), bits1[i] = bits2[i] = 0x5A;
  const auto dv = squares(d.get(), base + nx);
  const std::vector<float> eps0(P, 0.0f);
  const float* dp = divide ? dv.get() : nullptr;
  float s1 = 0.0f, s2 = 0.0f;
  onebit::momentum_source_cpu(mm.get(), ptrs.data(), dp, eps0.data(), nullptr, u.get(), P, starts.data(), sizes.data(),
                              b.data(), a.data(), nthreads);
  onebit::worker_compress_cpu(u.get() + base, nx, e.get(), y1.get(), n, bits1.get(), W, stride, prev.get(), 0.25f,
                              pending, &s1, nthreads);
  onebit::momentum_compress_cpu(mm.get(), ptrs.data(), dp, eps0.data(), nullptr, P, starts.data(), sizes.data(),
                                b.data(), a.data(), base,
                                nx, e.get(), y2.get(), n, bits2.get(), W, stride, prev.get(), 0.25f, pending, &s2,
                                nthreads);
  check(std::memcmp(&s1, &s2, sizeof(float)) == 0, "source compress: scale", W, nx);
  check(std::memcmp(bits1.get(), bits2.get(), nbytes) == 0, "source compress: bits", W, nx);
  check(std::memcmp(y1.get(), y2.get(), sizeof(float) * n) == 0, "source compress: y", W, nx);
}

// local_compress_cpu against local_source_cpu into u, then worker_compress_cpu of u, as
// run_source_compress_case (p per segment, each its own exact-size buffer, every sixth missing, and
// acc flat, each present or not; a negative weight decay on every fourth segment, none on every
// fifth).
void run_local_compress_case(std::mt19937& rng, const std::vector<int64_t>& sizes, int64_t W, bool precond,
                             bool with_p, bool with_acc, bool pending, int nthreads) {
  const int64_t P = static_cast<int64_t>(sizes.size()), base = 5;
  std::vector<int64_t> starts(P);
  int64_t nx = 0;
  for (int64_t j = 0; j < P; ++j) starts[j] = base + nx, nx += sizes[j];
  const int64_t n = (nx + 8 * W - 1) / (8 * W) * 8 * W, m = n / W, stride = m / 8 + 1, nbytes = (W - 1) * stride + m / 8;
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  auto mm = buf<float>(base + nx), d = buf<float>(base + nx), u = buf<float>(base + nx);
  auto pp = buf<float>(base + nx), acc = buf<float>(base + nx);
  for (int64_t i = 0; i < base + nx; ++i) {
    mm[i] = i % 5 ? 0.1f * normal(rng) : (i % 2 ? -0.0f : 0.0f), d[i] = uni(rng);
    pp[i] = normal(rng), acc[i] = 0.01f * normal(rng);
  }
  std::vector<std::unique_ptr<float[]>> gs;
  const std::vector<const float*> ptrs = segment_grads(rng, sizes, gs);
  std::vector<float> b(P), a(P), nw(P), nlr(P);
  for (int64_t j = 0; j < P; ++j) {
    b[j] = 0.9f, a[j] = 0.1f * (j + 1), nlr[j] = -1e-3f * (j + 1);
    nw[j] = j % 5 == 4 ? 0.0f : (j % 4 == 3 ? 0.05f : -0.01f);
  }
  auto e = buf<float>(n), y1 = buf<float>(n), y2 = buf<float>(n);
  auto prev = buf<uint8_t>(nbytes), bits1 = buf<uint8_t>(nbytes), bits2 = buf<uint8_t>(nbytes);
  for (int64_t i = 0; i < n; ++i) e[i] = normal(rng);
  for (int64_t i = 0; i < nbytes; ++i) prev[i] = static_cast<uint8_t>(rng()), bits1[i] = bits2[i] = 0x5A;
  std::vector<std::unique_ptr<float[]>> own;
  const std::vector<const float*> ps = own_copies(pp.get(), starts, sizes, own, 6);
  const float* const* p = with_p ? ps.data() : nullptr;
  const float* ac = with_acc ? acc.get() : nullptr;
  float s1 = 0.0f, s2 = 0.0f;
  const auto dv = squares(d.get(), base + nx);
  const std::vector<float> eps0(P, 0.0f);
  onebit::local_source_cpu(mm.get(), ptrs.data(), dv.get(), eps0.data(), nullptr, p, ac, u.get(), P, starts.data(),
                           sizes.data(), b.data(),
                           a.data(), nw.data(), nlr.data(), precond, nthreads);
  onebit::worker_compress_cpu(u.get() + base, nx, e.get(), y1.get(), n, bits1.get(), W, stride, prev.get(), 0.25f,
                              pending, &s1, nthreads);
  onebit::local_compress_cpu(mm.get(), ptrs.data(), dv.get(), eps0.data(), nullptr, p, ac, P, starts.data(),
                             sizes.data(), b.data(), a.data(),
                             nw.data(), nlr.data(), precond, base, nx, e.get(), y2.get(), n, bits2.get(), W, stride,
                             prev.get(), 0.25f, pending, &s2, nthreads);
  check(std::memcmp(&s1, &s2, sizeof(float)) == 0, "local compress: scale", W, nx);
  check(std::memcmp(bits1.get(), bits2.get(), nbytes) == 0, "local compress: bits", W, nx);
  check(std::memcmp(y1.get(), y2.get(), sizeof(float) * n) == 0, "local compress: y", W, nx);
}

// local_step_cpu against its formula, value by value and bit for bit (parameters of their own,
// exact-size; every third gradient missing; no decay on every fourth parameter; 1-value gaps in
// the flat buffers stay untouched); a NaN in the last gradient: nothing written, false returned.
void run_local_step_case(std::mt19937& rng, const std::vector<int64_t>& sizes, bool poison, int nthreads) {
  const int64_t P = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> starts(P);
  int64_t n = 0;
  for (int64_t j = 0; j < P; ++j) starts[j] = n + 1, n += sizes[j] + 1;
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  std::normal_distribution<float> normal;
  auto mm = buf<float>(n), d = buf<float>(n), acc = buf<float>(n), m0 = buf<float>(n), acc0 = buf<float>(n);
  for (int64_t i = 0; i < n; ++i) {
    m0[i] = mm[i] = i % 5 ? 0.1f * normal(rng) : (i % 2 ? -0.0f : 0.0f), d[i] = uni(rng);
    acc0[i] = acc[i] = 0.01f * normal(rng);
  }
  std::vector<std::unique_ptr<float[]>> gs;
  std::vector<const float*> ptrs = segment_grads(rng, sizes, gs);
  std::vector<std::unique_ptr<float[]>> ps, ps0;
  std::vector<float*> pp(P);
  std::vector<float> b(P), a(P), w(P), nlr(P);
  for (int64_t j = 0; j < P; ++j) {
    ps.push_back(buf<float>(sizes[j])), ps0.push_back(buf<float>(sizes[j]));
    for (int64_t k = 0; k < sizes[j]; ++k) ps0[j][k] = ps[j][k] = normal(rng);
    pp[j] = ps[j].get();
    b[j] = 0.9f, a[j] = 0.1f * (j + 1), w[j] = j % 4 == 3 ? 0.0f : 0.01f * (j + 1), nlr[j] = -1e-3f * (j + 1);
  }
  int64_t last = P - 1;
  while (last >= 0 && (!ptrs[last] || sizes[last] == 0)) --last;
  if (poison && last >= 0) const_cast<float*>(ptrs[last])[sizes[last] - 1] = std::nanf("");
  const auto dv = squares(d.get(), n);
  const std::vector<float> eps0(P, 0.0f);
  const bool taken = onebit::local_step_cpu(ptrs.data(), mm.get(), dv.get(), eps0.data(), nullptr, acc.get(), pp.data(),
                                            P, starts.data(),
                                            sizes.data(), b.data(), a.data(), w.data(), nlr.data(), nthreads);
  const bool expect = !(poison && last >= 0);
  check(taken == expect, "local step: taken", P, poison);
  std::vector<bool> inside(n, false);
  for (int64_t j = 0; j < P; ++j) {
    for (int64_t k = 0; k < sizes[j]; ++k) {
      const int64_t i = starts[j] + k;
      inside[i] = true;
      float wm = m0[i], wacc = acc0[i], wp = ps0[j][k];
      if (expect) {
        wm = std::fma(ptrs[j] ? ptrs[j][k] : 0.0f, a[j], m0[i] * b[j]);
        float u = wm / d[i];
        if (w[j] != 0.0f) u = std::fma(ps0[j][k], w[j], u);
        wacc = std::fma(u, nlr[j], acc0[i]);
        wp = std::fma(u, nlr[j], ps0[j][k]);
      }
      check(std::memcmp(&mm[i], &wm, sizeof(float)) == 0, "local step: m", j, k);
      check(std::memcmp(&acc[i], &wacc, sizeof(float)) == 0, "local step: acc", j, k);
      check(std::memcmp(&ps[j][k], &wp, sizeof(float)) == 0, "local step: p", j, k);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    if (!inside[i]) check(mm[i] == m0[i] && acc[i] == acc0[i], "local step: gap untouched", i, 0);
}

}  // namespace

// Tiling::walk4 (the CUDA worker pass's walk over an exchange source's segments) on segments
// of the given sizes from a random base: every value below nx is visited once, in order, with
// its own flat index and the segment that holds it; nothing at or beyond nx; starts and sizes
// are exact-size allocations, so a read past them is reported.
void run_tiling_case(std::mt19937& rng, const std::vector<int64_t>& sizes) {
  const int64_t P = static_cast<int64_t>(sizes.size());
  const int64_t base = static_cast<int64_t>(rng() % 1000);
  auto starts = buf<int64_t>(P), sz = buf<int64_t>(P);
  int64_t nx = 0;
  for (int64_t j = 0; j < P; ++j) {
    starts[j] = base + nx;
    sz[j] = sizes[static_cast<size_t>(j)];
    nx += sz[j];
  }
  const onebit::Tiling t{starts.get(), sz.get(), P, base};
  int64_t next = 0;  // the value the walk must visit next
  for (int64_t i = 0; i < nx + 8; i += 4) {
    t.walk4(i, nx, [&](int k, int64_t j, int64_t f) {
      const int64_t v = i + k;
      check(v == next && v < nx, "walk4 visits each value below nx once, in order", v, next);
      check(f == base + v, "walk4 passes the flat index", f, base + v);
      check(j >= 0 && j < P && starts[j] <= f && f < starts[j] + sz[j], "walk4 finds the segment of f", j, f);
      next = v + 1;
    });
  }
  check(next == nx, "walk4 visits every value below nx", next, nx);
}

// The integer codec: every buffer exactly as large as the kernels may touch; decode + error = y
// within float32 rounding, and the server's output + its error = the mean of the decoded rows +
// its old error.
void run_quant_case(std::mt19937& rng, int64_t W, int64_t m, int bits, int64_t block, int64_t nx, int nt) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t n = W * m, nb = m / block, stride = 4 * nb + m * bits / 8;
  auto x = buf<float>(nx), e = buf<float>(n), eo = buf<float>(n), dec = buf<float>(n), se = buf<float>(m);
  auto rows = buf<uint8_t>(W * stride), out = buf<uint8_t>(stride);
  auto back = buf<float>(m);
  for (int64_t i = 0; i < nx; ++i) x[i] = nd(rng) * std::exp(2.0f * nd(rng));
  for (int64_t i = 0; i < n; ++i) e[i] = 0.01f * nd(rng);
  for (int64_t i = 0; i < m; ++i) se[i] = 0.01f * nd(rng);
  onebit::quantize_cpu(x.get(), nx, e.get(), eo.get(), n, bits, block, rows.get(), W, stride, nt);
  onebit::dequantize_cpu(rows.get(), W, stride, m, bits, block, dec.get(), n, nt);
  for (int64_t i = 0; i < n; ++i) {
    const double y = double(i < nx ? x[i] : 0.0f) + e[i];
    check(std::fabs(double(dec[i]) + eo[i] - y) <= 1.2e-7 * std::fabs(y) + 1e-30, "quantize: decoded + error", W, i);
  }
  std::vector<double> c(static_cast<size_t>(m), 0.0);
  for (int64_t r = 0; r < W; ++r)  // the rows a server receives (here every sender's row r)
    for (int64_t i = 0; i < m; ++i) c[i] += double(dec[r * m + i]) / double(W);
  for (int64_t i = 0; i < m; ++i) c[i] += se[i];
  onebit::quantized_reduce_cpu(rows.get(), W, stride, m, bits, block, se.get(), se.get(), out.get(), nt);
  onebit::dequantize_cpu(out.get(), 1, stride, m, bits, block, back.get(), m, nt);
  double big = 0.0;
  for (int64_t i = 0; i < m; ++i) big = std::max(big, std::fabs(c[i]));
  for (int64_t i = 0; i < m; ++i)
    check(std::fabs(double(back[i]) + se[i] - c[i]) <= 1e-5 * big, "quantized_reduce: output + error", W, i);
}

int main() {
  std::mt19937 rng(1234);
  std::printf("simd path: %s\n", onebit::cpu_has_simd() ? "avx2" : "portable");
  int cases = 0;
  for (int64_t W : {1, 2, 3, 4, 7, 8}) {
    for (int64_t m : {8, 16, 24, 1000, 8192, 8200, 70000}) {
      for (int64_t nx : {int64_t(0), W * m / 2 + 3, W * m - 5, W * m}) {
        for (int nt : {1, 2}) {
          run_case(rng, W, m, nx, (m / 8) % 3 + 1, nt);
          ++cases;
        }
      }
    }
  }
  for (bool decay : {false, true}) {
    for (int nt : {1, 2}) {
      run_lamb_case(rng, {0, 5, 8, 1, 20000, 77, 0, 70001}, decay, nt == 2, nt);
      ++cases;
    }
  }
  for (int nt : {1, 2}) {
    run_sign_runs_case(rng, {0, 5, 8, 1, 20000, 77, 0, 70001, 9, 16}, nt);
    run_sign_runs_case(rng, {3}, nt);
    cases += 2;
  }
  for (bool update_v : {false, true}) {
    for (int nt : {1, 2}) {
      for (bool own : {false, true}) {
        run_adam_case(rng, {0, 5, 8, 1, 20000, 77, 0, 70001}, update_v, own, nt);
        ++cases;
      }
    }
  }
  for (bool divide : {false, true}) {
    for (int nt : {1, 2}) {
      run_source_case(rng, {0, 5, 8, 1, 20000, 77, 0, 70001, 9, 16}, divide, nt);
      ++cases;
    }
  }
  for (int64_t W : {1, 2, 3}) {
    for (bool pending : {false, true}) {
      for (int nt : {1, 2}) {
        run_source_compress_case(rng, {5, 8, 1, 20000, 77, 8190, 70001, 9, 16}, W, W != 2, pending, nt);
        run_source_compress_case(rng, {3}, W, true, pending, nt);
        cases += 2;
      }
    }
  }
  for (int64_t W : {1, 2, 3}) {
    for (int flags = 0; flags < 8; ++flags) {
      const bool precond = flags & 1, with_p = flags & 2, with_acc = flags & 4;
      run_local_compress_case(rng, {5, 8, 1, 20000, 77, 8190, 70001, 9, 16}, W, precond, with_p, with_acc,
                              flags % 3 == 1, 1 + flags % 2);
      run_local_compress_case(rng, {3}, W, precond, with_p, with_acc, flags % 3 != 1, 2 - flags % 2);
      cases += 2;
    }
  }
  for (bool poison : {false, true}) {
    for (int nt : {1, 2}) {
      run_local_step_case(rng, {0, 5, 8, 1, 20000, 77, 0, 70001, 9, 16}, poison, nt);
      run_local_step_case(rng, {3}, poison, nt);
      cases += 2;
    }
  }
  for (const auto& sizes : std::vector<std::vector<int64_t>>{
           {3}, {1}, {0, 5, 0, 0, 8, 1, 1, 1, 20000, 77, 0, 7}, {1, 1, 1, 1, 1, 1, 1, 1, 1}, {4, 4, 0}, {2, 0, 3}}) {
    run_tiling_case(rng, sizes);
    ++cases;
  }
  for (int r = 0; r < 20; ++r) {  // random tilings: many short segments, some empty
    std::vector<int64_t> sizes(1 + rng() % 60);
    for (auto& z : sizes) z = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % (r % 2 ? 9 : 300));
    sizes.back() += 1;  // (the range is not empty)
    run_tiling_case(rng, sizes);
    ++cases;
  }
  for (int bits : {4, 8}) {
    for (int64_t block : {2, 256}) {
      for (int64_t W : {1, 3}) {
        for (int nt : {1, 2}) {
          run_quant_case(rng, W, block * 5, bits, block, W * block * 5 - 3, nt);
          ++cases;
        }
      }
    }
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
