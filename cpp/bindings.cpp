// The Python module lightning_onebit._C. Pointer-based: no torch headers, so it builds in
// seconds with pybind11 alone and one wheel works with any torch. lightning_onebit/kernels/
// validates every argument (dtype, device, sizes, contiguity) before calling in here; the entry
// points check sizes again (onebit.h, detail::). CUDA entry points take the device index of
// their pointers.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "onebit.h"

namespace py = pybind11;
using ptr = std::uintptr_t;

template <class T>
T* P(ptr p) { return reinterpret_cast<T*>(p); }

// The SignRuns of n runs from four arrays (lo, hi: int64; bits: pointers; scale: float), or null
// when n is 0.
struct Runs {
  onebit::SignRuns runs;
  Runs(int64_t n, ptr lo, ptr hi, ptr bits, ptr scale)
      : runs{n, P<const int64_t>(lo), P<const int64_t>(hi), P<const uint8_t* const>(bits), P<const float>(scale)} {}
  const onebit::SignRuns* get() const { return runs.n ? &runs : nullptr; }
};

PYBIND11_MODULE(_C, m) {
  m.doc() = "Fused 1-bit compression kernels (see cpp/onebit.h for the wire format).";
  using release = py::call_guard<py::gil_scoped_release>;

  m.def("worker_compress_cpu", [](ptr x, int64_t nx, ptr e, ptr e_out, int64_t n, ptr bits, int64_t W,
                                  int64_t row_stride, ptr prev_bits, float prev_scale, bool pending, ptr scale_out,
                                  int nthreads) {
    return onebit::worker_compress_cpu(P<const float>(x), nx, P<const float>(e), P<float>(e_out), n,
                                       P<uint8_t>(bits), W, row_stride, P<const uint8_t>(prev_bits), prev_scale,
                                       pending, P<float>(scale_out), nthreads);
  }, release(), "y = x + e (e_true with pending); pack sign(y); e_out <- y unless 0; returns ||y||/sqrt(n)");

  m.def("momentum_compress_cpu", [](ptr mm, ptr g, ptr v, ptr eps, ptr dscale, int64_t np, ptr starts, ptr sizes, ptr b, ptr a,
                                    int64_t base, int64_t nx, ptr e, ptr e_out, int64_t n, ptr bits, int64_t W,
                                    int64_t row_stride, ptr prev_bits, float prev_scale, bool pending, ptr scale_out,
                                    int nthreads) {
    return onebit::momentum_compress_cpu(P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale), np,
                                         P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(b),
                                         P<const float>(a), base, nx, P<const float>(e), P<float>(e_out), n,
                                         P<uint8_t>(bits), W, row_stride, P<const uint8_t>(prev_bits), prev_scale,
                                         pending, P<float>(scale_out), nthreads);
  }, release(), "worker_compress_cpu of momentum_source_cpu's values of [base, base + nx), computed as read");

  m.def("worker_update_error_cpu", [](ptr x, int64_t nx, ptr e, ptr e_out, int64_t n, float scale,
                                      int nthreads) {
    onebit::worker_update_error_cpu(P<const float>(x), nx, P<const float>(e), P<float>(e_out), n, scale,
                                    nthreads);
  }, release(), "e_out <- y - scale*sign(y) with y = x + e (e_out may be e)");

  m.def("momentum_update_error_cpu", [](ptr mm, ptr g, ptr v, ptr eps, ptr dscale, int64_t np, ptr starts, ptr sizes, ptr b, ptr a,
                                        int64_t base, int64_t nx, ptr e, ptr e_out, int64_t n, int64_t W,
                                        float scale, int nthreads) {
    return onebit::momentum_update_error_cpu(P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale), np,
                                             P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(b),
                                             P<const float>(a), base, nx, P<const float>(e), P<float>(e_out), n, W,
                                             scale, nthreads);
  }, release(), "worker_update_error_cpu of momentum_source_cpu's values, recomputed; returns their scale");

  m.def("local_update_error_cpu", [](ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr p, ptr acc, int64_t np, ptr starts, ptr sizes,
                                     ptr b, ptr a, ptr nw, ptr nlr, bool precond, int64_t base, int64_t nx, ptr e,
                                     ptr e_out, int64_t n, int64_t W, float scale, int nthreads) {
    return onebit::local_update_error_cpu(P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale),
                                          P<const float* const>(p), P<const float>(acc), np,
                                          P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(b),
                                          P<const float>(a), P<const float>(nw), P<const float>(nlr), precond, base,
                                          nx, P<const float>(e), P<float>(e_out), n, W, scale, nthreads);
  }, release(), "worker_update_error_cpu of local_source_cpu's values, recomputed; returns their scale");

  m.def("server_reduce_cpu", [](ptr bits, int64_t W, int64_t row_stride, ptr scales,
                                int64_t scale_stride, ptr e, ptr e_out, int64_t mm, ptr prev_bits,
                                float prev_scale, ptr out_bits, ptr scale_out, bool pending,
                                int nthreads) {
    return onebit::server_reduce_cpu(P<const uint8_t>(bits), W, row_stride, P<const float>(scales),
                                     scale_stride, P<const float>(e), P<float>(e_out), mm,
                                     P<const uint8_t>(prev_bits), prev_scale, P<uint8_t>(out_bits),
                                     P<float>(scale_out), pending, nthreads);
  }, release(), "c = mean of W decoded chunks + e; pack sign(c); e_out <- c (error update deferred)");

  m.def("quantize_cpu", [](ptr x, int64_t nx, ptr e, ptr e_out, int64_t n, int bits, int64_t block, ptr rows,
                           int64_t W, int64_t row_stride, int nthreads) {
    onebit::quantize_cpu(P<const float>(x), nx, P<const float>(e), P<float>(e_out), n, bits, block,
                         P<uint8_t>(rows), W, row_stride, nthreads);
  }, release(), "y = x + e in integer codes, one scale per block, chunk j into row j; e_out <- y - s * q");

  m.def("quantized_reduce_cpu", [](ptr rows, int64_t W, int64_t row_stride, int64_t mm, int bits, int64_t block,
                                   ptr e, ptr e_out, ptr out_row, int nthreads) {
    onebit::quantized_reduce_cpu(P<const uint8_t>(rows), W, row_stride, mm, bits, block, P<const float>(e),
                                 P<float>(e_out), P<uint8_t>(out_row), nthreads);
  }, release(), "c = mean of W integer-coded rows + e, re-encoded into out_row; e_out <- c - s * q");

  m.def("dequantize_cpu", [](ptr rows, int64_t W, int64_t row_stride, int64_t mm, int bits, int64_t block, ptr out,
                             int64_t nout, int nthreads) {
    onebit::dequantize_cpu(P<const uint8_t>(rows), W, row_stride, mm, bits, block, P<float>(out), nout, nthreads);
  }, release(), "out = s * q of W integer-coded rows (the first nout values)");

  m.def("lamb_frozen_update_cpu", [](ptr x, ptr mm, ptr v, ptr dscale, ptr vf, ptr p, ptr u, int64_t L, ptr offsets,
                                     ptr scaling, ptr beta1, ptr ob1, ptr beta2, ptr ob2, ptr eps, ptr wd,
                                     bool precond, ptr stats, int nthreads, int64_t nruns, ptr runs_lo,
                                     ptr runs_hi, ptr runs_bits, ptr runs_scale) {
    const Runs xs(nruns, runs_lo, runs_hi, runs_bits, runs_scale);
    onebit::lamb_frozen_update_cpu(P<const float>(x), P<float>(mm), P<const float>(v), P<const float>(dscale), P<float>(vf),
                                   P<const float* const>(p), P<float>(u), L, P<const int64_t>(offsets),
                                   P<const float>(scaling), P<const float>(beta1), P<const float>(ob1),
                                   P<const float>(beta2), P<const float>(ob2), P<const float>(eps),
                                   P<const float>(wd), precond, P<double>(stats), nthreads, xs.get());
  }, release(), "1-bit LAMB compression-phase update of L layers in one sweep (p may be 0: no decay; precond: "
                "x * d first; nruns > 0: x read from the runs)");

  m.def("adam_update_cpu", [](ptr g, ptr mm, ptr v, ptr params, int64_t np, ptr starts, ptr sizes, ptr lr,
                              ptr beta1, ptr ob1, ptr beta2, ptr ob2, ptr eps, ptr wd, bool update_v,
                              int nthreads) {
    onebit::adam_update_cpu(P<const float* const>(g), P<float>(mm), P<float>(v), P<float* const>(params), np,
                            P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(lr),
                            P<const float>(beta1), P<const float>(ob1), P<const float>(beta2), P<const float>(ob2),
                            P<const float>(eps), P<const float>(wd), update_v, nthreads);
  }, release(), "Adam step (no bias correction) of P parameters in one sweep (params, g: arrays of fp32 "
                "pointers, a g entry 0: zeros)");

  m.def("momentum_source_cpu", [](ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr u, int64_t np, ptr starts, ptr sizes, ptr b, ptr a,
                                  int nthreads) {
    onebit::momentum_source_cpu(P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<float>(u), np,
                                P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(b),
                                P<const float>(a), nthreads);
  }, release(), "u = fma(g, a_j, m * b_j) [/ d] over P segments in one sweep (g: array of per-segment "
                "gradient pointers, 0: zeros; d may be 0: no division)");

  m.def("frozen_adam_update_cpu", [](ptr x, ptr mm, ptr v, ptr eps, ptr dscale, ptr params, int64_t np, ptr starts, ptr sizes, ptr nlr,
                                     ptr nlw, bool precond, int nthreads, int64_t nruns, ptr runs_lo, ptr runs_hi,
                                     ptr runs_bits, ptr runs_scale) {
    const Runs xs(nruns, runs_lo, runs_hi, runs_bits, runs_scale);
    onebit::frozen_adam_update_cpu(P<const float>(x), P<float>(mm), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<float* const>(params), np,
                                   P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(nlr),
                                   P<const float>(nlw), precond, nthreads, xs.get());
  }, release(), "1-bit Adam's compression-phase step of P parameters in one sweep (params: array of fp32 pointers; "
                "nruns > 0: x read from the runs)");

  m.def("local_source_cpu", [](ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr p, ptr acc, ptr u, int64_t np, ptr starts, ptr sizes,
                               ptr b, ptr a, ptr nw, ptr nlr, bool precond, int nthreads) {
    onebit::local_source_cpu(P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<const float* const>(p),
                             P<const float>(acc), P<float>(u), np, P<const int64_t>(starts), P<const int64_t>(sizes),
                             P<const float>(b), P<const float>(a), P<const float>(nw), P<const float>(nlr), precond,
                             nthreads);
  }, release(), "0/1 Adam's sync-step exchange source over P segments in one sweep (g: array of per-segment "
                "gradient pointers, 0: zeros; p: the same for the parameters, or 0; acc may be 0: no term)");

  m.def("local_step_cpu", [](ptr g, ptr mm, ptr v, ptr eps, ptr dscale, ptr acc, ptr params, int64_t np, ptr starts, ptr sizes, ptr b,
                             ptr a, ptr w, ptr nlr, int nthreads) {
    return onebit::local_step_cpu(P<const float* const>(g), P<float>(mm), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<float>(acc),
                                  P<float* const>(params), np, P<const int64_t>(starts), P<const int64_t>(sizes),
                                  P<const float>(b), P<const float>(a), P<const float>(w), P<const float>(nlr),
                                  nthreads);
  }, release(), "0/1 Adam's local step of P parameters in one sweep if every gradient is finite (returns whether)");

  m.def("local_compress_cpu", [](ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr p, ptr acc, int64_t np, ptr starts, ptr sizes, ptr b,
                                 ptr a, ptr nw, ptr nlr, bool precond, int64_t base, int64_t nx, ptr e, ptr e_out,
                                 int64_t n, ptr bits, int64_t W, int64_t row_stride, ptr prev_bits, float prev_scale,
                                 bool pending, ptr scale_out, int nthreads) {
    return onebit::local_compress_cpu(P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale),
                                      P<const float* const>(p), P<const float>(acc), np, P<const int64_t>(starts),
                                      P<const int64_t>(sizes), P<const float>(b), P<const float>(a),
                                      P<const float>(nw), P<const float>(nlr), precond, base, nx, P<const float>(e),
                                      P<float>(e_out), n, P<uint8_t>(bits), W, row_stride,
                                      P<const uint8_t>(prev_bits), prev_scale, pending, P<float>(scale_out),
                                      nthreads);
  }, release(), "worker_compress_cpu of local_source_cpu's values of [base, base + nx), computed as read");

  m.def("sync_update_cpu", [](ptr x, ptr v, ptr eps, ptr dscale, ptr floored, ptr mm, ptr synced, ptr params, ptr acc, int64_t np,
                              ptr starts, ptr sizes, ptr nl, bool precond, int nthreads, int64_t nruns, ptr runs_lo,
                              ptr runs_hi, ptr runs_bits, ptr runs_scale) {
    const Runs xs(nruns, runs_lo, runs_hi, runs_bits, runs_scale);
    onebit::sync_update_cpu(P<const float>(x), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<const uint8_t>(floored), P<float>(mm),
                            P<float>(synced), P<float* const>(params), P<float>(acc), np, P<const int64_t>(starts),
                            P<const int64_t>(sizes), P<const float>(nl), precond, nthreads, xs.get());
  }, release(), "0/1 Adam's momentum, synced copy and parameters after a sync step's exchange in one sweep "
                "(nruns > 0: x read from the runs)");

  m.def("cpu_has_simd", &onebit::cpu_has_simd, "whether the CPU kernels use the AVX2 path");

  m.def("decompress_cpu", [](ptr bits, int64_t W, int64_t row_stride, ptr scales,
                             int64_t scale_stride, int64_t mm, ptr out, int64_t nout, int nthreads) {
    onebit::decompress_cpu(P<const uint8_t>(bits), W, row_stride, P<const float>(scales),
                           scale_stride, mm, P<float>(out), nout, nthreads);
  }, release(), "out = scale_j * sign(bits of row j), truncated to nout values");

