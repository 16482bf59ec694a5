// lightning-onebit kernels: fused 1-bit compression with error feedback.
//
// Wire format (identical on CPU and CUDA, so ranks on different hardware interoperate):
//   A chunk of m values (m a multiple of 8) packs into m/8 bytes. Value k of the chunk is bit
//   (k % 8) of byte k / 8, least-significant bit first (numpy.packbits(..., bitorder="little")).
//   The bit is 1 iff value >= 0, so +0.0 and -0.0 both encode +1 (sign(0) = +1) and NaN encodes -1.
//   A packed value b with scale s decodes to (b ? +s : -s).
//   W chunks live in one buffer as rows: chunk j starts at bits + j * row_stride (bytes).
//
// Scales are float32. Norms accumulate in double over fixed 8192-element blocks and the block
// sums are added in order, so results do not depend on the number of threads.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace onebit {

// Argument checks shared by the CPU and CUDA entry points (lightning_onebit/kernels/checks.py
// checks the same first, with friendlier messages): a wrong size is an exception, never an
// out-of-bounds access.
namespace detail {
inline void require(bool ok, const char* what, const char* need) {
  if (!ok) throw std::invalid_argument(std::string("onebit: ") + what + ": need " + need);
}
inline void check_compress(const char* what, int64_t nx, int64_t n, int64_t W) {
  require(W > 0 && n > 0 && n % (8 * W) == 0 && nx >= 0 && nx <= n, what,
          "W > 0, n > 0, n % (8*W) == 0 and 0 <= nx <= n");
}
inline void check_update(const char* what, int64_t nx, int64_t n) {
  require(n >= 0 && n % 8 == 0 && nx >= 0 && nx <= n, what, "n % 8 == 0 and 0 <= nx <= n");
}
inline void check_reduce(const char* what, int64_t W, int64_t m) {
  require(W > 0 && m > 0 && m % 8 == 0, what, "W > 0 and a chunk size m > 0 that is a multiple of 8");
}
inline void check_decompress(const char* what, int64_t W, int64_t m, int64_t nout) {
  require(W > 0 && m >= 0 && m % 8 == 0 && nout >= 0 && nout <= W * m, what,
          "W > 0, m % 8 == 0 and 0 <= nout <= W*m");
}
inline void check_adam(const char* what, int64_t P) { require(P >= 0, what, "P >= 0"); }
inline void check_lamb(const char* what, int64_t L) { require(L >= 0, what, "L >= 0"); }
inline void check_segments(const char* what, int64_t P) { require(P >= 0, what, "P >= 0"); }
// What an entry point can check of segments tiling [base, base + nx) whose starts and sizes lie
// in device memory (the caller checks the tiling itself).
inline void check_tiling(const char* what, int64_t P, int64_t base, int64_t nx) {
  require(P >= 0 && base >= 0 && nx >= 0 && (P > 0 || nx == 0), what,
          "P >= 0, base >= 0, nx >= 0, and P > 0 unless nx == 0");
}
// The CUDA updates' chunk table (see adam_update_cuda): `count` parameters or layers, nchunks chunks.
inline void check_chunks(const char* what, int64_t count, int64_t nchunks) {
  require(nchunks >= 0 && (count > 0 || nchunks == 0), what, "nchunks >= 0, and nchunks == 0 when P (or L) is 0");
}
// The integer codec (onebit_quant.cpp): n values over W rows of m = n / W values, whole blocks of an
// even size up to kMaxQuantBlock, 4 or 8 bits, each row [m / block float32 scales][codes].
constexpr int64_t kMaxQuantBlock = 4096;
inline void check_quant(const char* what, int64_t n, int64_t W, int bits, int64_t block, int64_t row_stride) {
  require((bits == 4 || bits == 8) && block > 0 && block % 2 == 0 && block <= kMaxQuantBlock, what,
          "bits 4 or 8 and an even block of at most 4096 values");
  require(W > 0 && n > 0 && n % (W * block) == 0, what, "W > 0 and n > 0 a multiple of W * block");
  const int64_t m = n / W;
  require(row_stride >= 4 * (m / block) + m * bits / 8, what, "rows of at least 4 * m / block + m * bits / 8 bytes");
}
}  // namespace detail

