// A CPU stand-in for the CUDA our hand-written kernels use, so their GPU source runs unchanged
// in CPU tests (included first, with CUDA_EMU defined; the kernel then skips its PTX
// primitives and takes these).
//
// Each CUDA thread of a block is a fiber (ucontext) on one OS thread, run round-robin and
// switched only at a barrier: __syncthreads for the block, and each mma.sync for the warp,
// whose 32 lanes exchange fragments through a double-buffered slot array. Blocks run one
// after another, so __shared__ variables become function statics (their contents outlive the
// block, as stale shared memory would, which a missing barrier then reads). Every global load
// and store is checked against the buffers the launch registers (bounds, and the alignment
// the vector instruction needs); a barrier no fiber can pass, or an MMA with fewer than 32
// live lanes, fails the launch. Arithmetic follows the PTX ISA: bf16 and fp16 conversions
// round to nearest even, subnormals kept; mma multiplies exactly and sums in double.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct emu_dim3 {
  unsigned x, y, z;
};

namespace emu {

struct Fiber {
  ucontext_t ctx;
  emu_dim3 tid;
  int warp = 0;
  bool done = false;
  std::vector<char> stack;
};

struct Barrier {
  int arrived = 0;
  long gen = 0;
};

struct Buffer {
  const char* base;
  size_t bytes;
  const char* name;
};

struct Frag {  // one lane's operands of an mma
  uint32_t a[4], b[2];
  float c[4];
};

inline ucontext_t sched;
inline std::vector<Fiber> fibers;
inline Fiber* cur = nullptr;
inline emu_dim3 block_idx{0, 0, 0}, block_dim{1, 1, 1};
inline std::function<void()> body;
inline std::vector<Buffer> buffers;
inline std::string error;
inline long progress = 0;                 // bumped by every arrival and exit
inline Barrier block_bar;
inline std::vector<Barrier> warp_bar;
inline std::vector<int> warp_live;
inline std::vector<Frag> frags[2];        // [parity][warp * 32 + lane]
inline std::vector<int> mma_count;        // per fiber: its mmas so far (slot parity)
inline int live = 0;

[[noreturn]] inline void fail(const std::string& msg) {
  if (error.empty()) {
    char where[96];
    std::snprintf(where, sizeof where, " (block %u,%u thread %u)", block_idx.x, block_idx.y,
                  cur ? cur->tid.x : 0u);
    error = msg + where;
  }
  cur->done = true;
  swapcontext(&cur->ctx, &sched);
  __builtin_unreachable();
}

inline void yield() { swapcontext(&cur->ctx, &sched); }

inline void wait(Barrier& b, int expected) {
  const long g = b.gen;
  ++progress;
  if (++b.arrived >= expected) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  while (b.gen == g) yield();
}

inline void release_if_complete(Barrier& b, int expected) {
  if (b.arrived > 0 && b.arrived >= expected) {
    b.arrived = 0;
    ++b.gen;
  }
}

inline void entry() {
  body();
  cur->done = true;
  ++progress;
  --live;
  --warp_live[cur->warp];
  release_if_complete(block_bar, live);  // exited threads count as arrived
  swapcontext(&cur->ctx, &sched);
}

inline const emu_dim3& thread_idx() { return cur->tid; }

inline void check(const void* p, size_t n, size_t align, const char* what) {
  const char* c = static_cast<const char*>(p);
  if (reinterpret_cast<uintptr_t>(c) % align) {
    char m[160];
    std::snprintf(m, sizeof m, "%s: address %p is not %zu-byte aligned", what, p, align);
    fail(m);
  }
  for (const Buffer& b : buffers)
    if (c >= b.base && c + n <= b.base + b.bytes) return;
  std::string m = std::string(what) + ": " + std::to_string(n) + " bytes outside every buffer";
  for (const Buffer& b : buffers)
    m += "; " + std::string(b.name) + " offset " + std::to_string(c - b.base) + " of " +
         std::to_string(b.bytes);
  fail(m);
}

// Runs kernel() for every thread of a grid; false (and `error`) when a check failed.
inline bool launch(emu_dim3 grid, emu_dim3 block, std::function<void()> kernel,
                   bool reverse = false) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  const int warps = (n + 31) / 32;
  body = std::move(kernel);
  error.clear();
  block_dim = block;
  fibers.assign(n, Fiber{});
  for (Fiber& f : fibers) f.stack.resize(1 << 17);
  for (auto& fr : frags) fr.assign(warps * 32, Frag{});
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        block_idx = {bx, by, bz};
        block_bar = Barrier{};
        warp_bar.assign(warps, Barrier{});
        warp_live.assign(warps, 0);
        mma_count.assign(n, 0);
        live = n;
        for (int i = 0; i < n; ++i) {
          Fiber& f = fibers[i];
          f.tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
          f.warp = i / 32;
          f.done = false;
          ++warp_live[f.warp];
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &sched;
          makecontext(&f.ctx, entry, 0);
        }
        for (;;) {
          const long before = progress;
          bool any = false;
          for (int k = 0; k < n; ++k) {
            Fiber& f = fibers[reverse ? n - 1 - k : k];
            if (f.done) continue;
            any = true;
            cur = &f;
            swapcontext(&sched, &f.ctx);
            if (!error.empty()) return false;
          }
          if (!any) break;
          if (progress == before) {
            cur = &fibers[0];
            error = "deadlock: every live thread waits at a barrier the others never reach";
            return false;
          }
        }
      }
  return true;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_f32(uint32_t h) {
  const uint32_t u = (h & 0xFFFFu) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)

