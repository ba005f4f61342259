// W4A16 NVFP4 MoE at decode sizes: the tokens of one expert (a speculative verify's block,
// at most 16) times that expert's packed weights, one CTA per (expert, 16 * MT output rows).
// Compiled at run time by NVRTC (kernels/w4a16_cuda.py) with MT, NT, KW, PF and KDIM (= K)
// defined; weights and scales are contiguous per expert.
//
// Why not the Triton kernel: at these sizes a Triton tile goes global -> shared -> registers
// and through a layout conversion before its MMA, holds ~130 registers and runs few warps
// per SM, so it issues at half rate and reads at ~40 % of the H200's bandwidth.  Here each
// thread loads exactly the bytes its own mma.sync fragments need, straight into registers
// (no shared memory in the loop), so a CTA is small and an SM holds many of them.
//
// Fragment plan (mma.m16n8k16, A = weights [16 rows x 16 K], B = x^T [16 K x 8 tokens]):
// lane (g, t) = (lane / 4, lane % 4) reads, per 64-K unit, the 8 packed bytes of K 16t..16t+15
// of rows g and g + 8: one scale group, so one scale byte per row.  Decoding a 32-bit pair of
// words gives 4 bf16x2 registers, stream r = (w[k0 + r], w[k0 + 4 + r]).  An MMA's K order is
// free as long as A and B agree and depends only on t, so the unit's 4 MMAs take streams
// (0, 1), (2, 3) of the first pair, then of the second, and B pairs x the same way (prmt).
// The decode is the Triton kernel's (kernels/_w4a16_kernels.py): bf16 E2M1 * 2^-126 times
// the block scale as bf16 scale * 2^118, exact; weight_scale_2 * 2^8 scales the fp32 sum.
//
// Dense mode (ids_step 0): the weight is the one expert and every row of x a token, for
// w4a16_linear calls of up to 16 rows; ws2_rows: one global scale per output row (a fused
// stack of sibling projections), else one per expert.
//
// KW warps split K (unit u goes to warp u % KW) and sum their partials in shared memory;
// each warp keeps PF units' loads in flight ahead of the one it decodes.
// Blocks: one per (token, expert) pair plus one per shared-expert slice; of the pairs naming
// one expert only the first (the leader) runs, for all its tokens.

#define U32 unsigned int

// The device primitives: every PTX instruction and memory access the kernel makes goes
// through one of these, so that tests/cuda_emu can run the kernel below, unchanged, on a CPU
// (with CUDA_EMU defined it supplies its own versions).
#ifndef CUDA_EMU
__device__ __forceinline__ U32 bmul(U32 a, U32 s) {  // bf16x2 a * s, round to nearest even
  U32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(s));
  return d;
}

__device__ __forceinline__ float h2f(unsigned short h) {  // fp16 bits -> fp32
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ U32 f2bf2(float f) {  // fp32 -> bf16x2 (f, f), nearest even
  U32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f));
  return d;
}

__device__ __forceinline__ unsigned short f2bf(float f) {  // fp32 -> bf16 bits, nearest even
  unsigned short y;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(y) : "f"(f));
  return y;
}

__device__ __forceinline__ void mma(float* c, U32 a0, U32 a1, U32 a2, U32 a3, U32 b0, U32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ld_w(const unsigned char* p, U32* v) {  // 8 bytes, 8-aligned
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v[0]), "=r"(v[1]) : "l"(p));
}

