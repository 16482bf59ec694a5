// lightning-onebit CUDA kernels: the operations of onebit_cpu.cpp on device pointers, with the
// same packed bits (wire format in onebit.h) and the same float arithmetic, so CPU and GPU ranks
// interoperate.
//
// Layout: a warp owns a 128-value segment of one row at a time. Lane t handles values 4t..4t+3
// (one float4, coalesced); its 4 sign bits form a nibble, and the nibbles of 8 lanes are
// OR-combined by shuffles into one 32-bit little-endian word of the wire format (4 words = the
// segment's 16 bytes). Rows are m values (m % 8 == 0), so a segment's length is a multiple of 8
// and every lane's 4 values are either all inside or all outside the segment.
//
// The server pass and the decompression take kServerUnroll / kUnroll consecutive segments per
// warp and loop iteration, and the optimizer updates kUnroll values per thread, issuing all their
// loads before they compute and store: more bytes in flight per thread. (The worker pass, whose
// loads are already two float4s per lane, measured no faster that way.)
//
// Each compression is two launches on the caller's stream: a fused pass writing the bits and one
// double partial sum of squares per block into the workspace (and y, c into the error buffers:
// the error updates are deferred to the next call, see onebit.h), and a single-block finalize that
// adds the partials in a fixed order and writes the scale to device memory. Without an output
// buffer the worker's error update (e <- y - s*sign(y)) is a separate launch that the caller makes
// once it knows the step goes ahead.
// The grid depends only on the problem size (capped at kMaxBlocks, independent of the GPU), so
// the scale is reproducible. No atomics, no host synchronisation, no allocation.
//
// The fused optimizer updates (adam_update_cuda, lamb_frozen_update_cuda, at the end) are the
// CPU kernels' per-value arithmetic, operation for operation without FMA, on chunks of kUpdChunk
// values (one block each) that never straddle two parameters (layers); LAMB's per-layer sums go
// through per-chunk partials in a per-call workspace and a per-layer finalize, in a fixed order.
// The exchange sources and 0/1 Adam's sync update (momentum_source_cuda, local_source_cuda,
// sync_update_cuda) cut their work the same way but round as torch's CUDA kernels do for the
// optimizers' torch ops, so that they equal the torch path on the same GPU bit for bit. The
// worker pass reads its input through an Input type: a buffer, or an exchange source whose
// values it computes as it reads them, with the source kernels' formulas (momentum_compress_cuda,
// local_compress_cuda: the source's buffer is neither written nor read).
#include "onebit.h"
#include "onebit_tiling.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <tuple>

namespace onebit {
namespace {

constexpr int kThreads = 256;              // threads per block
constexpr int kWarps = kThreads / 32;      // segments per block per step
constexpr int kSeg = 128;                  // values per warp segment (16 packed bytes)
constexpr int64_t kMaxBlocks = 1024;       // grid cap: also the number of partial sums
constexpr int kTile = 2048;                // per-row weights staged in shared memory per tile
constexpr int kUnroll = 4;                 // segments (or values) a thread loads before it writes
constexpr int kServerUnroll = 2;           // the same in the server pass (its registers allow 2)
constexpr int64_t kUpdChunk = 4096;        // values per chunk of the fused optimizer updates (one block)
constexpr unsigned kFull = 0xffffffffu;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("onebit: ") + what + " failed: " + cudaGetErrorString(err));
}

// Makes `device` this thread's current device (in this module's CUDA runtime) for the scope of
// one entry point, and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }  // (cannot fail for a device that was current)
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// kernel<<<grid, threads, 0, stream>>>(args...) through cudaLaunchKernel, whose return value is
// this launch's own error: cudaGetLastError after <<<>>> would also report (and clear) an
// earlier error of someone else's. The arguments are converted to the kernel's parameter types.
template <typename... Params, typename... Args>
void launch(const char* what, void (*kernel)(Params...), int grid, int threads, cudaStream_t stream,
            Args... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "launch: wrong number of kernel arguments");
  std::tuple<Params...> values(args...);
  void* ptrs[sizeof...(Params)];
  std::apply([&ptrs](auto&... v) {
    int i = 0;
    ((ptrs[i++] = static_cast<void*>(&v)), ...);
  }, values);
  check(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(threads), ptrs, 0, stream),
        what);
}

int grid_for(int64_t work_items, int64_t per_block) {
  const int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Every row start bits + j*row_stride is 4-byte aligned (so 32-bit word access is legal).
bool rows_aligned4(const void* bits, int64_t W, int64_t row_stride) {
  return aligned(bits, 4) && (W == 1 || row_stride % 4 == 0);
}

__device__ __forceinline__ float sub_sign(float v, float s) { return v >= 0.0f ? v - s : v + s; }

__device__ __forceinline__ uint32_t nibble(float4 v) {
  return uint32_t(v.x >= 0.0f) | uint32_t(v.y >= 0.0f) << 1 | uint32_t(v.z >= 0.0f) << 2 |
         uint32_t(v.w >= 0.0f) << 3;
}

__device__ __forceinline__ double sq4(float4 v) {
  return double(v.x) * double(v.x) + double(v.y) * double(v.y) + double(v.z) * double(v.z) +
         double(v.w) * double(v.w);
}

// Word (lane / 8) of the segment: nibble of lane 8r+u lands at bits 4u..4u+3. Whole warp calls.
__device__ __forceinline__ uint32_t pack_word(uint32_t nib, int lane) {
  uint32_t v = nib << (4 * (lane & 7));
  v |= __shfl_xor_sync(kFull, v, 1);
  v |= __shfl_xor_sync(kFull, v, 2);
  v |= __shfl_xor_sync(kFull, v, 4);
  return v;
}

// nb (0..4) bytes at p as a little-endian word: one 32-bit access when aligned and whole.
__device__ __forceinline__ uint32_t load_word(const uint8_t* p, int nb, bool al4) {
  if (nb == 4 && al4) return __ldg(reinterpret_cast<const uint32_t*>(p));
  uint32_t w = 0;
  for (int b = 0; b < nb; ++b) w |= uint32_t(__ldg(p + b)) << (8 * b);
  return w;
}

__device__ __forceinline__ void store_word(uint8_t* p, uint32_t w, int nb, bool al4) {
  if (nb == 4 && al4) {
    *reinterpret_cast<uint32_t*>(p) = w;
    return;
  }
  for (int b = 0; b < nb; ++b) p[b] = static_cast<uint8_t>(w >> (8 * b));
}

// Four consecutive floats; float4 when p is 16-byte aligned (vec), otherwise scalar.
__device__ __forceinline__ float4 load4(const float* p, bool vec) {
  if (vec) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}

__device__ __forceinline__ void store4(float* p, float4 v, bool vec) {
  if (vec) {
    *reinterpret_cast<float4*>(p) = v;
    return;
  }
  p[0] = v.x; p[1] = v.y; p[2] = v.z; p[3] = v.w;
}

// Packed bytes of word (lane / 8) that lie inside a segment of len values.
__device__ __forceinline__ int word_bytes(int len, int lane) {
  const int nb = len / 8 - 4 * (lane >> 3);
  return nb < 0 ? 0 : (nb > 4 ? 4 : nb);
}

// Block sum in a fixed order (warp tree, then warps 0..7); result valid in thread 0.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[kWarps];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFull, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  return total;
}

// x[i..i+3], zero beyond nx; float4 when x is 16-byte aligned and the four are inside.
__device__ __forceinline__ float4 load_x4(const float* x, int64_t nx, int64_t i, bool xvec) {
  if (xvec && i + 4 <= nx) return __ldg(reinterpret_cast<const float4*>(x + i));
  float4 v;  // unaligned x, or the float4 straddling / beyond nx (zero extension)
  v.x = i + 0 < nx ? __ldg(x + i + 0) : 0.0f;
  v.y = i + 1 < nx ? __ldg(x + i + 1) : 0.0f;
  v.z = i + 2 < nx ? __ldg(x + i + 2) : 0.0f;
  v.w = i + 3 < nx ? __ldg(x + i + 3) : 0.0f;
  return v;
}

// ------------------------------------------------------------ what the worker pass reads
// The exchange sources' values, one formula each, shared by their kernels (momentum_source_kernel,
// local_source_kernel: into a buffer) and by the worker pass that computes them as it reads them
// (momentum_compress_cuda, local_compress_cuda). They round as torch's CUDA kernels do; the table of
// roundings is above momentum_source_kernel.

// The frozen variance's denominator of a value (onebit.h): (sqrt(v) * dscale) + eps, each rounded
// on its own, as the CPU kernels compute it (dscale 1 where no scale is given).
__device__ __forceinline__ float denom_value(float v, float eps, float dscale) {
  return __fadd_rn(__fmul_rn(__fsqrt_rn(v), dscale), eps);
}