inline void __syncthreads() { emu::wait(emu::block_bar, emu::live); }

inline int atomicMin(int* p, int v) {  // fibers never switch inside: atomic by construction
  const int old = *p;
  if (v < old) *p = v;
  return old;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// prmt: byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {y, x} (x the low four).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned int>((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
}

// The kernel's primitives (the GPU versions are PTX in the kernel's own file).
inline unsigned int bmul(unsigned int a, unsigned int s) {
  const uint32_t lo = emu::f32_to_bf16(emu::bf16_to_f32(a) * emu::bf16_to_f32(s));
  const uint32_t hi = emu::f32_to_bf16(emu::bf16_to_f32(a >> 16) * emu::bf16_to_f32(s >> 16));
  return lo | (hi << 16);
}

inline float h2f(unsigned short h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
            : e == 31 ? (m ? NAN : INFINITY)
                      : std::ldexp(static_cast<float>(1024 + m), e - 25);
  return (h & 0x8000) ? -v : v;
}

inline unsigned int f2bf2(float f) {
  const uint32_t b = emu::f32_to_bf16(f);
  return b | (b << 16);
}

inline unsigned short f2bf(float f) { return emu::f32_to_bf16(f); }

// mma.m16n8k16 row.col bf16 -> f32: lane (g, t) holds A rows g, g + 8 at K 2t, 2t + 1 (a0,
// a1) and 2t + 8, 2t + 9 (a2, a3), B column g at the same K (b0, b1), C/D rows g, g + 8 at
// columns 2t, 2t + 1; the lower half of a register is the lower K.
inline void mma(float* c, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                unsigned int b0, unsigned int b1) {
  using namespace emu;
  const int self = static_cast<int>(cur - fibers.data());
  const int w = cur->warp, lane = self % 32;
  if (warp_live[w] != 32) fail("mma.sync with " + std::to_string(warp_live[w]) + " of 32 lanes");
  std::vector<Frag>& slot = frags[mma_count[self]++ & 1];
  slot[w * 32 + lane] = Frag{{a0, a1, a2, a3}, {b0, b1}, {c[0], c[1], c[2], c[3]}};
  wait(warp_bar[w], 32);
  const Frag* f = &slot[w * 32];
  auto A = [&](int r, int k) {
    const uint32_t reg = f[4 * (r % 8) + (k % 8) / 2].a[(r >= 8) + 2 * (k >= 8)];
    return bf16_to_f32(k & 1 ? reg >> 16 : reg);
  };
  auto B = [&](int k, int n) {
    const uint32_t reg = f[4 * n + (k % 8) / 2].b[k >= 8];
    return bf16_to_f32(k & 1 ? reg >> 16 : reg);
  };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), n = 2 * t + (i % 2);
    double s = f[lane].c[i];
    for (int k = 0; k < 16; ++k) s += static_cast<double>(A(r, k)) * B(k, n);
    c[i] = static_cast<float>(s);
  }
}

inline void ld_w(const unsigned char* p, unsigned int* v) {
  emu::check(p, 8, 8, "ld_w (ld.global.v2.u32)");
  std::memcpy(v, p, 8);
}

inline unsigned int ld_u8(const unsigned char* p) {
  emu::check(p, 1, 1, "ld_u8 (ld.global.u8)");
  return *p;
}

inline void ld_x(const unsigned short* p, unsigned int* v) {
  emu::check(p, 16, 16, "ld_x (ld.global.v4.u32)");
  std::memcpy(v, p, 16);
}

template <typename T>
inline T ldg(const T* p) {
  emu::check(p, sizeof(T), sizeof(T), "ldg");
  return *p;
}

inline void st_u16(unsigned short* p, unsigned short v) {
  emu::check(p, 2, 2, "st_u16 (st.global.u16)");
  *p = v;
}