__device__ __forceinline__ U32 ld_u8(const unsigned char* p) {
  U32 v;
  asm("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void ld_x(const unsigned short* p, U32* v) {  // 16 bytes, 16-aligned
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
}

template <typename T>
__device__ __forceinline__ T ldg(const T* p) { return *p; }

__device__ __forceinline__ void st_u16(unsigned short* p, unsigned short v) { *p = v; }
#endif

// Streams 0..3 of the two words in w (kernel layout, kernels/w4a16_layout.py), times s.
__device__ __forceinline__ void decode8(U32 w, U32 s, U32* o) {
  U32 sw = __byte_perm(w, 0, 0x2301);
  o[0] = bmul((w << 2) & 0x81C081C0u, s);
  o[1] = bmul((w << 6) & 0x81C081C0u, s);
  o[2] = bmul((sw << 4) & 0x81C081C0u, s);
  o[3] = bmul((w & 0x81808180u) | (sw & 0x00400040u), s);
}

// E4M3 scale byte -> bf16x2 (scale * 2^118 twice): fp16 bits (b & 0x7F) << 7 are scale * 2^-8.
__device__ __forceinline__ U32 scale2(U32 b) {
  return f2bf2(h2f((unsigned short)((b & 0x7Fu) << 7)) * 8.507059173023462e+37f);  // * 2^126
}

// K is compiled in: the row strides of the packed weights and scales become immediates.
#define SW (KDIM / 2)
#define SS (KDIM / 16)

// One 64-K unit's packed words and scale bytes of this lane's 2 * MT rows.
template <typename Stride>
__device__ __forceinline__ void load_rows(const unsigned char* pw, const unsigned char* ps,
                                          const bool (&ok)[MT][2], U32 (&wv)[MT][2][2],
                                          U32 (&sv)[MT][2], Stride sw, Stride ss) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (ok[i][h]) {
        ld_w(pw + (16 * i + 8 * h) * sw, wv[i][h]);
        sv[i][h] = ld_u8(ps + (16 * i + 8 * h) * ss);
      }
}

// x of one unit for this lane's token slots, paired as the decoded streams (advances px),
// then the unit's 4 * MT * NT MMAs.
__device__ __forceinline__ void unit_rows_mma(float (&acc)[MT][NT][4],
                                              const U32 (&wv)[MT][2][2], const U32 (&sv)[MT][2],
                                              const unsigned short* (&px)[NT]) {
  U32 xb[NT][8];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    U32 xv[8];
    ld_x(px[j], xv);
    ld_x(px[j] + 8, xv + 4);
    px[j] += 64 * KW;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      xb[j][4 * hf + 0] = __byte_perm(xv[4 * hf], xv[4 * hf + 2], 0x5410);
      xb[j][4 * hf + 1] = __byte_perm(xv[4 * hf], xv[4 * hf + 2], 0x7632);
      xb[j][4 * hf + 2] = __byte_perm(xv[4 * hf + 1], xv[4 * hf + 3], 0x5410);
      xb[j][4 * hf + 3] = __byte_perm(xv[4 * hf + 1], xv[4 * hf + 3], 0x7632);
    }
  }
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    U32 a[2][8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const U32 s = scale2(sv[i][h]);
      decode8(wv[i][h][0], s, a[h]);
      decode8(wv[i][h][1], s, a[h] + 4);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int j = 0; j < NT; ++j)
        mma(acc[i][j], a[0][2 * q], a[1][2 * q], a[0][2 * q + 1], a[1][2 * q + 1],
            xb[j][2 * q], xb[j][2 * q + 1]);
  }
}