// Segment j's eps and dscale (1 where dscale is null), from the per-segment rows.
struct DenomCoef {
  float eps, dscale;
};

__device__ __forceinline__ DenomCoef denom_coef(const float* eps, const float* dscale, int64_t j) {
  return {eps ? eps[j] : 0.0f, dscale ? dscale[j] : 1.0f};
}

// momentum_source's value: fma(g, a, m * b), then / d where divide.
__device__ __forceinline__ float momentum_value(float m, float g, float d, bool divide, float b, float a) {
  float x = __fmul_rn(m, b);       // torch.mul(m, b)
  x = __fmaf_rn(g, a, x);          // .add_(g, alpha=a)
  return divide ? __fdiv_rn(x, d)  // .div_(d)
                : x;
}

// One segment's coefficients for local_value; w = -nw (torch's alpha / value: -float(-wd) ==
// float(wd)); decay: a parameter and nw not +0.0.
struct LocalCoef {
  float b, a, w, r;
  bool decay;
};

__device__ __forceinline__ LocalCoef local_coef(const float* beta, const float* alpha, const float* nw,
                                                const float* nlr, bool has_p, int64_t j) {
  const float nwj = nw[j];
  return {beta[j], alpha[j], -nwj, nlr[j], has_p && __float_as_uint(nwj) != 0u};
}

// local_source's value (see local_source_kernel); p is read only where c.decay, acc where has_acc.
__device__ __forceinline__ float local_value(float m, float g, float d, float p, float acc, bool has_acc,
                                             const LocalCoef& c, bool precond) {
  float x = __fmul_rn(m, c.b);  // torch.mul(m, b)
  x = __fmaf_rn(g, c.a, x);     // .add_(g, alpha=a)
  if (precond) {
    x = __fdiv_rn(x, d);                       // .div_(d)
    if (c.decay) x = __fmaf_rn(p, c.w, x);     // .add_(p, alpha=w)
  } else if (c.decay) {
    x = c.w == 1.0f ? __fmaf_rn(p, d, x)       // .addcmul_(p, d, value=w), value 1: fma(t1, t2, self)
                    : __fmaf_rn(c.w, __fmul_rn(p, d), x);  // else fma(value, t1 * t2, self)
  }
  x = __fmul_rn(x, c.r);  // .mul_(-lr)
  if (has_acc) x = precond ? __fadd_rn(x, acc)   // .add_(acc) (alpha 1: fma(acc, 1, x), one rounding)
                           : __fmaf_rn(acc, d, x);  // .addcmul_(acc, d) (value 1: fma(acc, d, x))
  return x;
}

// The worker pass's input as a buffer: x[i], zero beyond nx (float4 loads where x is 16-byte aligned).
struct BufferInput {
  const float* x;
  bool vec;
  __device__ float4 load4(int64_t i, int64_t nx) const { return load_x4(x, nx, i, vec); }
};

// Values i..i+3 of a source over `t` (zero beyond nx): Src::segment(j) loads segment j's
// pointers and coefficients once per segment met, Src::value(seg, f) computes flat index f of it.
template <class Src>
__device__ __forceinline__ float4 source_x4(const Src& src, const Tiling& t, int64_t i, int64_t nx) {
  float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  typename Src::Segment seg{};
  int64_t last = -1;
  t.walk4(i, nx, [&](int k, int64_t j, int64_t f) {
    if (j != last) {
      seg = src.segment(j);
      last = j;
    }
    r[k] = src.value(seg, f);
  });
  return make_float4(r[0], r[1], r[2], r[3]);
}

// momentum_source's values over a tiling (momentum_source_kernel's arguments), computed as read.
struct MomentumInput {
  Tiling t;
  const float* m;
  const float* const* g;
  const float* v;  // null: no denominator
  const float* eps;
  const float* dscale;
  const float* beta;
  const float* alpha;
  struct Segment {
    const float* g;  // null: zeros
    int64_t start;
    float b, a;
    DenomCoef dc;
  };
  __device__ Segment segment(int64_t j) const {
    return {g[j], t.starts[j], beta[j], alpha[j], v ? denom_coef(eps, dscale, j) : DenomCoef{0.0f, 1.0f}};
  }
  __device__ float value(const Segment& s, int64_t f) const {
    const float d = v ? denom_value(v[f], s.dc.eps, s.dc.dscale) : 1.0f;
    return momentum_value(m[f], s.g ? s.g[f - s.start] : 0.0f, d, v != nullptr, s.b, s.a);
  }
  __device__ float4 load4(int64_t i, int64_t nx) const { return source_x4(*this, t, i, nx); }
};

// local_source's values over a tiling (local_source_kernel's arguments), computed as read.
struct LocalInput {
  Tiling t;
  const float* m;
  const float* const* g;
  const float* v;
  const float* eps;
  const float* dscale;
  const float* const* p;
  const float* acc;
  const float* beta;
  const float* alpha;
  const float* nw;
  const float* nlr;
  bool precond;
  struct Segment {
    const float* g;  // null: zeros
    const float* p;  // read only where c.decay
    int64_t start;
    LocalCoef c;
    DenomCoef dc;
  };
  __device__ Segment segment(int64_t j) const {
    const float* pj = p ? p[j] : nullptr;
    return {g[j], pj, t.starts[j], local_coef(beta, alpha, nw, nlr, pj != nullptr, j), denom_coef(eps, dscale, j)};
  }
  __device__ float value(const Segment& s, int64_t f) const {
    const float gi = s.g ? s.g[f - s.start] : 0.0f;
    const float pi = s.c.decay ? s.p[f - s.start] : 0.0f;
    const float d = denom_value(v[f], s.dc.eps, s.dc.dscale);
    return local_value(m[f], gi, d, pi, acc ? acc[f] : 0.0f, acc != nullptr, s.c, precond);
  }
  __device__ float4 load4(int64_t i, int64_t nx) const { return source_x4(*this, t, i, nx); }
};