// An exchange's result read where it lies, in place of the decoded buffer x (see decompress_cpu):
// run k holds the flat values [lo[k], hi[k]), value i being +scale[k] if bit i - lo[k] of bits[k]
// is set (the wire format's numbering) and -scale[k] if not. Runs are sorted and contiguous
// (hi[k] == lo[k + 1], each non-empty), and cover every value a call reads.
struct SignRuns {
  int64_t n;
  const int64_t* lo;
  const int64_t* hi;
  const uint8_t* const* bits;
  const float* scale;
};

// The frozen variance's denominator d = sqrt(v) + eps, which the optimizer kernels below compute
// from the flat variance v as they read it (no buffer of d is held): for value i of segment
// (parameter, layer) j, d = fl(fl(fl(sqrt(v[i])) * dscale[j]) + eps[j]), each operation rounded on
// its own (no fused multiply-add). dscale null: no scale (the floats of dscale[j] = 1, as x * 1 is
// x). eps and dscale are per-segment arrays (device memory for the CUDA entries); 1-bit LAMB's
// kernels take eps from their per-layer eps. "d" below is that value.

// Worker compression: y = x + e_true (x zero-extended from nx to n values); scale = ||y||_2 /
// sqrt(n); bits of row j = packed signs of y[j*m, (j+1)*m) with m = n / W. n must be a multiple of
// 8 * W. Writes the scale to *scale_out and returns it.
// The error update y - scale * sign(y) needs the scale, i.e. a second sweep once every value has
// been read, so it is either deferred or done by a second call:
// - e_out not null: e_out <- y, and the true error is e_out - scale * sign(bits), which the next
//   call applies as it reads the buffer (pending = true, prev_bits and prev_scale that call's bits
//   and scale; rows of prev_bits start at prev_bits + j * row_stride). e_true = e - prev_scale *
//   sign(prev_bits) with pending, e without. e_out may be e and prev_bits may be bits (in place),
//   or not (the exchange's double buffering: nothing it holds changes until the step goes ahead).
// - e_out null: e is not written (e_true = e; no pending), and worker_update_error_cpu applies the
//   update later, recomputing y, once the caller knows the step goes ahead (every rank's scale is
//   finite): in place, without a second buffer.
float worker_compress_cpu(const float* x, int64_t nx, const float* e, float* e_out, int64_t n, uint8_t* bits,
                          int64_t W, int64_t row_stride, const uint8_t* prev_bits, float prev_scale, bool pending,
                          float* scale_out, int nthreads);
// worker_compress_cpu of the values momentum_source_cpu would write to u[base, base + nx) (its
// segments tiling that range in order), computed block by block as the compression reads them
// instead of read from a buffer: the same floats, bits and scale, without u's write and read.
float momentum_compress_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, int64_t P, const int64_t* starts,
                            const int64_t* sizes, const float* b, const float* a, int64_t base, int64_t nx,
                            const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride,
                            const uint8_t* prev_bits, float prev_scale, bool pending, float* scale_out, int nthreads);
// e_out <- y - scale * sign(y), y = x + e recomputed bit for bit (x and e unchanged since a
// worker_compress_cpu call with a null e_out). e_out may be e (in place) or another buffer.
void worker_update_error_cpu(const float* x, int64_t nx, const float* e, float* e_out, int64_t n,
                             float scale, int nthreads);
// worker_update_error_cpu of the values momentum_source_cpu (local_update_error_cpu:
// local_source_cpu) would write to u[base, base + nx), recomputed as read (the same floats as the
// momentum_compress_cpu / local_compress_cpu call with a null e_out and the same n and W that they
// follow): the error update of a compression that kept one error buffer, once the call is known
// to go ahead, without a buffer of the values. Returns the scale of the values it read, computed
// as that compression computed it: the same float if and only if (but for an astronomically
// unlikely coincidence) the source's inputs did not change in between.
float momentum_update_error_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, int64_t P,
                                const int64_t* starts, const int64_t* sizes, const float* b, const float* a,
                                int64_t base, int64_t nx, const float* e, float* e_out, int64_t n, int64_t W,
                                float scale, int nthreads);
float local_update_error_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, const float* const* p,
                             const float* acc, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b,
                             const float* a, const float* nw, const float* nlr, bool precond, int64_t base,
                             int64_t nx, const float* e, float* e_out, int64_t n, int64_t W, float scale,
                             int nthreads);