#ifdef ONEBIT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("cuda_workspace_bytes", &onebit::cuda_workspace_bytes, "device workspace the CUDA compressions need");
  m.def("worker_compress_cuda", [](int device, ptr x, int64_t nx, ptr e, ptr e_out, int64_t n, ptr bits,
                                   int64_t W, int64_t row_stride, ptr prev_bits, ptr prev_scale, bool pending,
                                   ptr scale_out, ptr ws, ptr stream) {
    onebit::worker_compress_cuda(device, P<const float>(x), nx, P<const float>(e), P<float>(e_out), n,
                                 P<uint8_t>(bits), W, row_stride, P<const uint8_t>(prev_bits),
                                 P<const float>(prev_scale), pending, P<float>(scale_out), P<void>(ws),
                                 P<void>(stream));
  }, release(), "worker compress on the given CUDA stream; scale written to device memory");
  m.def("worker_update_error_cuda", [](int device, ptr x, int64_t nx, ptr e, ptr e_out, int64_t n,
                                       ptr scale, ptr stream) {
    onebit::worker_update_error_cuda(device, P<const float>(x), nx, P<const float>(e), P<float>(e_out), n,
                                     P<const float>(scale), P<void>(stream));
  }, release(), "worker error update on the given CUDA stream; scale read from device memory");
  m.def("server_reduce_cuda", [](int device, ptr bits, int64_t W, int64_t row_stride, ptr scales,
                                 int64_t scale_stride, ptr e, ptr e_out, int64_t mm, ptr prev_bits,
                                 ptr prev_scale, ptr out_bits, ptr scale_out, bool pending, ptr ws,
                                 ptr stream) {
    onebit::server_reduce_cuda(device, P<const uint8_t>(bits), W, row_stride, P<const float>(scales),
                               scale_stride, P<const float>(e), P<float>(e_out), mm,
                               P<const uint8_t>(prev_bits), P<const float>(prev_scale),
                               P<uint8_t>(out_bits), P<float>(scale_out), pending, P<void>(ws),
                               P<void>(stream));
  }, release(), "server reduce on the given CUDA stream");
  m.def("decompress_cuda", [](int device, ptr bits, int64_t W, int64_t row_stride, ptr scales,
                              int64_t scale_stride, int64_t mm, ptr out, int64_t nout, ptr stream) {
    onebit::decompress_cuda(device, P<const uint8_t>(bits), W, row_stride, P<const float>(scales),
                            scale_stride, mm, P<float>(out), nout, P<void>(stream));
  }, release(), "decompress on the given CUDA stream");
  m.def("quantize_cuda", [](int device, ptr x, int64_t nx, ptr e, ptr e_out, int64_t n, int bits, int64_t block,
                            ptr rows, int64_t W, int64_t row_stride, ptr stream) {
    onebit::quantize_cuda(device, P<const float>(x), nx, P<const float>(e), P<float>(e_out), n, bits, block,
                          P<uint8_t>(rows), W, row_stride, P<void>(stream));
  }, release(), "quantize on the given CUDA stream");
  m.def("quantized_reduce_cuda", [](int device, ptr rows, int64_t W, int64_t row_stride, int64_t mm, int bits,
                                    int64_t block, ptr e, ptr e_out, ptr out_row, ptr stream) {
    onebit::quantized_reduce_cuda(device, P<const uint8_t>(rows), W, row_stride, mm, bits, block, P<const float>(e),
                                  P<float>(e_out), P<uint8_t>(out_row), P<void>(stream));
  }, release(), "quantized reduce on the given CUDA stream");
  m.def("dequantize_cuda", [](int device, ptr rows, int64_t W, int64_t row_stride, int64_t mm, int bits,
                              int64_t block, ptr out, int64_t nout, ptr stream) {
    onebit::dequantize_cuda(device, P<const uint8_t>(rows), W, row_stride, mm, bits, block, P<float>(out), nout,
                            P<void>(stream));
  }, release(), "dequantize on the given CUDA stream");
  m.def("cuda_update_chunk", &onebit::cuda_update_chunk,
        "values per chunk of the CUDA optimizer updates (the caller's chunk table counts in these)");
  m.def("adam_update_cuda", [](int device, ptr ok, ptr g, ptr mm, ptr v, ptr params, int64_t np, ptr starts, ptr sizes,
                               ptr chunk_start, int64_t nchunks, ptr lr, ptr beta1, ptr ob1, ptr beta2, ptr ob2,
                               ptr eps, ptr wd, bool update_v, ptr stream) {
    onebit::adam_update_cuda(device, P<const bool>(ok), P<const float* const>(g), P<float>(mm), P<float>(v), P<float* const>(params), np,
                             P<const int64_t>(starts), P<const int64_t>(sizes), P<const int64_t>(chunk_start),
                             nchunks, P<const float>(lr), P<const float>(beta1), P<const float>(ob1),
                             P<const float>(beta2), P<const float>(ob2), P<const float>(eps), P<const float>(wd),
                             update_v, P<void>(stream));
  }, release(), "adam_update_cpu's step on the given CUDA stream (every array in device memory)");
  m.def("lamb_frozen_update_cuda", [](int device, ptr ok, ptr x, ptr mm, ptr v, ptr dscale, ptr vf, ptr p, ptr u, int64_t L,
                                      ptr offsets, ptr chunk_start, int64_t nchunks, ptr scaling, ptr beta1,
                                      ptr ob1, ptr beta2, ptr ob2, ptr eps, ptr wd, bool precond, ptr stats,
                                      ptr ws, ptr stream) {
    onebit::lamb_frozen_update_cuda(device, P<const bool>(ok), P<const float>(x), P<float>(mm), P<const float>(v), P<const float>(dscale), P<float>(vf),
                                    P<const float* const>(p), P<float>(u), L, P<const int64_t>(offsets),
                                    P<const int64_t>(chunk_start), nchunks, P<const float>(scaling),
                                    P<const float>(beta1), P<const float>(ob1), P<const float>(beta2),
                                    P<const float>(ob2), P<const float>(eps), P<const float>(wd), precond,
                                    P<double>(stats), P<void>(ws), P<void>(stream));
  }, release(), "lamb_frozen_update_cpu's update on the given CUDA stream (every array in device memory)");
  m.def("frozen_adam_update_cuda", [](int device, ptr ok, ptr x, ptr mm, ptr v, ptr eps, ptr dscale, ptr params, int64_t np, ptr starts,
                                      ptr sizes, ptr chunk_start, int64_t nchunks, ptr nlr, ptr nlw, bool precond,
                                      ptr stream) {
    onebit::frozen_adam_update_cuda(device, P<const bool>(ok), P<const float>(x), P<float>(mm), P<const float>(v), P<const float>(eps), P<const float>(dscale),
                                    P<float* const>(params), np, P<const int64_t>(starts), P<const int64_t>(sizes),
                                    P<const int64_t>(chunk_start), nchunks, P<const float>(nlr), P<const float>(nlw),
                                    precond, P<void>(stream));
  }, release(), "1-bit Adam's compression-phase step, only if *ok (device bool)");
  m.def("momentum_source_cuda", [](int device, ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr u, int64_t np, ptr starts, ptr sizes,
                                   ptr chunk_start, int64_t nchunks, ptr b, ptr a, ptr stream) {
    onebit::momentum_source_cuda(device, P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<float>(u), np,
                                 P<const int64_t>(starts), P<const int64_t>(sizes), P<const int64_t>(chunk_start),
                                 nchunks, P<const float>(b), P<const float>(a), P<void>(stream));
  }, release(), "momentum_source on the given CUDA stream, torch's CUDA roundings (every array in device memory)");
  m.def("local_source_cuda", [](int device, ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr p, ptr acc, ptr u, int64_t np, ptr starts,
                                ptr sizes, ptr chunk_start, int64_t nchunks, ptr b, ptr a, ptr nw, ptr nlr,
                                bool precond, ptr stream) {
    onebit::local_source_cuda(device, P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale),
                              P<const float* const>(p),
                              P<const float>(acc), P<float>(u), np, P<const int64_t>(starts), P<const int64_t>(sizes),
                              P<const int64_t>(chunk_start), nchunks, P<const float>(b), P<const float>(a),
                              P<const float>(nw), P<const float>(nlr), precond, P<void>(stream));
  }, release(), "0/1 Adam's sync-step exchange source on the given CUDA stream, torch's CUDA roundings");
  m.def("momentum_compress_cuda", [](int device, ptr mm, ptr g, ptr v, ptr eps, ptr dscale, int64_t np, ptr starts, ptr sizes, ptr b,
                                     ptr a, int64_t base, int64_t nx, ptr e, ptr e_out, int64_t n, ptr bits, int64_t W,
                                     int64_t row_stride, ptr prev_bits, ptr prev_scale, bool pending, ptr scale_out,
                                     ptr ws, ptr stream) {
    onebit::momentum_compress_cuda(device, P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale), np,
                                   P<const int64_t>(starts), P<const int64_t>(sizes), P<const float>(b),
                                   P<const float>(a), base, nx, P<const float>(e), P<float>(e_out), n,
                                   P<uint8_t>(bits), W, row_stride, P<const uint8_t>(prev_bits),
                                   P<const float>(prev_scale), pending, P<float>(scale_out), P<void>(ws),
                                   P<void>(stream));
  }, release(), "worker_compress_cuda of momentum_source_cuda's values of [base, base + nx), computed as read");
  m.def("local_compress_cuda", [](int device, ptr mm, ptr g, ptr v, ptr eps, ptr dscale, ptr p, ptr acc, int64_t np, ptr starts,
                                  ptr sizes, ptr b, ptr a, ptr nw, ptr nlr, bool precond, int64_t base, int64_t nx,
                                  ptr e, ptr e_out, int64_t n, ptr bits, int64_t W, int64_t row_stride,
                                  ptr prev_bits, ptr prev_scale, bool pending, ptr scale_out, ptr ws, ptr stream) {
    onebit::local_compress_cuda(device, P<const float>(mm), P<const float* const>(g), P<const float>(v), P<const float>(eps), P<const float>(dscale),
                                P<const float* const>(p), P<const float>(acc), np, P<const int64_t>(starts),
                                P<const int64_t>(sizes), P<const float>(b), P<const float>(a), P<const float>(nw),
                                P<const float>(nlr), precond, base, nx, P<const float>(e), P<float>(e_out), n,
                                P<uint8_t>(bits), W, row_stride, P<const uint8_t>(prev_bits),
                                P<const float>(prev_scale), pending, P<float>(scale_out), P<void>(ws),
                                P<void>(stream));
  }, release(), "worker_compress_cuda of local_source_cuda's values of [base, base + nx), computed as read");
  m.def("layer_step_cuda", [](int device, ptr u, ptr params, int64_t np, ptr starts, ptr sizes, ptr chunk_start,
                              int64_t nchunks, ptr alpha, ptr stream) {
    onebit::layer_step_cuda(device, P<const float>(u), P<float* const>(params), np, P<const int64_t>(starts),
                            P<const int64_t>(sizes), P<const int64_t>(chunk_start), nchunks, P<const float>(alpha),
                            P<void>(stream));
  }, release(), "1-bit LAMB's per-layer step p_j += alpha_j * u_j on the given CUDA stream (alpha in device memory)");
  m.def("sync_update_cuda", [](int device, ptr x, ptr v, ptr eps, ptr dscale, ptr floored, ptr mm, ptr synced, ptr params, ptr acc,
                               int64_t np, ptr starts, ptr sizes, ptr chunk_start, int64_t nchunks, ptr inv,
                               bool precond, ptr stream) {
    onebit::sync_update_cuda(device, P<const float>(x), P<const float>(v), P<const float>(eps), P<const float>(dscale), P<const uint8_t>(floored), P<float>(mm),
                             P<float>(synced), P<float* const>(params), P<float>(acc), np, P<const int64_t>(starts),
                             P<const int64_t>(sizes), P<const int64_t>(chunk_start), nchunks, P<const float>(inv),
                             precond, P<void>(stream));
  }, release(), "0/1 Adam's update after a sync step's exchange on the given CUDA stream, torch's CUDA roundings");
  m.def("restore_unless_cuda", [](int device, ptr ok, ptr dst, ptr src, int64_t nbytes, ptr stream) {
    onebit::restore_unless_cuda(device, P<const bool>(ok), P<void>(dst), P<const void>(src), nbytes, P<void>(stream));
  }, release(), "dst <- src (nbytes) only if *ok (device bool) is false");
#else
  m.attr("has_cuda") = false;
#endif
}