// Worker pass: y = x + e_true (x: an Input, zero beyond nx), bits <- sign(y), partial <- sum y^2, and
// e_out <- y unless e_out is null. With `pending` (a non-null prev_scale), e_true = e - prev_scale *
// sign(prev_bits): the previous call's deferred error update; otherwise e_true = e. prev_bits may be
// bits: a warp reads the words of its segment before it overwrites them, and no other warp touches
// them; e_out may be e (each thread reads its values first).
template <class Input>
__global__ void __launch_bounds__(kThreads)
worker_pass1(const Input x, int64_t nx, const float* e, float* e_out, int64_t m, int64_t nseg, int64_t spr,
             const uint8_t* prev_bits, uint8_t* bits, int64_t row_stride, bool evec, bool al4,
             bool al4_prev, const float* prev_scale, double* partial) {
  const bool pending = prev_scale != nullptr;
  const float sp = pending ? *prev_scale : 0.0f;
  const int lane = threadIdx.x & 31, sh = 4 * (lane & 7);
  double acc = 0.0;
  // Warp-uniform grid-stride loop: every lane reaches the shuffles in pack_word.
  for (int64_t g = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); g < nseg;
       g += int64_t(gridDim.x) * kWarps) {
    const int64_t row = g / spr, off = (g - row * spr) * kSeg;
    const int len = int(m - off < kSeg ? m - off : kSeg);
    const int64_t i = row * m + off + 4 * lane;
    const int64_t word = row * row_stride + off / 8 + 4 * (lane >> 3);  // this lane's word of the bits
    const int nb = word_bytes(len, lane);
    uint32_t nib = 0;
    if (4 * lane < len) {
      const float4 xv = x.load4(i, nx);
      float4 et = load4(e + i, evec);
      if (pending) {
        // plain loads, not __ldg: prev_bits may be bits, which this kernel writes
        const uint8_t* q = prev_bits + word;
        uint32_t pw = 0;
        if (nb == 4 && al4_prev) pw = *reinterpret_cast<const uint32_t*>(q);
        else for (int b = 0; b < nb; ++b) pw |= uint32_t(q[b]) << (8 * b);
        pw >>= sh;
        et.x = (pw & 1u) ? et.x - sp : et.x + sp;
        et.y = (pw & 2u) ? et.y - sp : et.y + sp;
        et.z = (pw & 4u) ? et.z - sp : et.z + sp;
        et.w = (pw & 8u) ? et.w - sp : et.w + sp;
      }
      const float4 y = make_float4(xv.x + et.x, xv.y + et.y, xv.z + et.z, xv.w + et.w);
      if (e_out) store4(e_out + i, y, evec);
      acc += sq4(y);
      nib = nibble(y);
    }
    const uint32_t packed = pack_word(nib, lane);
    if ((lane & 7) == 0) store_word(bits + word, packed, nb, al4);
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// Server pass: c = sum_i (bit_i ? w_i : -w_i) in row order, + e_true; e_out <- c; bits <- sign(c).
// With `pending` (a non-null prev_scale), e_true = e - prev_scale * sign(prev_bits): the previous
// call's deferred error update (see onebit.h). prev_bits may be out_bits: a warp reads the words
// of its segments before it overwrites them, and no other warp touches them; e_out may be e
// (each thread reads its values first). A warp takes kServerUnroll consecutive segments per iteration:
// each row's loads of the kServerUnroll segments are in flight together.
__global__ void __launch_bounds__(kThreads, 4)  // <= 64 registers: 4 blocks per SM
server_pass1(const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales,
             int64_t scale_stride, const float* e, float* e_out, int64_t m, int64_t nseg,
             const uint8_t* prev_bits, uint8_t* out_bits, bool evec, bool al4_in, bool al4_out,
             const float* prev_scale, double* partial) {
  __shared__ float w_s[kTile];
  const bool pending = prev_scale != nullptr;
  const float sp = pending ? *prev_scale : 0.0f;  // w_i = scale_i / W (float division, as on the CPU)
  const float fW = static_cast<float>(W);
  const bool one_tile = W <= kTile;
  if (one_tile) {  // the common case: stage all weights once
    for (int k = threadIdx.x; k < W; k += kThreads) w_s[k] = __fdiv_rn(__ldg(scales + k * scale_stride), fW);
    __syncthreads();
  }
  const int lane = threadIdx.x & 31, r = lane >> 3, sh = 4 * (lane & 7);
  const int64_t step = int64_t(gridDim.x) * kWarps * kServerUnroll;
  double acc = 0.0;
  // Block-uniform loop (tiles of weights need __syncthreads); each warp takes kServerUnroll segments.
  for (int64_t b0 = int64_t(blockIdx.x) * kWarps * kServerUnroll; b0 < nseg; b0 += step) {
    const int64_t g0 = b0 + int64_t(threadIdx.x >> 5) * kServerUnroll;
    int nb[kServerUnroll];
    bool act[kServerUnroll];  // this lane's 4 values lie inside segment u (a lane with nb > 0 may not)
    float4 ev[kServerUnroll], c[kServerUnroll];
    uint32_t ob[kServerUnroll];
#pragma unroll
    for (int u = 0; u < kServerUnroll; ++u) {
      const int64_t g = g0 + u, off = g * kSeg;
      const int len = g < nseg ? int(m - off < kSeg ? m - off : kSeg) : 0;
      nb[u] = word_bytes(len, lane);
      act[u] = 4 * lane < len;
      ev[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      c[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      ob[u] = 0;
      if (!act[u]) continue;
      ev[u] = load4(e + off + 4 * lane, evec);  // issued early: overlaps the row loop
      if (pending) {
        // plain loads, not __ldg: prev_bits may be out_bits, which this kernel writes
        const uint8_t* q = prev_bits + off / 8 + 4 * r;
        if (nb[u] == 4 && al4_out) ob[u] = *reinterpret_cast<const uint32_t*>(q);
        else for (int b = 0; b < nb[u]; ++b) ob[u] |= uint32_t(q[b]) << (8 * b);
        ob[u] >>= sh;
      }
    }
    for (int64_t t0 = 0; t0 < W; t0 += kTile) {
      const int cnt = int(W - t0 < kTile ? W - t0 : kTile);
      if (!one_tile) {
        __syncthreads();
        for (int k = threadIdx.x; k < cnt; k += kThreads)
          w_s[k] = __fdiv_rn(__ldg(scales + (t0 + k) * scale_stride), fW);
        __syncthreads();
      }
      const uint8_t* p = bits + t0 * row_stride + (g0 * kSeg) / 8 + 4 * r;
#pragma unroll 2
      for (int k = 0; k < cnt; ++k, p += row_stride) {
        const float wk = w_s[k];
#pragma unroll
        for (int u = 0; u < kServerUnroll; ++u) {
          if (!act[u]) continue;
          const uint32_t bw = load_word(p + u * (kSeg / 8), nb[u], al4_in) >> sh;
          c[u].x += (bw & 1u) ? wk : -wk;  // same order of float adds as the CPU
          c[u].y += (bw & 2u) ? wk : -wk;
          c[u].z += (bw & 4u) ? wk : -wk;
          c[u].w += (bw & 8u) ? wk : -wk;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kServerUnroll; ++u) {
      const int64_t g = g0 + u, off = g * kSeg;
      uint32_t nib = 0;
      if (act[u]) {
        float4 et = ev[u];
        if (pending) {
          et.x = (ob[u] & 1u) ? et.x - sp : et.x + sp;
          et.y = (ob[u] & 2u) ? et.y - sp : et.y + sp;
          et.z = (ob[u] & 4u) ? et.z - sp : et.z + sp;
          et.w = (ob[u] & 8u) ? et.w - sp : et.w + sp;
        }
        float4 cu = c[u];
        cu.x += et.x; cu.y += et.y; cu.z += et.z; cu.w += et.w;
        store4(e_out + off + 4 * lane, cu, evec);
        acc += sq4(cu);
        nib = nibble(cu);
      }
      const uint32_t word = pack_word(nib, lane);
      if ((lane & 7) == 0) store_word(out_bits + off / 8 + 4 * r, word, nb[u], al4_out);
    }
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// Single block: add the partials in a fixed order; scale = sqrt(total) / sqrt(count), in double.
__global__ void __launch_bounds__(kThreads)
finalize_scale(const double* partial, int nparts, int64_t count, float* scale_out) {
  double v = 0.0;
  for (int k = threadIdx.x; k < nparts; k += kThreads) v += partial[k];
  const double total = block_sum(v);
  if (threadIdx.x == 0) *scale_out = __double2float_rn(sqrt(total) / sqrt(static_cast<double>(count)));
}

// Worker pass 2: e_out <- y - s * sign(y), y = x + e recomputed (x zero beyond nx), s from
// device memory. e_out may be e.
__global__ void __launch_bounds__(kThreads)
worker_update(const float* x, int64_t nx, const float* e, float* e_out, int64_t n, const float* scale,
              bool xvec, bool evec) {
  const float s = *scale;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t tid = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  int64_t done = 0;
  if (evec) {  // n is a multiple of 8, so float4s cover e exactly
    for (int64_t k = tid; k < n / 4; k += stride) {
      const float4 xv = load_x4(x, nx, 4 * k, xvec);
      float4 v = reinterpret_cast<const float4*>(e)[k];
      v.x = sub_sign(xv.x + v.x, s); v.y = sub_sign(xv.y + v.y, s);
      v.z = sub_sign(xv.z + v.z, s); v.w = sub_sign(xv.w + v.w, s);
      reinterpret_cast<float4*>(e_out)[k] = v;
    }
    done = n / 4 * 4;
  }
  for (int64_t k = done + tid; k < n; k += stride) e_out[k] = sub_sign((k < nx ? x[k] : 0.0f) + e[k], s);
}

// out[row*m + k] = bit ? s_row : -s_row for row*m + k < nout. A warp takes kUnroll consecutive
// segments per iteration and issues all their loads before any store (memory-level parallelism:
// one load round trip per kUnroll segments).
__global__ void __launch_bounds__(kThreads)
decompress_kernel(const uint8_t* bits, int64_t row_stride, const float* scales, int64_t scale_stride,
                  int64_t m, int64_t nseg, int64_t spr, float* out, int64_t nout, bool ovec, bool al4) {
  const int lane = threadIdx.x & 31;
  const int v0 = 4 * lane;
  const int64_t nwarps = int64_t(gridDim.x) * kWarps;
  for (int64_t g0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kUnroll; g0 < nseg;
       g0 += nwarps * kUnroll) {
    uint32_t b[kUnroll];
    float s[kUnroll];
    int64_t base[kUnroll];
    int cnt[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = g0 + u;
      cnt[u] = 0;
      b[u] = 0;
      s[u] = 0.0f;
      base[u] = 0;
      if (g >= nseg) continue;  // no shuffles here, lanes may diverge
      const int64_t row = g / spr, off = (g - row * spr) * kSeg;
      base[u] = row * m + off;
      const int len = int(m - off < kSeg ? m - off : kSeg);
      const int64_t keep = nout - base[u];  // values kept (padding dropped); <= 0: none
      cnt[u] = keep < len ? int(keep > 0 ? keep : 0) : len;
      if (v0 >= cnt[u]) continue;
      // Read only the bytes holding kept values (like the CPU: the padding's bytes may be absent).
      b[u] = load_word(bits + row * row_stride + off / 8 + 4 * (lane >> 3),
                       word_bytes((cnt[u] + 7) / 8 * 8, lane), al4) >> (4 * (lane & 7));
      s[u] = __ldg(scales + row * scale_stride);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v0 >= cnt[u]) continue;
      const float su = s[u];
      const uint32_t bu = b[u];
      const float4 v = make_float4((bu & 1u) ? su : -su, (bu & 2u) ? su : -su, (bu & 4u) ? su : -su,
                                   (bu & 8u) ? su : -su);
      float* o = out + base[u] + v0;
      if (v0 + 4 <= cnt[u]) {
        store4(o, v, ovec);
      } else {  // last float4 of the unpadded output
        o[0] = v.x;
        if (v0 + 1 < cnt[u]) o[1] = v.y;
        if (v0 + 2 < cnt[u]) o[2] = v.z;
      }
    }
  }
}

// ------------------------------------------------------------ fused optimizer updates
// The CPU kernels' arithmetic (adam_block_scalar / lamb_block_scalar in onebit_cpu.cpp, built
// with -ffp-contract=off), one float32 operation at a time through the _rn intrinsics, which
// nvcc never contracts into a fused multiply-add (plain a * b + c may become an FMA by default):
// every value written is bit for bit the CPU's. Plain loads and stores (no __ldg, no
// __restrict__): the buffers may alias one another (in-place use); each value is read and
// written by one thread only. Scalar 32-bit accesses (coalesced; no float4, so nothing to align).
// One block per chunk of kUpdChunk values, a block-uniform grid-stride loop over the chunks.

// The parameter (layer) that owns chunk c: the largest j in [0, count) with chunk_start[j] <= c.
// Empty ones own no chunk (chunk_start[j] == chunk_start[j + 1]), so that j also has
// chunk_start[j + 1] > c whenever c < chunk_start[count]. count >= 1.
__device__ __forceinline__ int64_t chunk_owner(const int64_t* chunk_start, int64_t count, int64_t c) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (chunk_start[mid] <= c) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// std::max(a, b) of the CPU: b only if a < b (a NaN b never wins).
__device__ __forceinline__ double max_as_cpu(double a, double b) { return a < b ? b : a; }

// Block reduction of three values in a fixed order (warp tree, then warps 0..kWarps-1 in order):
// a max and two sums; results valid in thread 0. Every thread of the block calls it. Ends with a
// barrier, so a loop may call it again (its shared arrays are reused).
__device__ __forceinline__ void block_stats3(double& r, double& a, double& b) {
  __shared__ double s_r[kWarps], s_a[kWarps], s_b[kWarps];
  for (int o = 16; o > 0; o >>= 1) {
    r = max_as_cpu(r, __shfl_down_sync(kFull, r, o));
    a = __dadd_rn(a, __shfl_down_sync(kFull, a, o));
    b = __dadd_rn(b, __shfl_down_sync(kFull, b, o));
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    s_r[warp] = r;
    s_a[warp] = a;
    s_b[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    r = s_r[0];
    a = s_a[0];
    b = s_b[0];
    for (int w = 1; w < kWarps; ++w) {
      r = max_as_cpu(r, s_r[w]);
      a = __dadd_rn(a, s_a[w]);
      b = __dadd_rn(b, s_b[w]);
    }
  }
  __syncthreads();
}

// Chunk c of the parameter updates' chunk table: its parameter j, whose flat values start at
// `start`, and the flat range [lo, hi) of the chunk (at most kUpdChunk values, one parameter).
struct ParamChunk {
  int64_t j, start, lo, hi;
  __device__ ParamChunk(const int64_t* chunk_start, int64_t P, const int64_t* starts, const int64_t* sizes,
                        int64_t c) {
    j = chunk_owner(chunk_start, P, c);
    start = starts[j];
    const int64_t end = start + sizes[j];
    lo = start + (c - chunk_start[j]) * kUpdChunk;
    hi = lo + kUpdChunk < end ? lo + kUpdChunk : end;
  }
};

// Adam's step without bias correction (adam_block_scalar): per value i of parameter j,
//   m <- m * beta1 + ob1 * g;  v <- v * beta2 + ob2 * (g * g) (update_v);
//   p <- p - lr * (m / (sqrt(v) + eps) + wd * p)
// j's gradient is g[j], its value of flat index i at g[j][i - starts[j]] (as its parameter's),
// +0.0 where g[j] is null. With ok (a verdict on the device; null: always) false: nothing.
__global__ void __launch_bounds__(kThreads)
adam_kernel(const bool* ok, const float* const* g, float* m, float* v, float* const* params, int64_t P, const int64_t* starts,
            const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks, const float* lr, const float* beta1,
            const float* ob1, const float* beta2, const float* ob2, const float* eps, const float* wd,
            bool update_v) {
  if (ok != nullptr && !*ok) return;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const ParamChunk pc(chunk_start, P, starts, sizes, c);
    const int64_t j = pc.j, start = pc.start, lo = pc.lo, hi = pc.hi;
    float* const p = params[j];  // value i of the flat buffers is p[i - start], and gj[i - start]
    const float* const gj = g[j];
    const float l = lr[j], b1 = beta1[j], o1 = ob1[j], b2 = beta2[j], o2 = ob2[j], ep = eps[j], w = wd[j];
    // kUnroll values per thread: all loads first (values of one thread only, so in-place
    // aliasing is still read-before-write per value)
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float gr[kUnroll], mr[kUnroll], vr[kUnroll], pr[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        gr[k] = gj ? gj[i - start] : 0.0f;
        mr[k] = m[i];
        vr[k] = v[i];
        pr[k] = p[i - start];
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        const float gi = gr[k];
        const float mi = __fadd_rn(__fmul_rn(mr[k], b1), __fmul_rn(o1, gi));
        const float vi = update_v ? __fadd_rn(__fmul_rn(vr[k], b2), __fmul_rn(o2, __fmul_rn(gi, gi))) : vr[k];
        const float pi = pr[k];
        const float u = __fadd_rn(__fdiv_rn(mi, __fadd_rn(__fsqrt_rn(vi), ep)), __fmul_rn(w, pi));
        m[i] = mi;
        if (update_v) v[i] = vi;
        p[i - start] = __fsub_rn(pi, __fmul_rn(l, u));
      }
    }
  }
}

// 1-bit Adam's compression-phase step after the exchange (kernels.frozen_adam_update), only when
// *ok (the exchange's verdict, on the device: nothing is written otherwise). Per value i of
// parameter j:
//   p <- p + nlw * p (skipped when nlw == 0), then
//   precond: m <- x * d;  p <- p + nlr * x       else: m <- x;  p <- p + (nlr * x) / d
// with nlr = -lr and nlw = -lr * weight_decay: the CPU path's torch ops in their order and with
// their roundings as measured on x86 (add_ with alpha is one fused multiply-add there, addcdiv_
// rounds value * x, then the quotient, then the sum).
__global__ void __launch_bounds__(kThreads)
frozen_adam_kernel(const bool* ok, const float* x, float* m, const float* v, const float* eps, const float* dscale,
                   float* const* params, int64_t P,
                   const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks,
                   const float* nlr, const float* nlw, bool precond) {
  if (!*ok) return;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const ParamChunk pc(chunk_start, P, starts, sizes, c);
    const int64_t j = pc.j, start = pc.start, lo = pc.lo, hi = pc.hi;
    float* const p = params[j];  // value i of the flat buffers is p[i - start]
    const float a = nlr[j], b = nlw[j];
    const DenomCoef dc = denom_coef(eps, dscale, j);
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float xr[kUnroll], vr[kUnroll], pr[kUnroll];  // all loads first, as in adam_kernel
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        xr[k] = x[i];
        vr[k] = v[i];
        pr[k] = p[i - start];
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        const float xi = xr[k], di = denom_value(vr[k], dc.eps, dc.dscale);
        float pi = pr[k];
        if (b != 0.0f) pi = __fmaf_rn(b, pi, pi);
        if (precond) {
          m[i] = __fmul_rn(xi, di);
          pi = __fmaf_rn(a, xi, pi);
        } else {
          m[i] = xi;
          pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(a, xi), di));
        }
        p[i - start] = pi;
      }
    }
  }
}