// c = sum_i sign_i * (scale_i / W), summed over i = 0..W-1 in order, then + e_true;
// scale = ||c||_2 / sqrt(m); out_bits = packed signs of c; e_out <- c.
// The error update c - scale * sign(c) is deferred, which saves a second sweep over e: after the
// call e_out holds c, and the true error is e_out - scale * sign(out_bits). With pending=true
// the call starts by applying the previous call's deferred update from its outputs prev_bits and
// prev_scale (e_true = e - prev_scale * sign(prev_bits)); with pending=false e_true = e.
// e_out may be e and prev_bits may be out_bits (in place), or not (double buffering); e_out
// null: c is not stored (the caller runs the same call again with e_out to store it).
// Input row i starts at bits + i * row_stride; its scale is scales[i * scale_stride].
float server_reduce_cpu(const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales,
                        int64_t scale_stride, const float* e, float* e_out, int64_t m,
                        const uint8_t* prev_bits, float prev_scale, uint8_t* out_bits,
                        float* scale_out, bool pending, int nthreads);

// out[j*m + k] = scales[j * scale_stride] * sign(bit k of row j), for the first nout values
// (nout <= W * m: the padding at the end is dropped).
// The integer codec of a compressed average (see onebit_quant.cpp and detail::check_quant).
// quantize: y = x (zeros past nx) + e (e null: none), chunk j of m values into row j; e_out <- the
// error y - s * q (null: not written; may be e). quantized_reduce: c = sum over the W rows in order
// of (s_r / W) * q_r, + e (null: none), encoded into out_row, e_out <- c - s * q (null: not
// written; may be e). dequantize: out[j * m + i] = s * q of row j (the first nout values).
void quantize_cpu(const float* x, int64_t nx, const float* e, float* e_out, int64_t n, int bits, int64_t block,
                  uint8_t* rows, int64_t W, int64_t row_stride, int nthreads);
void quantized_reduce_cpu(const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits, int64_t block,
                          const float* e, float* e_out, uint8_t* out_row, int nthreads);
void dequantize_cpu(const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits, int64_t block,
                    float* out, int64_t nout, int nthreads);

void decompress_cpu(const uint8_t* bits, int64_t W, int64_t row_stride, const float* scales,
                    int64_t scale_stride, int64_t m, float* out, int64_t nout, int nthreads);

// 1-bit LAMB's compression-phase update after the exchange, one sweep for L layers of flat buffers.
// Layer k holds values [offsets[k], offsets[k+1]); per value, with the layer's hyperparameters
// (ob1 = 1 - beta1, ob2 = 1 - beta2, rounded to float from double by the caller):
//   mn = x / scaling;  g = (mn - beta1 * m) / ob1;  vf <- beta2 * vf + ob2 * g * g;
//   up = mn / d;  u <- up + wd * p;  m <- mn
// (x: the exchanged, scaled momentum, or with precond that divided by d, scaled back first as x * d
// rounded; d = sqrt(v) + eps of the frozen variance; p[k]: layer k's parameter, its own storage
// from 0, fp32, contiguous; p or p[k] null: no decay term, as when wd is 0). stats[3k..3k+2] <- max(d / (sqrt(vf) + eps)), sum(up^2), sum(u^2) over the layer
// (1, 0, 0 for an empty layer); the sums accumulate in double over fixed blocks, added in order.
// xs not null: x is read from those runs (and x is not read), the same floats as from decompress_cpu's x.
void lamb_frozen_update_cpu(const float* x, float* m, const float* v, const float* dscale, float* vf, const float* const* p, float* u,
                            int64_t L, const int64_t* offsets, const float* scaling, const float* beta1,
                            const float* ob1, const float* beta2, const float* ob2, const float* eps, const float* wd,
                            bool precond, double* stats, int nthreads, const SignRuns* xs = nullptr);

