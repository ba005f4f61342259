// The C entry tests/cuda_emu/__init__.py calls: registers the launch's buffers, then runs
// blockspec/kernels/_w4a16_cuda.cu's kernel (compiled into the same library) on the CPU.
#include "cuda_emu.h"

extern "C" void w4a16_cuda(const unsigned short* x, const int* ids, int ids_step,
                            const unsigned char* w, const unsigned char* ws, const float* ws2,
                            unsigned short* out, int M, int topk, int N, int shared_parts,
                            int shared_base, int x_per_pair, int relu2, int distinct,
                            int ws2_rows, int stride_xm, int stride_we, int stride_se,
                            int stride_om);

// Returns nullptr, or what failed. bytes[] are the sizes of x, ids, w, ws, ws2 and out.
extern "C" const char* emu_w4a16_cuda(unsigned grid_x, unsigned grid_y, unsigned threads,
                                       int reverse, const long long* bytes,
                                       const unsigned short* x, const int* ids, int ids_step,
                                       const unsigned char* w, const unsigned char* ws,
                                       const float* ws2, unsigned short* out, int M, int topk,
                                       int N, int shared_parts, int shared_base, int x_per_pair,
                                       int relu2, int distinct, int ws2_rows, int stride_xm,
                                       int stride_we, int stride_se, int stride_om) {
  emu::buffers = {{reinterpret_cast<const char*>(x), static_cast<size_t>(bytes[0]), "x"},
                  {reinterpret_cast<const char*>(ids), static_cast<size_t>(bytes[1]), "ids"},
                  {reinterpret_cast<const char*>(w), static_cast<size_t>(bytes[2]), "weight"},
                  {reinterpret_cast<const char*>(ws), static_cast<size_t>(bytes[3]), "scale"},
                  {reinterpret_cast<const char*>(ws2), static_cast<size_t>(bytes[4]), "ws2"},
                  {reinterpret_cast<const char*>(out), static_cast<size_t>(bytes[5]), "out"}};
  const bool ok = emu::launch({grid_x, grid_y, 1}, {threads, 1, 1}, [&] {
    w4a16_cuda(x, ids, ids_step, w, ws, ws2, out, M, topk, N, shared_parts, shared_base,
                x_per_pair, relu2, distinct, ws2_rows, stride_xm, stride_we, stride_se, stride_om);
  }, reverse != 0);
  return ok ? nullptr : emu::error.c_str();
}