// ------------------------------------------------------------ exchange sources and 0/1 Adam's sync
// Unlike the updates above (the CPU kernels' roundings), these three round as torch's own CUDA
// kernels do for the optimizers' op sequences (kernels/reference.py), op for op, so that they
// write the floats of the torch path on the same GPU bit for bit. Each torch op is one rounding,
// written here as the intrinsic that performs it (nvcc contracts none of them):
//   torch.mul(t, s), mul_(s)       MulFunctor a * b                              __fmul_rn(a, s)
//   add_(t, alpha=s)               ufunc add `self + alpha * other`, which nvcc
//                                  (fmad on, as torch builds) contracts          __fmaf_rn(t, s, self)
//   div_(t)                        DivFunctor a / b (IEEE: no fast math)          __fdiv_rn(a, t)
//   torch.div(t, s), s a Python    BinaryDivTrueKernel: t * float(1 / s), the
//   float                          reciprocal taken on the host in double        __fmul_rn(t, inv)
//   addcmul_(t1, t2, value=v)      pointwise_op_impl: std::fma(v, t1 * t2, self)  __fmaf_rn(v, __fmul_rn(t1, t2), self)
//                                  std::fma(t1, t2, self) when v == 1             __fmaf_rn(t1, t2, self)
//                                  (the torch >= 2.13 this package requires; torch before pointwise_op_impl
//                                  rounded t1 * t2 for v == 1 too)
//   addcdiv_(t1, t2) (value 1)     pointwise_op_impl: self + t1 / t2              __fadd_rn(self, __fdiv_rn(t1, t2))
// Otherwise as frozen_adam_kernel: chunk table, kUnroll values per thread with all loads first,
// plain loads and stores (outputs may alias inputs value for value; each value is one thread's).