// Adam's step without bias correction (1-bit Adam's warmup, 0/1 Adam's variance phase), one sweep.
// Parameter j holds the flat values [starts[j], starts[j] + sizes[j]) of m and v, its own storage
// params[j] (fp32, contiguous) and its gradient g[j][0, sizes[j]), storage of its own (the
// parameter's gradient where autograd left it, or a piece of a flat buffer), or zeros where g[j]
// is null (read as +0.0: the floats a buffer of zeros gives); per value, with j's hyperparameters
// (ob1 = 1 - beta1, ob2 = 1 - beta2, rounded to float from double by the caller):
//   m <- beta1 * m + ob1 * g;  v <- beta2 * v + ob2 * g * g  (only if update_v);
//   p <- p - lr * (m / (sqrt(v) + eps) + wd * p)
void adam_update_cpu(const float* const* g, float* m, float* v, float* const* params, int64_t P, const int64_t* starts,
                     const int64_t* sizes, const float* lr, const float* beta1, const float* ob1, const float* beta2,
                     const float* ob2, const float* eps, const float* wd, bool update_v, int nthreads);

// The momentum the compressed exchange sends, one sweep: segment j holds the flat values
// [starts[j], starts[j] + sizes[j]) of m, d and u; its gradient is g[j][0, sizes[j]), storage of
// its own (a parameter's gradient where autograd left it, or a piece of a flat buffer), or zeros
// where g[j] is null (read as +0.0: the floats a buffer of zeros gives). Per value, with j's
// coefficients b[j] and a[j] (floats):
//   u <- fma(g, a, m * b);  u <- u / d  (only where d is not null)
// The roundings of torch's `torch.mul(m, b, out=u).add_(g, alpha=a)` and `u.div_(d)` on x86 CPUs
// (torch's CPU add with alpha is a fused multiply-add, vectorised and scalar alike).
void momentum_source_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, float* u, int64_t P,
                         const int64_t* starts, const int64_t* sizes, const float* b, const float* a, int nthreads);

// 1-bit Adam's compression-phase step after the exchange, one sweep (frozen_adam_update_cuda's
// arithmetic, without a verdict): per value of parameter j (storage params[j], fp32, contiguous),
//   p <- fma(p, nlw[j], p)  (unless nlw[j] is +0.0);
//   precond: m <- x * d;  p <- fma(x, nlr[j], p)
//   else:    m <- x (nothing when m is x);  p <- p + (nlr[j] * x) / d
// The roundings of the optimizer's torch ops (add_ with alpha, addcdiv_) on x86 CPUs. xs not null:
// x is read from those runs (as lamb_frozen_update_cpu's).
void frozen_adam_update_cpu(const float* x, float* m, const float* v, const float* eps, const float* dscale, float* const* params, int64_t P,
                            const int64_t* starts, const int64_t* sizes, const float* nlr, const float* nlw,
                            bool precond, int nthreads, const SignRuns* xs = nullptr);

// 0/1 Adam's exchange source on a sync step of its local phase, one sweep: segment j holds the
// flat values [starts[j], starts[j] + sizes[j]) and reads its gradient from g[j] (its own storage,
// as momentum_source_cpu's; null: zeros) and its parameter from p[j] (the same); m, d, acc and u
// are flat. Per value, with j's coefficients (floats):
//   x <- fma(g, a, m * b)
//   precond: x <- x / d;  x <- fma(p, -nw, x)         (the decay terms only where p and p[j] are
//   else:    x <- fma(-nw * p, d, x)                   not null and nw[j] is not +0.0)
//   x <- x * nlr
//   precond: x <- x + acc;  else: x <- fma(acc, d, x)  (only where acc is not null)
//   u <- x
// The roundings of the optimizer's torch ops (mul, add_ with alpha, div_, addcmul_, mul_) on x86
// CPUs: torch's CPU add with alpha and addcmul_ are fused multiply-adds.
void local_source_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, const float* const* p,
                      const float* acc, float* u, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b, const float* a,
                      const float* nw, const float* nlr, bool precond, int nthreads);
// 0/1 Adam's local step (no exchange) in one sweep, if every gradient value is finite (returns
// whether it was; nothing is written otherwise): per value of parameter j (flat values [starts[j],
// starts[j] + sizes[j]) of m, d and acc; gradient g[j] and storage params[j], each its own from 0,
// fp32, contiguous; g[j] null: zeros), with j's coefficients (floats):
//   m <- fma(g, a, m * b);  u = m / d;  u = fma(p, w, u)  (only where w is not 0)
//   acc <- fma(u, nlr, acc);  p <- fma(u, nlr, p)
// The roundings of the optimizer's torch ops (add_ with alpha, div, _foreach_add_) on x86 CPUs.
bool local_step_cpu(const float* const* g, float* m, const float* v, const float* eps, const float* dscale, float* acc, float* const* params, int64_t P,
                    const int64_t* starts, const int64_t* sizes, const float* b, const float* a, const float* w,
                    const float* nlr, int nthreads);