extern "C" __global__ void __launch_bounds__(KW * 32) w4a16_cuda(
    const unsigned short* __restrict__ x, const int* __restrict__ ids, int ids_step,
    const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws,
    const float* __restrict__ ws2, unsigned short* __restrict__ out,
    int M, int topk, int N, int shared_parts, int shared_base, int x_per_pair, int relu2,
    int distinct, int ws2_rows, int stride_xm, int stride_we, int stride_se, int stride_om) {
  __shared__ int s_first[16];
  __shared__ int s_xrow[16];
  __shared__ int s_orow[16];
  __shared__ float s_red[KW][MT * 16][NT * 8 + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int npairs = M * topk;
  const int b = blockIdx.x;
  const bool shared_blk = b >= npairs;
  const int BIG = 0x7fffffff;

  // Which tokens this block serves: every token for a shared slice; for a pair, the first
  // pair of each token that names the same expert (with the same repeat count unless
  // `distinct`), and only if this block is the first of them all.
  if (tid < 16) s_first[tid] = BIG;
  __syncthreads();
  int e;
  if (!shared_blk && ids_step == 0) {  // a dense linear: expert 0 for every token, no ids
    e = 0;
    if (tid < M) s_first[tid] = tid;
  } else if (!shared_blk) {
    e = ldg(ids + b * ids_step);
    int occ_b = 0;
    if (!distinct)
      for (int j = (b / topk) * topk; j < b; ++j) occ_b += ldg(ids + j * ids_step) == e;
    for (int j = tid; j < npairs; j += KW * 32) {
      if (ldg(ids + j * ids_step) != e) continue;
      int occ = 0;
      if (!distinct)
        for (int jj = (j / topk) * topk; jj < j; ++jj) occ += ldg(ids + jj * ids_step) == e;
      if (occ == occ_b) atomicMin(&s_first[j / topk], j);
    }
  } else {
    e = shared_base + b - npairs;
  }
  __syncthreads();
  if (!shared_blk) {
    int lead = BIG;
    for (int s = 0; s < M; ++s) lead = min(lead, s_first[s]);
    if (lead != b) return;  // uniform over the block
  }
  if (tid < 16) {
    int orow = -1;
    if (tid < M) {
      if (shared_blk) orow = npairs + tid * shared_parts + (b - npairs);
      else if (s_first[tid] != BIG) orow = s_first[tid];
    }
    s_orow[tid] = orow;
    s_xrow[tid] = orow < 0 ? -1 : (x_per_pair ? orow : tid);
  }
  __syncthreads();

  // This warp's units are warp, warp + KW, ...: one base pointer for its rows' weights and
  // one for their scales step KW units at a time; rows sit at constant offsets and rows past
  // N load nothing.
  const int n0 = blockIdx.y * (MT * 16);
  const unsigned char* pw = w + (long long)e * stride_we + (long long)(n0 + g) * SW
                            + 32 * warp + 8 * t;
  const unsigned char* ps = ws + (long long)e * stride_se + (long long)(n0 + g) * SS
                            + 4 * warp + t;
  bool ok[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) ok[i][h] = n0 + 16 * i + 8 * h + g < N;
  // A token slot this block does not serve reads row 0: its MMA column is never stored.
  const unsigned short* px[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    px[j] = x + (long long)max(s_xrow[8 * j + g], 0) * stride_xm + 64 * warp + 16 * t;

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  const int iters = max((KDIM >> 6) - warp + KW - 1, 0) / KW;
  // A ring of PF + 1 register buffers: while one unit is decoded, the next PF units' bytes
  // are in flight. Unit it + r sits in buffer r (the inner loop is unrolled, so every
  // buffer index is a constant); a warp past K's units loads nothing.
  constexpr int NB = PF + 1;
  U32 wv[NB][MT][2][2], sv[NB][MT][2];
#pragma unroll
  for (int r = 0; r < PF; ++r)
    if (r < iters) load_rows(pw + r * 32 * KW, ps + r * 4 * KW, ok, wv[r], sv[r], SW, SS);
  for (int it = 0; it < iters; it += NB) {
#pragma unroll
    for (int r = 0; r < NB; ++r) {
      if (it + r >= iters) break;
      if (it + r + PF < iters)
        load_rows(pw + (r + PF) * 32 * KW, ps + (r + PF) * 4 * KW, ok, wv[(r + PF) % NB],
                  sv[(r + PF) % NB], SW, SS);
      unit_rows_mma(acc, wv[r], sv[r], px);
    }
    pw += NB * 32 * KW;
    ps += NB * 4 * KW;
  }

  // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s_red[warp][16 * i + g][8 * j + 2 * t] = acc[i][j][0];
      s_red[warp][16 * i + g][8 * j + 2 * t + 1] = acc[i][j][1];
      s_red[warp][16 * i + g + 8][8 * j + 2 * t] = acc[i][j][2];
      s_red[warp][16 * i + g + 8][8 * j + 2 * t + 1] = acc[i][j][3];
    }
  __syncthreads();
  for (int idx = tid; idx < MT * 16 * NT * 8; idx += KW * 32) {
    const int row = idx % (MT * 16), tok = idx / (MT * 16);
    const int orow = s_orow[tok], n = n0 + row;
    if (orow < 0 || n >= N) continue;
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < KW; ++k) v += s_red[k][row][tok];
    // 2^8: the decode's scale factor; ws2_rows: one global scale per output row (dense)
    unsigned short y = f2bf(v * (ldg(ws2 + (ws2_rows ? n : e)) * 256.f));
    if (relu2) {
      const float yf = __uint_as_float(((U32)y) << 16);
      y = f2bf(yf > 0.f ? yf * yf : 0.f);
    }
    st_u16(out + (long long)orow * stride_om + n, y);
  }
}