// The momentum the exchange sends (kernels.momentum_source): per value i of segment j,
//   u <- fma(g, a, m * b), then u <- u / d where d is not null
// (torch.mul(m, b, out=u).add_(g, alpha=a), u.div_(d)); segment j's gradient is g[j], its value
// of flat index i at g[j][i - starts[j]] (as a parameter in frozen_adam_kernel), +0.0 where g[j]
// is null.
__global__ void __launch_bounds__(kThreads)
momentum_source_kernel(const float* m, const float* const* g, const float* v, const float* eps,
                       const float* dscale, float* u, int64_t P,
                       const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks,
                       const float* beta, const float* alpha) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const ParamChunk pc(chunk_start, P, starts, sizes, c);
    const int64_t start = pc.start, lo = pc.lo, hi = pc.hi;
    const float* const gj = g[pc.j];
    const float b = beta[pc.j], a = alpha[pc.j];
    const DenomCoef dc = v ? denom_coef(eps, dscale, pc.j) : DenomCoef{0.0f, 1.0f};
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float mr[kUnroll], gr[kUnroll], vr[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        mr[k] = m[i];
        gr[k] = gj ? gj[i - start] : 0.0f;
        vr[k] = v ? v[i] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        const float di = v ? denom_value(vr[k], dc.eps, dc.dscale) : 1.0f;
        u[i] = momentum_value(mr[k], gr[k], di, v != nullptr, b, a);
      }
    }
  }
}

// 0/1 Adam's exchange source on a sync step (kernels.local_source): per value i of segment j,
// with w = -nw[j] (the decay term only where p and p[j] are not null and nw[j] is not +0.0; the
// accumulator's only where acc is not null); g[j] and p[j] are segment j's gradient and
// parameter, each read at [i - starts[j]] as in momentum_source_kernel (a null g[j]: zeros):
//   x = fma(g, a, m * b)                          torch.mul(m, b, out=x).add_(g, alpha=a)
//   precond: x = x / d;  x = fma(p, w, x)         div_(d); add_(p, alpha=w)
//   else:    x = fma(w, p * d, x)                 addcmul_(p, d, value=w) (fma(p, d, x) if w == 1)
//   x = x * nlr                                   mul_(-lr)
//   precond: x = x + acc;  else: x = fma(acc, d, x)    add_(acc); addcmul_(acc, d)
//   u <- x
__global__ void __launch_bounds__(kThreads)
local_source_kernel(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale,
                    const float* const* p, const float* acc,
                    float* u, int64_t P, const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start,
                    int64_t nchunks, const float* beta, const float* alpha, const float* nw, const float* nlr,
                    bool precond) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const ParamChunk pc(chunk_start, P, starts, sizes, c);
    const int64_t start = pc.start, lo = pc.lo, hi = pc.hi;
    const float* const gj = g[pc.j];
    const float* const pj = p ? p[pc.j] : nullptr;
    const LocalCoef coef = local_coef(beta, alpha, nw, nlr, pj != nullptr, pc.j);
    const bool decay = coef.decay;
    const DenomCoef dc = denom_coef(eps, dscale, pc.j);
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float mr[kUnroll], gr[kUnroll], vr[kUnroll], pr[kUnroll], ar[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        mr[k] = m[i];
        gr[k] = gj ? gj[i - start] : 0.0f;
        vr[k] = v[i];
        pr[k] = decay ? pj[i - start] : 0.0f;
        ar[k] = acc ? acc[i] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        const float di = denom_value(vr[k], dc.eps, dc.dscale);
        u[i] = local_value(mr[k], gr[k], di, pr[k], ar[k], acc != nullptr, coef, precond);
      }
    }
  }
}

// 1-bit LAMB's per-layer step (kernels.layer_step): per value i of parameter j,
//   p <- fma(u, alpha[j], p)                       p.addcmul_(u, alpha[j]) (value 1: fma(t1, t2, self))
// one launch for all parameters where torch makes one per parameter.
__global__ void __launch_bounds__(kThreads)
layer_step_kernel(const float* u, float* const* params, int64_t P, const int64_t* starts, const int64_t* sizes,
                  const int64_t* chunk_start, int64_t nchunks, const float* alpha) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const ParamChunk pc(chunk_start, P, starts, sizes, c);
    float* const p = params[pc.j];  // value i of u is p[i - start]
    const float a = alpha[pc.j];
    const int64_t start = pc.start, lo = pc.lo, hi = pc.hi;
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float ur[kUnroll], pr[kUnroll];  // all loads first, as in adam_kernel
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        ur[k] = u[i];
        pr[k] = p[i - start];
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        p[i - start] = __fmaf_rn(ur[k], a, pr[k]);
      }
    }
  }
}

// 0/1 Adam's update after a sync step's exchange x (kernels.sync_update): per value i of
// parameter j (storage params[j], or no parameter written when params is null),
//   m <- (precond ? x * d : x) * inv[j]     torch.mul(x, d, out=m); torch.div(., -lrs, out=m)
//   m <- +0.0 where inv[j] is +0.0 (no lr since the last sync: zero_()) or floored[i] (masked_fill_)
//   synced <- precond ? synced + x : synced + x / d;  p <- synced;  acc <- 0 (unless null)
// inv[j] is float(1.0 / -lrs[j]) (in double, rounded once), computed by the caller as torch
// computes it on the host for a division by a Python scalar.
__global__ void __launch_bounds__(kThreads)
sync_update_kernel(const float* x, const float* v, const float* eps, const float* dscale, const uint8_t* floored,
                   float* m, float* synced,
                   float* const* params, float* acc, int64_t P, const int64_t* starts, const int64_t* sizes,
                   const int64_t* chunk_start, int64_t nchunks, const float* inv, bool precond) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const ParamChunk pc(chunk_start, P, starts, sizes, c);
    const int64_t start = pc.start, lo = pc.lo, hi = pc.hi;
    float* const p = params ? params[pc.j] : nullptr;  // value i of the flat buffers is p[i - start]
    const float q = inv[pc.j];
    const bool zero = __float_as_uint(q) == 0u;  // +0.0: m = 0
    const DenomCoef dc = denom_coef(eps, dscale, pc.j);
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float xr[kUnroll], vr[kUnroll], sr[kUnroll];
      bool fr[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        xr[k] = x[i];
        vr[k] = v[i];
        sr[k] = synced[i];
        fr[k] = floored ? floored[i] != 0 : false;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        const float xi = xr[k], di = denom_value(vr[k], dc.eps, dc.dscale);
        float mi = precond ? __fmul_rn(xi, di) : xi;  // torch.mul(x, d, out=m)
        mi = zero ? 0.0f : __fmul_rn(mi, q);          // torch.div(., -lrs): . * (1 / -lrs); or zero_()
        if (fr[k]) mi = 0.0f;                         // masked_fill_(floored, 0.0)
        m[i] = mi;
        const float si = precond ? __fadd_rn(sr[k], xi)                // synced.add_(x)
                                 : __fadd_rn(sr[k], __fdiv_rn(xi, di));  // synced.addcdiv_(x, d)
        synced[i] = si;
        if (p) p[i - start] = si;  // p.copy_(synced)
        if (acc) acc[i] = 0.0f;    // acc.zero_()
      }
    }
  }
}