// worker_compress_cpu of the values local_source_cpu would write to u[base, base + nx) (its
// segments tiling that range in order), computed as read (as momentum_compress_cpu).
float local_compress_cpu(const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, const float* const* p, const float* acc,
                         int64_t P, const int64_t* starts, const int64_t* sizes, const float* b, const float* a,
                         const float* nw, const float* nlr, bool precond, int64_t base, int64_t nx, const float* e,
                         float* e_out, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride,
                         const uint8_t* prev_bits, float prev_scale, bool pending, float* scale_out, int nthreads);

// 0/1 Adam's update after a sync step's exchange x, one sweep: per value of parameter j (flat
// values [starts[j], starts[j] + sizes[j]); storage params[j], fp32, contiguous, or no params),
//   m <- (precond ? x * d : x) / nl[j]   (+0.0 where nl[j] is +0.0, or floored[i] is set)
//   synced <- precond ? synced + x : synced + x / d;  p <- synced;  acc <- 0 (unless null)
// The roundings of the optimizer's torch ops (mul, div by a scalar, add_, addcdiv_) on x86 CPUs.
// xs not null: x is read from those runs (as lamb_frozen_update_cpu's).
void sync_update_cpu(const float* x, const float* v, const float* eps, const float* dscale, const uint8_t* floored, float* m, float* synced,
                     float* const* params, float* acc, int64_t P, const int64_t* starts, const int64_t* sizes,
                     const float* nl, bool precond, int nthreads, const SignRuns* xs = nullptr);

// True when the CPU kernels use the AVX2 path (set ONEBIT_NO_SIMD=1 to force portable code).
bool cpu_has_simd();

#ifdef ONEBIT_WITH_CUDA
// The same three operations on device pointers of GPU `device`, enqueued on `stream` (a
// cudaStream_t of that device) and asynchronous: the scale is written to device memory at
// *scale_out. Each call makes `device` current for its launches and restores the calling
// thread's device after them: this module links its own CUDA runtime (static), whose current
// device is 0 on every thread whatever torch has set. `workspace` is device memory of at least
// cuda_workspace_bytes() bytes, owned by the caller and used by no other call in flight.
int64_t cuda_workspace_bytes();
// prev_scale: device memory (the previous call's scale_out), read only with pending.
void worker_compress_cuda(int device, const float* x, int64_t nx, const float* e, float* e_out, int64_t n,
                          uint8_t* bits, int64_t W, int64_t row_stride, const uint8_t* prev_bits,
                          const float* prev_scale, bool pending, float* scale_out, void* workspace,
                          void* stream);
// worker_compress_cuda of the values momentum_source_cuda (local_compress_cuda: local_source_cuda)
// would write to u[base, base + nx), computed as the worker pass reads them: the same floats,
// bits and scale as the source kernel into a buffer and worker_compress_cuda of that buffer,
// without the buffer's write and read. The source's arguments are its kernel's, except that
// there is no chunk table: each value finds its segment by a binary search of starts. The P
// segments (starts, sizes: device memory, as the rest of the source's arrays) must tile [base,
// base + nx) in order, which the caller checks (kernels/ops.py); this call checks only sizes.
void momentum_compress_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, int64_t P,
                            const int64_t* starts, const int64_t* sizes, const float* b, const float* a, int64_t base,
                            int64_t nx, const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W,
                            int64_t row_stride, const uint8_t* prev_bits, const float* prev_scale, bool pending,
                            float* scale_out, void* workspace, void* stream);
void local_compress_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, const float* const* p,
                         const float* acc, int64_t P, const int64_t* starts, const int64_t* sizes, const float* b,
                         const float* a, const float* nw, const float* nlr, bool precond, int64_t base, int64_t nx,
                         const float* e, float* e_out, int64_t n, uint8_t* bits, int64_t W, int64_t row_stride,
                         const uint8_t* prev_bits, const float* prev_scale, bool pending, float* scale_out,
                         void* workspace, void* stream);
// The scale is read from device memory (the scale_out of worker_compress_cuda).
void worker_update_error_cuda(int device, const float* x, int64_t nx, const float* e, float* e_out,
                              int64_t n, const float* scale, void* stream);