// dst <- src (n bytes) only when !*ok: an exchange's double-buffered state put back after a call
// whose verdict (on the device) was non-finite. When *ok every thread returns at once: the common
// case costs one launch.
__global__ void __launch_bounds__(kThreads)
restore_kernel(const bool* ok, uint8_t* dst, const uint8_t* src, int64_t n) {
  if (*ok) return;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

// 1-bit LAMB's compression-phase update (lamb_block_scalar): per value i of layer k,
//   mn = (precond ? x * d : x) / scaling;  g = (mn - beta1 * m) / ob1;  vf <- vf * beta2 + ob2 * (g * g);
//   up = mn / d;  u <- up + wd * p (up when p or p[k] is null);  m <- mn;
// and the chunk's max d / (sqrt(vf) + eps), sum up^2, sum u^2 into partial[3c .. 3c + 2].
// p[k] is layer k's parameter, its value of flat index i at p[k][i - offsets[k]].
// With ok (the exchange's verdict, on the device; null: always) false: u <- 0 and nothing else
// (m, vf unchanged; lamb_finalize writes neutral stats), so p - lr * coeff * u leaves p as it was.
__global__ void __launch_bounds__(kThreads)
lamb_kernel(const bool* ok, const float* x, float* m, const float* v, const float* dscale, float* vf,
            const float* const* p, float* u, int64_t L, const int64_t* offsets, const int64_t* chunk_start,
            int64_t nchunks, const float* scaling, const float* beta1, const float* ob1, const float* beta2,
            const float* ob2, const float* eps, const float* wd, bool precond, double* partial) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {  // block-uniform: block_stats3 inside
    const int64_t k = chunk_owner(chunk_start, L, c);
    const int64_t end = offsets[k + 1];
    const int64_t lo = offsets[k] + (c - chunk_start[k]) * kUpdChunk;
    const int64_t hi = lo + kUpdChunk < end ? lo + kUpdChunk : end;
    if (ok != nullptr && !*ok) {  // block-uniform: no block_stats3 in this chunk
      for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) u[i] = 0.0f;
      continue;
    }
    const float sc = scaling[k], b1 = beta1[k], o1 = ob1[k], b2 = beta2[k], o2 = ob2[k], ep = eps[k], w = wd[k];
    const float ds = dscale ? dscale[k] : 1.0f;
    const float* const pk = p ? p[k] : nullptr;  // (k: the layer; the unrolled loops below shadow it)
    const int64_t first = offsets[k];
    float rmax = 0.0f;
    double up2 = 0.0, u2 = 0.0;
    // kUnroll values per thread, all loads first (as in adam_kernel); each thread still
    // visits its values in increasing i, so its sums fold in the same order as one at a time
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kThreads * kUnroll) {
      float xr[kUnroll], mr[kUnroll], dr[kUnroll], vr[kUnroll], pr[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        xr[k] = x[i];
        mr[k] = m[i];
        dr[k] = v[i];  // (the frozen variance: its denominator is computed below)
        vr[k] = vf[i];
        pr[k] = pk ? pk[i - first] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + k * kThreads;
        if (i >= hi) continue;
        const float di = denom_value(dr[k], ep, ds);
        const float mn = __fdiv_rn(precond ? __fmul_rn(xr[k], di) : xr[k], sc);
        const float gi = __fdiv_rn(__fsub_rn(mn, __fmul_rn(b1, mr[k])), o1);
        const float vi = __fadd_rn(__fmul_rn(vr[k], b2), __fmul_rn(o2, __fmul_rn(gi, gi)));
        const float up = __fdiv_rn(mn, di);
        const float uu = pk ? __fadd_rn(up, __fmul_rn(w, pr[k])) : up;
        const float ratio = __fdiv_rn(di, __fadd_rn(__fsqrt_rn(vi), ep));
        rmax = rmax < ratio ? ratio : rmax;  // std::max(rmax, ratio)
        // float * float is exact in double: the squares are the CPU's, only their order differs
        up2 = __dadd_rn(up2, __dmul_rn(double(up), double(up)));
        u2 = __dadd_rn(u2, __dmul_rn(double(uu), double(uu)));
        m[i] = mn;
        vf[i] = vi;
        u[i] = uu;
      }
    }
    double r = rmax;  // exact
    block_stats3(r, up2, u2);
    if (threadIdx.x == 0) {
      partial[3 * c] = r;
      partial[3 * c + 1] = up2;
      partial[3 * c + 2] = u2;
    }
  }
}

// stats[3k .. 3k + 2] <- layer k's max ratio, sum up^2, sum u^2 from its chunks' partials
// (1, 0, 0 for an empty layer, as on the CPU). One block per layer (grid-stride over layers);
// thread t folds chunks t, t + kThreads, ... in order, then block_stats3: a fixed order that does
// not depend on the grid. ok false (see lamb_kernel): 1, 0, 0 for every layer.
__global__ void __launch_bounds__(kThreads)
lamb_finalize(const bool* ok, const int64_t* chunk_start, int64_t L, const double* partial, double* stats) {
  const bool skip = ok != nullptr && !*ok;
  for (int64_t k = blockIdx.x; k < L; k += gridDim.x) {  // block-uniform
    if (skip) {
      if (threadIdx.x == 0) {
        stats[3 * k] = 1.0;
        stats[3 * k + 1] = 0.0;
        stats[3 * k + 2] = 0.0;
      }
      continue;
    }
    const int64_t c0 = chunk_start[k], c1 = chunk_start[k + 1];
    double r = 0.0, a = 0.0, b = 0.0;
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) {
      r = max_as_cpu(r, partial[3 * c]);
      a = __dadd_rn(a, partial[3 * c + 1]);
      b = __dadd_rn(b, partial[3 * c + 2]);
    }
    block_stats3(r, a, b);
    if (threadIdx.x == 0) {
      stats[3 * k] = c0 == c1 ? 1.0 : r;
      stats[3 * k + 1] = a;
      stats[3 * k + 2] = b;
    }
  }
}

}  // namespace

int64_t cuda_workspace_bytes() { return kMaxBlocks * static_cast<int64_t>(sizeof(double)); }

namespace {

// worker_compress_cuda of `x` (an Input of worker_pass1): the worker pass, then the scale.
template <class Input>
void compress_input(const char* what, int device, const Input& x, int64_t nx, const float* e, float* e_out,
                    int64_t n, uint8_t* bits, int64_t W, int64_t row_stride, const uint8_t* prev_bits,
                    const float* prev_scale, bool pending, float* scale_out, void* workspace, void* stream) {
  detail::check_compress(what, nx, n, W);
  DeviceGuard guard(device);
  const int64_t m = n / W, spr = (m + kSeg - 1) / kSeg, nseg = spr * W;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  double* partial = static_cast<double*>(workspace);
  const int grid = grid_for(nseg, kWarps);
  const bool evec = aligned(e, 16) && (e_out == nullptr || aligned(e_out, 16));
  // prev_scale may be scale_out: finalize_scale overwrites it only after worker_pass1 has run.
  launch("worker_pass1", worker_pass1<Input>, grid, kThreads, st, x, nx, e, e_out, m, nseg, spr,
         pending ? prev_bits : nullptr, bits, row_stride, evec, rows_aligned4(bits, W, row_stride),
         pending && rows_aligned4(prev_bits, W, row_stride), pending ? prev_scale : nullptr, partial);
  launch("finalize_scale", finalize_scale, 1, kThreads, st, partial, grid, n, scale_out);
}

}  // namespace

void worker_compress_cuda(int device, const float* x, int64_t nx, const float* e, float* e_out, int64_t n,
                          uint8_t* bits, int64_t W, int64_t row_stride, const uint8_t* prev_bits,
                          const float* prev_scale, bool pending, float* scale_out, void* workspace, void* stream) {
  compress_input("worker_compress_cuda", device, BufferInput{x, aligned(x, 16)}, nx, e, e_out, n, bits, W,
                 row_stride, prev_bits, prev_scale, pending, scale_out, workspace, stream);
}

void momentum_compress_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps,
                            const float* dscale, int64_t P,
                            const int64_t* starts, const int64_t* sizes, const float* b, const float* a, int64_t base,
                            int64_t nx, const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W,
                            int64_t row_stride, const uint8_t* prev_bits, const float* prev_scale, bool pending,
                            float* scale_out, void* workspace, void* stream) {
  detail::check_tiling("momentum_compress_cuda", P, base, nx);
  const MomentumInput x{{starts, sizes, P, base}, m, g, v, eps, dscale, b, a};
  compress_input("momentum_compress_cuda", device, x, nx, e, e_out, n, bits, W, row_stride, prev_bits, prev_scale,
                 pending, scale_out, workspace, stream);
}