// prev_scale: device memory (the previous call's scale_out), read only with pending.
void server_reduce_cuda(int device, const uint8_t* bits, int64_t W, int64_t row_stride,
                        const float* scales, int64_t scale_stride, const float* e, float* e_out,
                        int64_t m, const uint8_t* prev_bits, const float* prev_scale,
                        uint8_t* out_bits, float* scale_out, bool pending, void* workspace,
                        void* stream);
void decompress_cuda(int device, const uint8_t* bits, int64_t W, int64_t row_stride,
                     const float* scales, int64_t scale_stride, int64_t m, float* out, int64_t nout,
                     void* stream);
// The integer codec's CPU entries (quantize_cpu, quantized_reduce_cpu, dequantize_cpu) on the given
// CUDA stream: the same arguments in device memory, the same bits (NaN scales aside: a GPU writes
// its canonical NaN).
void quantize_cuda(int device, const float* x, int64_t nx, const float* e, float* e_out, int64_t n, int bits,
                   int64_t block, uint8_t* rows, int64_t W, int64_t row_stride, void* stream);
void quantized_reduce_cuda(int device, const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits,
                           int64_t block, const float* e, float* e_out, uint8_t* out_row, void* stream);
void dequantize_cuda(int device, const uint8_t* rows, int64_t W, int64_t row_stride, int64_t m, int bits,
                     int64_t block, float* out, int64_t nout, void* stream);

// The fused optimizer updates: the CPU kernels' arithmetic, element for element (the same float32
// operations in the same order, each rounded on its own: no fused multiply-add), so every float
// they write is bit for bit the CPU kernels' (finite values; denormals as IEEE, i.e. unless the
// CPU flushes them). Every array argument is device memory of GPU `device`, including the
// per-parameter (per-layer) hyperparameters, starts/sizes/offsets and the parameter pointers:
// the caller copies them there on `stream` (kernels/native.py: from pinned memory, no host sync).
// Work is cut into chunks of cuda_update_chunk() values that never straddle two parameters
// (layers): parameter (layer) j owns chunks [chunk_start[j], chunk_start[j+1]) (P + 1, or L + 1,
// values; chunk_start[0] = 0, chunk_start[j+1] - chunk_start[j] = ceil(size_j / chunk),
// nchunks = chunk_start[last]), computed by the caller from the sizes it already has.
int64_t cuda_update_chunk();
// adam_update_cpu on device pointers, enqueued on `stream`. No reductions, no workspace. g is the
// table of the parameters' gradient pointers (device memory too; a null entry: zeros).
// `ok`: null, or a device bool (a step's NaN/Inf verdict): when false nothing is written.
void adam_update_cuda(int device, const bool* ok, const float* const* g, float* m, float* v, float* const* params, int64_t P,
                      const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks,
                      const float* lr, const float* beta1, const float* ob1, const float* beta2,
                      const float* ob2, const float* eps, const float* wd, bool update_v, void* stream);
// lamb_frozen_update_cpu on device pointers, enqueued on `stream`; stats (3L doubles, device
// memory) as on the CPU. The floats written (m, vf, u) and each layer's max ratio are bit for bit
// the CPU's (a max does not depend on the order). The two sums of squares add the same exact
// float64 squares in another order (thread partials of a chunk, then a layer's chunk partials,
// each folded by a fixed tree), so they differ from the CPU's in the last bits: each is within
// about (n_k - 1) * 2^-53 (relative) of the exact sum of layer k's n_k squares, as any order of
// n_k - 1 additions of non-negative terms is. The order depends only on the sizes, not on the GPU.
// `workspace`: device memory of at least 3 * max(nchunks, 1) doubles, owned by this call.
// `ok`: null, or a device bool (an exchange's verdict): when false the call writes u = 0 and stats
// (1, 0, 0) per layer, and leaves m and vf as they were (a step dropped without a host read).
// `p`: as on the CPU, a table of L parameter pointers (device memory; null, or a null entry: no
// decay term), but layer k's pointer is its own storage from 0 (flat index i at p[k][i - offsets[k]]).
void lamb_frozen_update_cuda(int device, const bool* ok, const float* x, float* m, const float* v, const float* dscale, float* vf,
                             const float* const* p, float* u, int64_t L, const int64_t* offsets, const int64_t* chunk_start,
                             int64_t nchunks, const float* scaling, const float* beta1, const float* ob1,
                             const float* beta2, const float* ob2, const float* eps, const float* wd, bool precond,
                             double* stats, void* workspace, void* stream);