void local_compress_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps,
                         const float* dscale, const float* const* p,
                         const float* acc, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b,
                         const float* a, const float* nw, const float* nlr, bool precond, int64_t base, int64_t nx,
                         const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride,
                         const uint8_t* prev_bits, const float* prev_scale, bool pending, float* scale_out,
                         void* workspace, void* stream) {
  detail::check_tiling("local_compress_cuda", P, base, nx);
  const LocalInput x{{starts, sizes, P, base}, m, g, v, eps, dscale, p, acc, b, a, nw, nlr, precond};
  compress_input("local_compress_cuda", device, x, nx, e, e_out, n, bits, W, row_stride, prev_bits, prev_scale,
                 pending, scale_out, workspace, stream);
}

void worker_update_error_cuda(int device, const float* x, int64_t nx, const float* e, float* e_out, int64_t n,
                              const float* scale, void* stream) {
  detail::check_update("worker_update_error_cuda", nx, n);
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("worker_update", worker_update, grid_for(n / 4, kThreads), kThreads, static_cast<cudaStream_t>(stream),
         x, nx, e, e_out, n, scale, aligned(x, 16), aligned(e, 16) && aligned(e_out, 16));
}

void server_reduce_cuda(int device, const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales,
                        int64_t scale_stride, const float* e, float* e_out, int64_t m, const uint8_t* prev_bits,
                        const float* prev_scale, uint8_t* out_bits, float* scale_out, bool pending, void* workspace,
                        void* stream) {
  detail::check_reduce("server_reduce_cuda", W, m);
  DeviceGuard guard(device);
  const int64_t nseg = (m + kSeg - 1) / kSeg;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  double* partial = static_cast<double*>(workspace);
  const int grid = grid_for(nseg, kWarps * kServerUnroll);
  const bool evec = aligned(e, 16) && aligned(e_out, 16);
  // prev_scale may be scale_out: finalize_scale overwrites it only after server_pass1 has run.
  launch("server_pass1", server_pass1, grid, kThreads, st, bits, W, row_stride, scales, scale_stride, e, e_out, m,
         nseg, prev_bits, out_bits, evec, rows_aligned4(bits, W, row_stride),
         aligned(out_bits, 4) && aligned(prev_bits, 4), pending ? prev_scale : nullptr, partial);
  launch("finalize_scale", finalize_scale, 1, kThreads, st, partial, grid, m, scale_out);
}

void decompress_cuda(int device, const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales,
                     int64_t scale_stride, int64_t m, float* out, int64_t nout, void* stream) {
  detail::check_decompress("decompress_cuda", W, m, nout);
  if (nout == 0) return;
  DeviceGuard guard(device);
  const int64_t spr = (m + kSeg - 1) / kSeg;
  // Only rows holding output: rows past the last kept value are all padding.
  const int64_t rows = (nout + m - 1) / m, nseg = spr * rows;
  launch("decompress_kernel", decompress_kernel, grid_for(nseg, kWarps * kUnroll), kThreads, static_cast<cudaStream_t>(stream),
         bits, row_stride, scales, scale_stride, m, nseg, spr, out, nout, aligned(out, 16),
         rows_aligned4(bits, rows, row_stride));
}

int64_t cuda_update_chunk() { return kUpdChunk; }

void adam_update_cuda(int device, const bool* ok, const float* const* g, float* m, float* v, float* const* params, int64_t P,
                      const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks,
                      const float* lr, const float* beta1, const float* ob1, const float* beta2, const float* ob2,
                      const float* eps, const float* wd, bool update_v, void* stream) {
  detail::check_adam("adam_update_cuda", P);
  detail::check_chunks("adam_update_cuda", P, nchunks);
  if (nchunks == 0) return;  // no values (P == 0 or every parameter empty)
  DeviceGuard guard(device);
  launch("adam_kernel", adam_kernel, grid_for(nchunks, 1), kThreads, static_cast<cudaStream_t>(stream), ok, g, m, v,
         params, P, starts, sizes, chunk_start, nchunks, lr, beta1, ob1, beta2, ob2, eps, wd, update_v);
}

void lamb_frozen_update_cuda(int device, const bool* ok, const float* x, float* m, const float* v,
                             const float* dscale, float* vf, const float* const* p, float* u, int64_t L,
                             const int64_t* offsets, const int64_t* chunk_start, int64_t nchunks, const float* scaling,
                             const float* beta1, const float* ob1, const float* beta2, const float* ob2,
                             const float* eps, const float* wd, bool precond, double* stats, void* workspace,
                             void* stream) {
  detail::check_lamb("lamb_frozen_update_cuda", L);
  detail::check_chunks("lamb_frozen_update_cuda", L, nchunks);
  if (L == 0) return;  // no layers, no stats
  DeviceGuard guard(device);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  double* partial = static_cast<double*>(workspace);
  if (nchunks > 0)  // (otherwise every layer is empty: stats 1, 0, 0)
    launch("lamb_kernel", lamb_kernel, grid_for(nchunks, 1), kThreads, st, ok, x, m, v, dscale, vf, p, u, L, offsets,
           chunk_start, nchunks, scaling, beta1, ob1, beta2, ob2, eps, wd, precond, partial);
  launch("lamb_finalize", lamb_finalize, grid_for(L, 1), kThreads, st, ok, chunk_start, L, partial, stats);
}

void frozen_adam_update_cuda(int device, const bool* ok, const float* x, float* m, const float* v,
                             const float* eps, const float* dscale, float* const* params, int64_t P, const int64_t* starts, const int64_t* sizes,
                             const int64_t* chunk_start, int64_t nchunks, const float* nlr, const float* nlw,
                             bool precond, void* stream) {
  detail::check_adam("frozen_adam_update_cuda", P);
  detail::check_chunks("frozen_adam_update_cuda", P, nchunks);
  if (nchunks == 0) return;  // no values
  DeviceGuard guard(device);
  launch("frozen_adam_kernel", frozen_adam_kernel, grid_for(nchunks, 1), kThreads, static_cast<cudaStream_t>(stream),
         ok, x, m, v, eps, dscale, params, P, starts, sizes, chunk_start, nchunks, nlr, nlw, precond);
}

void momentum_source_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps,
                          const float* dscale, float* u, int64_t P,
                          const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks,
                          const float* b, const float* a, void* stream) {
  detail::check_segments("momentum_source_cuda", P);
  detail::check_chunks("momentum_source_cuda", P, nchunks);
  if (nchunks == 0) return;  // no values
  DeviceGuard guard(device);
  launch("momentum_source_kernel", momentum_source_kernel, grid_for(nchunks, 1), kThreads,
         static_cast<cudaStream_t>(stream), m, g, v, eps, dscale, u, P, starts, sizes, chunk_start, nchunks, b, a);
}

void local_source_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps,
                       const float* dscale, const float* const* p,
                       const float* acc, float* u, int64_t P, const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start,
                       int64_t nchunks, const float* b, const float* a, const float* nw, const float* nlr, bool precond,
                       void* stream) {
  detail::check_segments("local_source_cuda", P);
  detail::check_chunks("local_source_cuda", P, nchunks);
  if (nchunks == 0) return;  // no values
  DeviceGuard guard(device);
  launch("local_source_kernel", local_source_kernel, grid_for(nchunks, 1), kThreads, static_cast<cudaStream_t>(stream),
         m, g, v, eps, dscale, p, acc, u, P, starts, sizes, chunk_start, nchunks, b, a, nw, nlr, precond);
}

void layer_step_cuda(int device, const float* u, float* const* params, int64_t P, const int64_t* starts,
                     const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks, const float* alpha,
                     void* stream) {
  detail::check_segments("layer_step_cuda", P);
  detail::check_chunks("layer_step_cuda", P, nchunks);
  if (nchunks == 0) return;  // no values
  DeviceGuard guard(device);
  launch("layer_step_kernel", layer_step_kernel, grid_for(nchunks, 1), kThreads, static_cast<cudaStream_t>(stream),
         u, params, P, starts, sizes, chunk_start, nchunks, alpha);
}

void sync_update_cuda(int device, const float* x, const float* v, const float* eps, const float* dscale,
                      const uint8_t* floored, float* m, float* synced,
                      float* const* params, float* acc, int64_t P, const int64_t* starts, const int64_t* sizes,
                      const int64_t* chunk_start, int64_t nchunks, const float* inv, bool precond, void* stream) {
  detail::check_segments("sync_update_cuda", P);
  detail::check_chunks("sync_update_cuda", P, nchunks);
  if (nchunks == 0) return;  // no values
  DeviceGuard guard(device);
  launch("sync_update_kernel", sync_update_kernel, grid_for(nchunks, 1), kThreads, static_cast<cudaStream_t>(stream),
         x, v, eps, dscale, floored, m, synced, params, acc, P, starts, sizes, chunk_start, nchunks, inv, precond);
}

void restore_unless_cuda(int device, const bool* ok, void* dst, const void* src, int64_t nbytes, void* stream) {
  detail::require(nbytes >= 0, "restore_unless_cuda", "nbytes >= 0");
  if (nbytes == 0) return;
  DeviceGuard guard(device);
  launch("restore_kernel", restore_kernel, grid_for(nbytes, int64_t(kThreads) * 64), kThreads,
         static_cast<cudaStream_t>(stream), ok, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), nbytes);
}

// ---------------------------------------------------------------------------------------------
// The integer codec (onebit_quant.cpp's operations, the same bits): one warp per block of the
// codec. Lane t takes the value pairs t, t + 32, ... of its block (pair p: values 2p and 2p + 1,
// one byte of 4-bit codes, two of 8-bit ones; blocks are even). The encoders sweep their block
// twice, finding max|y| and then coding, and compute y again in the second sweep rather than
// keep it (a block may hold 4096 values): the same operations, so the same floats. Each value
// is read and then written by the same lane, so the error may be written in place.

namespace {

__device__ __forceinline__ float codec_qmax(int bits) { return bits == 4 ? 7.0f : 127.0f; }

// max as the CPU loop takes it: a NaN, once seen, is the result.
__device__ __forceinline__ float nan_max(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

__device__ __forceinline__ float warp_nan_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ float load_scale(const uint8_t* p) {
  float s;
  memcpy(&s, p, sizeof(float));  // (a row's scales are 4-byte aligned only if its stride is)
  return s;
}

__device__ __forceinline__ float code_value(const uint8_t* codes, int64_t i, int bits) {
  if (bits == 8) return float(static_cast<int8_t>(codes[i]));
  const unsigned b = codes[i / 2];
  return float(int(i % 2 ? b >> 4 : b & 15u) - 8);
}

// q of y in a block of scale s (coded: s > 0 and finite; else 0), and y's error y - s * q.
__device__ __forceinline__ float code_of(float y, float s, bool coded, float Q, float* err) {
  const float q = coded ? fminf(fmaxf(rintf(__fdiv_rn(y, s)), -Q), Q) : 0.0f;
  *err = __fsub_rn(y, __fmul_rn(s, q));
  return q;
}

// The pair's codes at codes + (bytes of the values before the pair).
__device__ __forceinline__ void store_pair(uint8_t* codes, int64_t p, int bits, float q0, float q1) {
  if (bits == 8) {
    codes[2 * p] = static_cast<uint8_t>(static_cast<int8_t>(int(q0)));
    codes[2 * p + 1] = static_cast<uint8_t>(static_cast<int8_t>(int(q1)));
  } else {
    codes[p] = static_cast<uint8_t>((int(q0) + 8) | ((int(q1) + 8) << 4));
  }
}

// Encodes one block (`block` values, value i being y(i)) as the warp that owns it: the scale at
// scale_at, the codes at `codes`, the error of value i at eo[i] (eo null: none).
template <class Values>
__device__ void encode_block_warp(const Values& y, int64_t block, int bits, uint8_t* codes, float* eo,
                                  uint8_t* scale_at, int lane) {
  const float Q = codec_qmax(bits);
  float mx = 0.0f;
  for (int64_t i = lane; i < block; i += 32) mx = nan_max(mx, fabsf(y(i)));
  const float s = __fdiv_rn(warp_nan_max(mx), Q);
  const bool coded = s > 0.0f && isfinite(s);
  for (int64_t p = lane; p < block / 2; p += 32) {
    float r0, r1;
    const float q0 = code_of(y(2 * p), s, coded, Q, &r0), q1 = code_of(y(2 * p + 1), s, coded, Q, &r1);
    store_pair(codes, p, bits, q0, q1);
    if (eo) {
      eo[2 * p] = r0;
      eo[2 * p + 1] = r1;
    }
  }
  if (lane == 0) memcpy(scale_at, &s, sizeof(float));
}

// quantize's values: y = x (zeros past nx) + e (null: none), from value `lo` of the buffer.
struct QuantInput {
  const float* x;
  int64_t nx;
  const float* e;
  int64_t lo;
  __device__ float operator()(int64_t i) const {
    const float xi = lo + i < nx ? x[lo + i] : 0.0f;
    return e ? __fadd_rn(xi, e[lo + i]) : xi;
  }
};

// quantized_reduce's values: c = the W rows' (s_r / W) * q_r summed in row order, + e (null:
// none), for block k of the rows (values lo = k * block on).
struct ReducedInput {
  const uint8_t* rows;
  int64_t W, row_stride, nb, k, lo;
  int bits;
  float fw;
  const float* e;
  __device__ float operator()(int64_t i) const {
    float c = 0.0f;
    for (int64_t r = 0; r < W; ++r) {
      const uint8_t* row = rows + r * row_stride;
      const float w = __fdiv_rn(load_scale(row + 4 * k), fw);
      c = __fadd_rn(c, __fmul_rn(w, code_value(row + 4 * nb, lo + i, bits)));
    }
    return e ? __fadd_rn(c, e[lo + i]) : c;
  }
};

__global__ void __launch_bounds__(kThreads)
quantize_kernel(const float* x, int64_t nx, const float* e, float* e_out, int64_t m, int bits, int64_t block,
                uint8_t* rows, int64_t row_stride, int64_t nblocks) {
  const int64_t warps = int64_t(gridDim.x) * kWarps, nb = m / block;
  for (int64_t b = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; b < nblocks; b += warps) {
    const int64_t lo = b * block, j = lo / m, k = (lo % m) / block;
    uint8_t* row = rows + j * row_stride;
    encode_block_warp(QuantInput{x, nx, e, lo}, block, bits, row + 4 * nb + k * block * bits / 8,
                      e_out ? e_out + lo : nullptr, row + 4 * k, threadIdx.x % 32);
  }
}

__global__ void __launch_bounds__(kThreads)
quantized_reduce_kernel(const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits, int64_t block,
                        const float* e, float* e_out, uint8_t* out_row) {
  const int64_t warps = int64_t(gridDim.x) * kWarps, nb = m / block;
  for (int64_t k = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; k < nb; k += warps) {
    const int64_t lo = k * block;
    const ReducedInput c{rows, W, row_stride, nb, k, lo, bits, float(W), e};
    encode_block_warp(c, block, bits, out_row + 4 * nb + lo * bits / 8, e_out ? e_out + lo : nullptr,
                      out_row + 4 * k, threadIdx.x % 32);
  }
}

__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t* rows, int64_t row_stride, int64_t m, int bits, int64_t block, float* out,
                  int64_t nout) {
  const int64_t nb = m / block, stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nout; i += stride) {
    const int64_t j = i / m, t = i % m;
    const uint8_t* row = rows + j * row_stride;
    out[i] = __fmul_rn(load_scale(row + 4 * (t / block)), code_value(row + 4 * nb, t, bits));
  }
}

}  // namespace

void quantize_cuda(int device, const float* x, int64_t nx, const float* e, float* e_out, int64_t n, int bits,
                   int64_t block, uint8_t* rows, int64_t W, int64_t row_stride, void* stream) {
  detail::check_quant("quantize_cuda", n, W, bits, block, row_stride);
  detail::require(nx >= 0 && nx <= n, "quantize_cuda", "0 <= nx <= n");
  DeviceGuard guard(device);
  const int64_t nblocks = n / block;
  launch("quantize_kernel", quantize_kernel, grid_for(nblocks, kWarps), kThreads, static_cast<cudaStream_t>(stream),
         x, nx, e, e_out, n / W, bits, block, rows, row_stride, nblocks);
}

void quantized_reduce_cuda(int device, const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits,
                           int64_t block, const float* e, float* e_out, uint8_t* out_row, void* stream) {
  detail::check_quant("quantized_reduce_cuda", m, 1, bits, block, row_stride);
  detail::require(W > 0, "quantized_reduce_cuda", "W > 0");
  DeviceGuard guard(device);
  launch("quantized_reduce_kernel", quantized_reduce_kernel, grid_for(m / block, kWarps), kThreads,
         static_cast<cudaStream_t>(stream), rows, W, row_stride, m, bits, block, e, e_out, out_row);
}

void dequantize_cuda(int device, const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits,
                     int64_t block, float* out, int64_t nout, void* stream) {
  detail::check_quant("dequantize_cuda", m, 1, bits, block, row_stride);
  detail::require(W > 0 && nout >= 0 && nout <= W * m, "dequantize_cuda", "W > 0 and 0 <= nout <= W*m");
  if (nout == 0) return;
  DeviceGuard guard(device);
  launch("dequantize_kernel", dequantize_kernel, grid_for(nout, kThreads), kThreads, static_cast<cudaStream_t>(stream),
         rows, row_stride, m, bits, block, out, nout);
}

}  // namespace onebit