// 1-bit Adam's compression-phase step after the exchange, only when *ok (a device bool, the
// exchange's verdict; otherwise nothing is written): per value of parameter j,
// p <- fma(nlw[j], p, p) (when nlw[j] != 0), then m <- x * d and p <- fma(nlr[j], x, p)
// (precond), or m <- x and p <- p + (nlr[j] * x) / d: the roundings of the CPU path's torch ops
// (add_ with alpha, addcdiv_) as measured on x86.
// Chunk table and device-memory arrays as adam_update_cuda.
void frozen_adam_update_cuda(int device, const bool* ok, const float* x, float* m, const float* v, const float* eps, const float* dscale,
                             float* const* params, int64_t P, const int64_t* starts, const int64_t* sizes,
                             const int64_t* chunk_start, int64_t nchunks, const float* nlr, const float* nlw,
                             bool precond, void* stream);
// dst <- src (nbytes bytes of device memory) only when *ok is false; one launch that does nothing
// otherwise. Puts an exchange's double-buffered state back after a call with a non-finite verdict.
void restore_unless_cuda(int device, const bool* ok, void* dst, const void* src, int64_t nbytes, void* stream);

// The three one-sweep sources and updates below round as torch's *CUDA* kernels do for the
// optimizers' op sequences (each op rounded on its own: add_ with alpha a fused multiply-add,
// addcmul_ fma(value, t1 * t2, self), or fma(t1, t2, self) when value is 1, a division by a
// Python scalar a multiply by its reciprocal taken in double and rounded to float), so that
// they write the floats of the torch path on the same GPU bit for bit; where that differs from
// x86 torch, the CPU kernels above round as the CPU does. Chunk table (over segments or
// parameters) and device-memory arrays as adam_update_cuda; no reductions, no workspace, no verdict.
// momentum_source_cpu on device pointers: u <- fma(g, a, m * b), then u / d (d may be null); g is
// the table of the segments' gradient pointers (device memory too; a null entry: zeros).
void momentum_source_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, float* u, int64_t P,
                          const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks,
                          const float* b, const float* a, void* stream);
// local_source_cpu on device pointers (g and p tables of the segments' own storage from 0, as
// momentum_source_cuda's g; a null g entry: zeros; p null, or a null entry: no decay term), except
// the decay term without precond: x <- fma(-nw, p * d, x) (torch's CUDA addcmul_; fma(p, d, x)
// when -nw is 1).
void local_source_cuda(int device, const float* m, const float* const* g, const float* v, const float* eps, const float* dscale, const float* const* p,
                       const float* acc, float* u, int64_t P, const int64_t* starts, const int64_t* sizes, const int64_t* chunk_start,
                       int64_t nchunks, const float* b, const float* a, const float* nw, const float* nlr, bool precond,
                       void* stream);
// 1-bit LAMB's per-layer step on device pointers: p <- fma(u, alpha[j], p) per value of parameter
// j (flat values [starts[j], starts[j] + sizes[j]) of u; storage params[j], fp32, contiguous),
// alpha[j] a float in device memory: torch's CUDA p.addcmul_(u_j, alpha[j]) for every parameter.
void layer_step_cuda(int device, const float* u, float* const* params, int64_t P, const int64_t* starts,
                     const int64_t* sizes, const int64_t* chunk_start, int64_t nchunks, const float* alpha,
                     void* stream);
// sync_update_cpu on device pointers, except m: (precond ? x * d : x) * inv[j], inv[j] the
// reciprocal of -lrs[j] taken in double and rounded to float (torch's CUDA division by a Python
// scalar); +0.0 where inv[j] is +0.0 (no lr since the last sync) or floored[i] is set. params
// may be null (no parameter written).
void sync_update_cuda(int device, const float* x, const float* v, const float* eps, const float* dscale, const uint8_t* floored, float* m, float* synced,
                      float* const* params, float* acc, int64_t P, const int64_t* starts, const int64_t* sizes,
                      const int64_t* chunk_start, int64_t nchunks, const float* inv, bool precond, void* stream);
#endif

}  // namespace onebit
