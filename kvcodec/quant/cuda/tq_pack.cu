// TurboQuant-MSE quantize + pack (tq layout v1): rows of D values -> packed B-bit codes + a 16-bit norm.
//
// norm = ||x||; y = H_D (s * x) / (sqrt(D) * norm) (randomized Hadamard, Sylvester order; ROUNDS = 2:
// y = H (s2 * H (s1 * x)) / (D * norm), the "hadamard2" rotation of kvcodec.quant); code_j =
// #{thresholds < y_j} (thresholds ascending, exact ties go to the lower centroid, like argmin); codes
// are written as the little-endian bit stream of the layout, the norm as fp16/bf16 (NC: norm / <y, c>).
//
// The kernel has to keep up with DRAM (a bf16 d=128 row is 256 bytes in, 66 out), which leaves a few
// dozen issued warp instructions per row. Where they go:
//
// 1. Tensor cores do 4 (+1) of the log2(D) butterfly levels. Write a coordinate of a segment (the whole
//    row for D <= 128, else D/128 segments of 128) as kappa * NG + G: kappa (4 bits) is the index of one
//    mma.m16n8k16, G (NG = 2, 4 or 8 groups) the rest. C = A X with A = H16 (+-1, exact in bf16/fp16)
//    and X = 16 coordinates x 8 columns (a column is a row, or a segment of a row): one mma per group
//    transforms 8 columns. Products are exact and sums fp32, as in a float32 butterfly. The lowest G
//    level is folded in too (C(G') = A X(G'') +- A X(G''+1), with -A held as a second fragment). fp32
//    inputs are split exactly into three bf16 parts (hi + mid + lo), three mma per group, no folding.
//    Thread (g = lane/4, t = lane%4) loads column g as 16-byte chunks at coordinate (4c + t) * 8 (the 4
//    threads of a column read 64 contiguous bytes per load); the chunk registers already hold bf16
//    pairs, one prmt per B-fragment register regroups them. kappa_of (which kappa each B k-slot
//    carries) and rho (which kappa each row of A computes) are chosen so that thread (g, t) ends with
//    outputs kappa = 2g, 2g+1 of columns 2t and 2t+1 for every G: 2 * NG consecutive coordinates, whole
//    bytes of the packed row.
// 2. The other levels are fp32 adds in registers (the remaining G levels; segment bit 0, which is the
//    thread's column pair for D >= 256) and one shuffle + FFMA per value for segment bits >= 1 (D >=
//    512). ROUNDS = 2 applies s2 and runs all levels again on the fp32 values: G and kappa bit 0 in
//    registers, kappa bits 1-3 with shuffles across g. The random signs are xor masks in shared memory.
// 3. No division: ||x||^2 = ||H x||^2 / D comes from the outputs, and y = v / (sqrt(D)^ROUNDS ||x||)
//    is folded into the slope of the affine map below (one rsqrt per row).
// 4. The codebook search is a table lookup. f = sat(a * y + b) maps the threshold range onto cells 1..M-2
//    of M uniform cells; g = bits(2^23 + round(f * (2^23 - 1))) is a monotone integer whose top bits
//    are the cell. Once per block, with the thresholds mapped by the same instructions, a table of M
//    words W[c] = (base << 24) + (2^24 - 1 - pos) - (first g of cell c) is built (base: thresholds in
//    lower cells, pos: low bits of the cell's threshold), so that code = (W[cell] + g) >> 24: the carry
//    out of the low 24 bits adds 1 exactly when g passes the cell's threshold. M = 2^(B+1) cells
//    (2^(B+2) for B >= 6) hold at most one Lloyd-Max threshold each; if a codebook puts two in a cell
//    the block uses a binary search over the same integers instead (same codes, slower). For M <= 32
//    (B <= 4) the table is one register per lane and the lookup a shuffle (which reads only the low 5
//    bits of its lane index): FFMA.SAT, FFMA, SHF, SHFL, IADD per value. Comparing mapped integers is
//    exact for the mapped values, i.e. equal to #{thresholds < y} up to float rounding at a threshold.
// 5. Packing: the codes sit in the top bytes of those sums; for B = 1, 2, 4, 8 prmt gathers them into
//    bytes and shifted adds merge the bytes (about one op per code), else shift + or. Each thread
//    stores its piece of each column with one 2/4/8/16-byte store (8 lanes write a column's bytes
//    contiguously); no atomics and no shared memory.
//
// tests/test_cuda_build.py emulates the kernel lane by lane (fragments, levels, table, packing) against
// kvcodec.quant.cuda.fallback.quantize_reference.
#include "tq_common.cuh"

namespace tqp {
// Resident blocks of 256 threads per SM the register budget is cut for: 4 (64 registers) for 16-bit
// inputs, one round, no norm correction, B <= 4; 3 (80) for the other 16-bit instances; 2 (128) for
// fp32 inputs (three bf16 parts per value). The largest counts that keep every instance free of
// spills on sm_90 and sm_100.
constexpr int min_blocks(int in, int b, int rounds, bool nc) {
  return in == 0 ? 2 : (rounds == 1 && !nc && b <= 4 ? 4 : 3);
}

constexpr int WARPS = 8;  // warps per block; the launcher's rows per block = WARPS * Geo<D>::R

struct alignas(16) V4 {
  tq_u32 x, y, z, w;
};

template <int D>
struct Geo {
  static_assert(D >= 32 && D <= 1024 && (D & (D - 1)) == 0, "head_dim must be a power of two in [32, 1024]");
  static constexpr int S = D > 128 ? D / 128 : 1;  // segments (mma columns) per row
  static constexpr int LSEG = D / S;               // coordinates per segment: 32, 64 or 128
  static constexpr int NG = LSEG / 16;             // 16-point groups per segment: 2, 4 or 8
  static constexpr int CH = 8 / NG;                // k slots per 8-coordinate chunk
  static constexpr int NCH = NG / 2;               // 8-coordinate chunks a thread loads per row
  static constexpr int R = 8 / S;                  // rows per warp
};

// kappa of the value in B-fragment k slot k (0..15) for the load layout above: k slots 2t, 2t+1, 2t+8,
// 2t+9 are the thread's slots s = 0..3, the thread's chunk c holds slots c*CH .. c*CH + CH-1.
template <int CH>
TQ_DEVI int kappa_of(int k) {
  const int t = (k >> 1) & 3, s = (k & 1) | ((k >> 3) << 1);
  return ((s / CH) * 4 + t) * CH + s % CH;
}
// kappa computed by row m of A: rows g and g + 8 give kappa 2g and 2g + 1 (a thread's two outputs adjoin)
TQ_DEVI int rho_of(int m) { return m < 8 ? 2 * m : 2 * (m - 8) + 1; }

TQ_DEVI void ldg16(tq_u32 (&r)[4], const void* p) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "l"(p));
}

// bf16x2 {lo, hi} (round to nearest)
TQ_DEVI tq_u32 bf16x2(float lo, float hi) {
  tq_u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// x = hi + mid + lo exactly (each part bf16; every subtraction below is exact)
TQ_DEVI void split3(float x0, float x1, tq_u32 (&p)[3]) {
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    p[i] = bf16x2(x0, x1);
    x0 -= __uint_as_float(p[i] << 16);
    x1 -= __uint_as_float(p[i] & 0xFFFF0000u);
  }
}

// In-place unnormalized Sylvester transform over the index bits HMIN <= h < HMAX of a register array.
template <int HMIN, int HMAX, int N>
TQ_DEVI void fwht_regs(float (&v)[N]) {
#pragma unroll
  for (int h = HMIN; h < HMAX; h <<= 1) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if ((e & h) == 0) {
        const float a = v[e], c = v[e + h];
        v[e] = a + c;
        v[e + h] = a - c;
      }
    }
  }
}
// a, c -> a + c, a - c elementwise (a butterfly level between two register arrays)
template <int N>
TQ_DEVI void bfly_pair(float (&a)[N], float (&c)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float p = a[e], q = c[e];
    a[e] = p + q;
    c[e] = p - q;
  }
}

// One butterfly level across lanes (xor m): the lower lane keeps a + b, the upper a - b (its own value
// is b). sgn = upper ? -1 : 1, so both are one FFMA.
TQ_DEVI float bfly_x(float v, int m, float sgn) { return fmaf(v, sgn, __shfl_xor_sync(0xffffffffu, v, m)); }

// Sum over the lanes that hold parts of the same row: g (lane bits 2-4) and, for S >= 4, t bits.
template <int S>
TQ_DEVI float row_sum(float v) {
#pragma unroll
  for (int m = 4; m < 32; m <<= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if constexpr (S >= 4) v += __shfl_xor_sync(0xffffffffu, v, 1);
  if constexpr (S >= 8) v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// Store PBY bytes of a piece (little-endian words w) in the widest units its alignment allows
// (the piece offset is a multiple of PBY, rows are multiples of 8 pieces).
template <int PBY>
TQ_DEVI void store_piece(tq_u8* __restrict__ dst, const tq_u32* w) {
  constexpr int U = (PBY % 16 == 0) ? 16 : (PBY % 8 == 0) ? 8 : (PBY % 4 == 0) ? 4 : (PBY % 2 == 0) ? 2 : 1;
#pragma unroll
  for (int u = 0; u < PBY / U; ++u) {
    if constexpr (U == 16) {
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 16 * u), "r"(w[4 * u]), "r"(w[4 * u + 1]),
                   "r"(w[4 * u + 2]), "r"(w[4 * u + 3])
                   : "memory");
    } else if constexpr (U == 8) {
      asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(dst + 8 * u), "r"(w[2 * u]), "r"(w[2 * u + 1]) : "memory");
    } else if constexpr (U == 4) {
      reinterpret_cast<tq_u32*>(dst)[u] = w[u];
    } else if constexpr (U == 2) {
      reinterpret_cast<tq_u16*>(dst)[u] = (tq_u16)(w[u >> 1] >> (16 * (u & 1)));
    } else {
      dst[u] = (tq_u8)(w[u >> 2] >> (8 * (u & 3)));
    }
  }
}

// The monotone integer of the search: bits(2^23 + round(sat(a * y + b) * (2^23 - 1))) = HBITS + N,
// N < 2^23. Thresholds and values go through these same instructions, so comparing integers is exact
// for the mapped values.
TQ_DEVI tq_u32 gbits(float y, float a, float b) {
  const float f = __saturatef(__fmaf_rn(y, a, b));
  return __float_as_uint(__fmaf_rn(f, 8388607.f, 8388608.f));
}

// Code of one value, in the top byte of the result (low bits: garbage). Fast path: (W[cell] + g) >> 24
// is the code (the cell table, see the header); for M <= 32 cells the table is one register per lane
// (lane (HBITS >> SUB) + cell, mod 32, holds W[cell]: shfl reads only the low 5 bits of the index),
// else shared memory. SLOW: binary search over the mapped thresholds (a cell holds two or more).
template <bool SLOW, int B, int CB>
TQ_DEVI tq_u32 code_top(float y, float a_row, float b_map, tq_u32 w_reg, const tq_u32* s_w, const tq_u32* s_g) {
  constexpr int M = 1 << CB, SUB = 23 - CB;
  const tq_u32 gb = gbits(y, a_row, b_map);
  if constexpr (SLOW) {
    tq_u32 code = 0;
#pragma unroll
    for (int step = B - 1; step >= 0; --step)
      if (gb > s_g[code + (1u << step) - 1u]) code += 1u << step;
    return code << 24;
  } else if constexpr (M <= 32) {
    return __shfl_sync(0xffffffffu, w_reg, gb >> SUB) + gb;
  } else {
    return tq_lds_at(s_w, (gb >> (SUB - 2)) & ((M - 1u) << 2)) + gb;
  }
}

// Codes of the N values of one column piece -> little-endian bit stream w; dot += <v, codebook[code]>
// (NC). For B = 1, 2, 4, 8 (whole bytes) the top bytes of 8/B-strided codes are gathered with prmt
// (byte k of r_i = code k * 8/B + i) and merged with shifted adds: about one op per code; other B:
// shift and or per code.
template <bool SLOW, int B, int CB, bool NC, int N>
TQ_DEVI void quantize_piece(const float (&v)[N], float a_row, float b_map, tq_u32 w_reg, float cb_reg,
                            const tq_u32* s_w, const tq_u32* s_g, const float* s_cb, float& dot,
                            tq_u32 (&w)[(N * B + 31) / 32]) {
  constexpr int NW = (N * B + 31) / 32;
  auto code_at = [&](int j) {
    const tq_u32 top = code_top<SLOW, B, CB>(v[j], a_row, b_map, w_reg, s_w, s_g);
    if constexpr (NC) {  // codebook[code]: lane code holds it (B <= 4), else byte offset 4 * code
      const float c = B <= 4 ? __shfl_sync(0xffffffffu, cb_reg, top >> 24)
                             : __uint_as_float(tq_lds_at(s_cb, (top >> 22) & 0x3FCu));
      dot = fmaf(v[j], c, dot);
    }
    return top;
  };
  if constexpr (8 % B == 0 && (N * B) % 8 == 0) {
    constexpr int CPB = 8 / B, NBY = N * B / 8;  // codes per byte, bytes (1, 2 or a multiple of 4)
    static_assert(NBY <= 2 || NBY % 4 == 0, "byte gather");
#pragma unroll
    for (int wi = 0; wi < NW; ++wi) {
      const int b0 = 4 * wi, nb = NBY - b0 < 4 ? NBY - b0 : 4;  // bytes of this word
      tq_u32 acc = 0u;
#pragma unroll
      for (int i = 0; i < CPB; ++i) {
        auto top = [&](int byte) { return code_at(byte * CPB + i); };
        tq_u32 r;  // byte k = code (b0 + k) * CPB + i; bytes past nb are ignored by the store
        if (nb == 1) {
          r = top(b0) >> 24;
        } else if (nb == 2) {
          r = tq_prmt(top(b0), top(b0 + 1), 0x0073u);
        } else {
          const tq_u32 lo = tq_prmt(top(b0), top(b0 + 1), 0x0073u);
          r = tq_prmt(lo, tq_prmt(top(b0 + 2), top(b0 + 3), 0x7300u), 0x7610u);
        }
        acc = i == 0 ? r : acc + (r << (i * B));  // codes < 2^B: fields never overlap
      }
      w[wi] = acc;
    }
  } else {
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = 0u;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const tq_u32 code = code_at(j) >> 24;
      const int bit = j * B;
      w[bit >> 5] |= code << (bit & 31);
      if ((bit & 31) + B > 32) w[(bit >> 5) + 1] |= code >> (32 - (bit & 31));
    }
  }
}
}  // namespace tqp

// x: [N, D] (IN: 0 fp32, 1 fp16, 2 bf16), row stride `x_stride` elements; signs: [ROUNDS, D] fp32 (+-1);
// thresholds: [2^B - 1] fp32 ascending; codebook: [2^B] fp32; codes: [N, D*B/8] uint8;
// norms: [N] fp16 (NBF: bf16). NC (norm correction, kvcodec.quant's default): store ||x|| / <y, c>
// (c = the chosen centroids) when that dot product is positive, so <x, x_hat> = ||x||^2.
// Launch: blocks of exactly 32 * tqp::WARPS = 256 threads, any grid: each warp strides over groups of
// Geo<D>::R rows.
template <int D, int B, int IN, bool NBF, int ROUNDS, bool NC>
__global__ void __launch_bounds__(256, tqp::min_blocks(IN, B, ROUNDS, NC)) tq_quant_pack(
    const void* __restrict__ x, long long x_stride, const float* __restrict__ signs,
    const float* __restrict__ thresholds, const float* __restrict__ codebook, int N, tq_u8* __restrict__ codes,
    tq_u16* __restrict__ norms) {
  using G_ = tqp::Geo<D>;
  constexpr int S = G_::S, LSEG = G_::LSEG, NG = G_::NG, CH = G_::CH, NCH = G_::NCH, R = G_::R;
  static_assert(B >= 1 && B <= 8, "bits in 1..8");
  static_assert(ROUNDS == 1 || ROUNDS == 2, "one or two Hadamard rounds");
  constexpr int NTH = (1 << B) - 1;
  constexpr int CB = B <= 5 ? B + 1 : B + 2;  // log2 of the number of cells M
  constexpr int M = 1 << CB, SUB = 23 - CB;
  constexpr tq_u32 HBITS = 0x4B000000u;  // bits of 2^23: g = HBITS + N
  constexpr bool X32 = IN == 0;
  constexpr int MASKS = X32 ? D : D / 2;  // sign masks: per coordinate (fp32) or per 16-bit pair
  constexpr int RB = D * B / 8;           // bytes per packed row
  constexpr bool PAIR = (2 * NG * B) % 8 != 0;  // D = 32 with odd B: two lanes share a byte-aligned piece
  // G levels done inside the mma (16-bit inputs): 2^FOLD mma per output group instead of FOLD add levels
  // (one: folding two or three levels costs as many register moves as it saves adds, in the SASS)
  constexpr int FOLD = X32 ? 0 : 1;

  __shared__ tq_u32 s_w[M];
  __shared__ tq_u32 s_g[NTH];
  __shared__ float s_cb[NC ? (1 << B) : 1];
  __shared__ __align__(16) tq_u32 s_m1[MASKS];
  __shared__ __align__(16) tq_u32 s_m2[ROUNDS == 2 ? D : 4];

  // ---- per block: the affine map of the search, the mapped thresholds, the cell table, sign masks ----
  const float t_lo = __ldg(thresholds), t_hi = __ldg(thresholds + NTH - 1);
  const float span = fmaxf(t_hi - t_lo, 4.f * rsqrtf((float)D));  // floor: a single threshold (B = 1)
  const float a_map = (float)(M - 3) / (span * (float)(M - 1));
  const float b_map = 0.5f - 0.5f * (t_lo + t_hi) * a_map;
  for (int i = threadIdx.x; i < NTH; i += blockDim.x) s_g[i] = tqp::gbits(__ldg(thresholds + i), a_map, b_map);
  if constexpr (NC)
    for (int i = threadIdx.x; i < (1 << B); i += blockDim.x) s_cb[i] = __ldg(codebook + i);
  for (int i = threadIdx.x; i < MASKS; i += blockDim.x) {
    if constexpr (X32) {
      s_m1[i] = __ldg(signs + i) < 0.f ? 0x80000000u : 0u;
    } else {
      s_m1[i] = (__ldg(signs + 2 * i) < 0.f ? 0x8000u : 0u) | (__ldg(signs + 2 * i + 1) < 0.f ? 0x80000000u : 0u);
    }
  }
  if constexpr (ROUNDS == 2)
    for (int i = threadIdx.x; i < D; i += blockDim.x) s_m2[i] = __ldg(signs + D + i) < 0.f ? 0x80000000u : 0u;
  __syncthreads();
  int multi = 0;  // some cell holds two thresholds: binary search instead of the table
  for (int c = threadIdx.x; c < M; c += blockDim.x) {
    auto first_at = [&](int cell) {  // #{thresholds in cells < cell}; s_g ascending
      int lo = 0, hi = NTH;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((int)((s_g[mid] - HBITS) >> SUB) < cell) lo = mid + 1;
        else hi = mid;
      }
      return lo;
    };
    const int base = first_at(c), cnt = first_at(c + 1) - base;
    multi |= cnt > 1;
    const tq_u32 pos = cnt ? (s_g[base] & ((1u << SUB) - 1u)) : (1u << SUB) - 1u;
    s_w[c] = ((tq_u32)base << 24) + (0xFFFFFFu - pos) - (HBITS + ((tq_u32)c << SUB));
  }
  const bool slow = __syncthreads_or(multi);
  const tq_u32 w_reg = s_w[((threadIdx.x & 31) - (int)(HBITS >> SUB)) & (M - 1)];  // M <= 32: the table by lane
  const float cb_reg = NC ? s_cb[threadIdx.x & ((1 << B) - 1) & 31] : 0.f;  // B <= 4: the codebook by lane

  // ---- per thread constants ----
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  tq_u32 afr[4];  // A = H16 with rows in rho order and columns in kappa order, +-1 in the mma's type
  {
    const tq_u32 one = IN == 1 ? 0x3C00u : 0x3F80u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rk = tqp::rho_of(g + 8 * (i & 1)), k = 2 * t + 8 * (i >> 1);
      const tq_u32 e0 = one | ((__popc(rk & tqp::kappa_of<CH>(k)) & 1) << 15);
      const tq_u32 e1 = one | ((__popc(rk & tqp::kappa_of<CH>(k + 1)) & 1) << 15);
      afr[i] = e0 | (e1 << 16);
    }
  }
  const tq_u32 afn[4] = {afr[0] ^ 0x80008000u, afr[1] ^ 0x80008000u, afr[2] ^ 0x80008000u, afr[3] ^ 0x80008000u};
  const int seg_in = g % S;  // this thread loads column g: row g / S of the warp's rows, segment g % S
  const bool vec_ok = ((reinterpret_cast<unsigned long long>(x) | (unsigned long long)x_stride * (X32 ? 4 : 2)) & 15) == 0;
  const float rs = ROUNDS == 2 ? 1.f / (float)D : 1.f / sqrtf((float)D);  // H H^T = D I per round
  const float a_rs = a_map * rs;
  const tq_u32* m1p = s_m1 + (seg_in * LSEG + t * 8) / (X32 ? 1 : 2);  // masks of chunk 0; chunk c: + 32c coords
  // running pointers: warp-row-group rg covers rows rg * R .. rg * R + R - 1
  const long long rg0 = (long long)blockIdx.x * tqp::WARPS + warp, rg_step = (long long)gridDim.x * tqp::WARPS;
  const char* xp = reinterpret_cast<const char*>(x) +
                   ((rg0 * R + g / S) * x_stride + seg_in * LSEG + t * 8) * (X32 ? 4 : 2);
  const long long x_step = rg_step * R * x_stride * (X32 ? 4 : 2);

  for (long long rg = rg0; rg * R < N; rg += rg_step, xp += x_step) {
    const long long row0 = rg * R;
    // ---- load the column, apply s1, transform kappa with the mma ----
    float v[2][2 * NG];  // [column 2t + col][e]: coordinate seg * LSEG + 2g * NG + e (e = mb * NG + G)
    {
      const bool ok = row0 + g / S < N;
      float acc[NG][4];
      if constexpr (!X32) {
        tq_u32 w[NCH][4];
        if (ok && vec_ok) {
#pragma unroll
          for (int c = 0; c < NCH; ++c) tqp::ldg16(w[c], xp + 64 * c);  // chunk c at coordinate (4c + t) * 8
        } else {
          const tq_u16* p = reinterpret_cast<const tq_u16*>(xp);
#pragma unroll
          for (int c = 0; c < NCH; ++c)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              w[c][r] = ok ? tq_pack2(__ldg(p + 32 * c + 2 * r), __ldg(p + 32 * c + 2 * r + 1)) : 0u;
        }
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
          const tqp::V4 m = reinterpret_cast<const tqp::V4*>(m1p)[4 * c];
          w[c][0] ^= m.x;
          w[c][1] ^= m.y;
          w[c][2] ^= m.z;
          w[c][3] ^= m.w;
        }
        tq_u32 bfr[NG][2];  // B fragments: k slots 2t, 2t + 1 and 2t + 8, 2t + 9 of column g, group G
#pragma unroll
        for (int G = 0; G < NG; ++G) {
          // slot s, group G sits in chunk s / CH, element (s % CH) * NG + G (the half of G's parity)
          auto reg = [&](int s) { return w[s / CH][((s % CH) * NG + G) >> 1]; };
          const tq_u32 sel = (G & 1) ? 0x7632u : 0x5410u;
          bfr[G][0] = tq_prmt(reg(0), reg(1), sel);
          bfr[G][1] = tq_prmt(reg(2), reg(3), sel);
        }
        // kappa transform with the low FOLD bits of G folded in: acc[G'] = sum over those bits of G of
        // (-1)^(G' & G) A B(G) (bits above FOLD: G = G'); the remaining G levels are adds below
#pragma unroll
        for (int Gp = 0; Gp < NG; ++Gp) {
          acc[Gp][0] = acc[Gp][1] = acc[Gp][2] = acc[Gp][3] = 0.f;
#pragma unroll
          for (int gl = 0; gl < (1 << FOLD); ++gl) {
            const int G = (Gp & ~((1 << FOLD) - 1)) | gl;
            if (__popc(Gp & gl) & 1) tq_mma16816<IN == 2>(acc[Gp], afn, bfr[G][0], bfr[G][1]);  // compile-time
            else tq_mma16816<IN == 2>(acc[Gp], afr, bfr[G][0], bfr[G][1]);
          }
        }
      } else {
        float xf[NCH][8];
        tq_u32 w0[NCH][4], w1[NCH][4];
        if (ok && vec_ok) {
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            tqp::ldg16(w0[c], xp + 128 * c);
            tqp::ldg16(w1[c], xp + 128 * c + 16);
          }
        } else {
          const float* p = reinterpret_cast<const float*>(xp);
#pragma unroll
          for (int c = 0; c < NCH; ++c)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              w0[c][r] = ok ? __float_as_uint(__ldg(p + 32 * c + r)) : 0u;
              w1[c][r] = ok ? __float_as_uint(__ldg(p + 32 * c + 4 + r)) : 0u;
            }
        }
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
          const tqp::V4 m0 = reinterpret_cast<const tqp::V4*>(m1p)[8 * c], m1 = reinterpret_cast<const tqp::V4*>(m1p)[8 * c + 1];
          xf[c][0] = __uint_as_float(w0[c][0] ^ m0.x);
          xf[c][1] = __uint_as_float(w0[c][1] ^ m0.y);
          xf[c][2] = __uint_as_float(w0[c][2] ^ m0.z);
          xf[c][3] = __uint_as_float(w0[c][3] ^ m0.w);
          xf[c][4] = __uint_as_float(w1[c][0] ^ m1.x);
          xf[c][5] = __uint_as_float(w1[c][1] ^ m1.y);
          xf[c][6] = __uint_as_float(w1[c][2] ^ m1.z);
          xf[c][7] = __uint_as_float(w1[c][3] ^ m1.w);
        }
#pragma unroll
        for (int G = 0; G < NG; ++G) {
          auto val = [&](int s) { return xf[s / CH][(s % CH) * NG + G]; };
          tq_u32 p0[3], p1[3];
          tqp::split3(val(0), val(1), p0);
          tqp::split3(val(2), val(3), p1);
          acc[G][0] = acc[G][1] = acc[G][2] = acc[G][3] = 0.f;
#pragma unroll
          for (int i = 2; i >= 0; --i) tq_mma16816<true>(acc[G], afr, p0[i], p1[i]);  // small parts first
        }
      }
#pragma unroll
      for (int G = 0; G < NG; ++G) {  // C[m][n]: rows g, g + 8 (mb 0, 1), columns 2t, 2t + 1
        v[0][G] = acc[G][0];
        v[1][G] = acc[G][1];
        v[0][NG + G] = acc[G][2];
        v[1][NG + G] = acc[G][3];
      }
    }
    // ---- the other levels of round 1: G in registers, segment bit 0 across the thread's two columns,
    // higher segment bits across t ----
    tqp::fwht_regs<1 << FOLD, NG>(v[0]);
    tqp::fwht_regs<1 << FOLD, NG>(v[1]);
    if constexpr (S >= 2) tqp::bfly_pair(v[0], v[1]);
#pragma unroll
    for (int sb = 1; (1 << sb) < S; ++sb) {  // segment bit sb = t bit sb - 1
      const int m = 1 << (sb - 1);
      const float sgn = (lane & m) ? -1.f : 1.f;
#pragma unroll
      for (int col = 0; col < 2; ++col)
#pragma unroll
        for (int e = 0; e < 2 * NG; ++e) v[col][e] = tqp::bfly_x(v[col][e], m, sgn);
    }
    // ||x||^2 = ||H x||^2 / D: the thread's outputs summed over g (S = 1: its two columns are two rows),
    // then over the row's segments (the two columns, then across t)
    float ss[2];
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      float a = 0.f;
#pragma unroll
      for (int e = 0; e < 2 * NG; ++e) a = fmaf(v[col][e], v[col][e], a);
      ss[col] = a;
    }
    if constexpr (S >= 2) {
      ss[0] = ss[1] = tqp::row_sum<S>(ss[0] + ss[1]) * (1.f / (float)D);
    } else {
      ss[0] = tqp::row_sum<S>(ss[0]) * (1.f / (float)D);
      ss[1] = tqp::row_sum<S>(ss[1]) * (1.f / (float)D);
    }
    // ---- round 2: s2, then all levels again: G and kappa bit 0 (e) and segment bit 0 (col) in
    // registers, kappa bits 1-3 across g, segment bits >= 1 across t ----
    if constexpr (ROUNDS == 2) {
#pragma unroll
      for (int col = 0; col < 2; ++col) {
        const int seg = (2 * t + col) % S;  // the thread's 2 * NG consecutive coordinates, 4 per load
        const tqp::V4* mp = reinterpret_cast<const tqp::V4*>(s_m2) + (seg * LSEG + 2 * g * NG) / 4;
#pragma unroll
        for (int q = 0; q < NG / 2; ++q) {
          const tqp::V4 m = mp[q];
          v[col][4 * q] = __uint_as_float(__float_as_uint(v[col][4 * q]) ^ m.x);
          v[col][4 * q + 1] = __uint_as_float(__float_as_uint(v[col][4 * q + 1]) ^ m.y);
          v[col][4 * q + 2] = __uint_as_float(__float_as_uint(v[col][4 * q + 2]) ^ m.z);
          v[col][4 * q + 3] = __uint_as_float(__float_as_uint(v[col][4 * q + 3]) ^ m.w);
        }
        tqp::fwht_regs<1, 2 * NG>(v[col]);
      }
      if constexpr (S >= 2) tqp::bfly_pair(v[0], v[1]);
#pragma unroll
      for (int lb = 0; lb < 3 + (S >= 4) + (S >= 8); ++lb) {
        const int m = lb < 3 ? 4 << lb : 1 << (lb - 3);  // g bits (kappa bits 1-3), then t bits
        const float sgn = (lane & m) ? -1.f : 1.f;
#pragma unroll
        for (int col = 0; col < 2; ++col)
#pragma unroll
          for (int e = 0; e < 2 * NG; ++e) v[col][e] = tqp::bfly_x(v[col][e], m, sgn);
      }
    }

    // ---- codes (y = v * rs / ||x|| is folded into the slope of the map), stored per column ----
    float inv[2], dot[2] = {0.f, 0.f};
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      inv[col] = ss[col] > 0.f ? rsqrtf(ss[col]) : 0.f;  // 1 / ||x|| (0 for a zero row: y = 0 then, like torch)
      tq_u32 pw[(2 * NG * B + 31) / 32];  // the thread's piece: 2 * NG codes, little-endian bits
      if (!slow)
        tqp::quantize_piece<false, B, CB, NC>(v[col], a_rs * inv[col], b_map, w_reg, cb_reg, s_w, s_g, s_cb, dot[col], pw);
      else
        tqp::quantize_piece<true, B, CB, NC>(v[col], a_rs * inv[col], b_map, w_reg, cb_reg, s_w, s_g, s_cb, dot[col], pw);
      const int n = 2 * t + col;
      const long long row = row0 + n / S;
      if constexpr (!PAIR) {
        if (row < N) tqp::store_piece<2 * NG * B / 8>(codes + row * RB + ((n % S) * LSEG + 2 * g * NG) * B / 8, pw);
      } else {  // 4B bits per lane (D = 32, odd B): the even lane of each pair writes both pieces (B bytes)
        const tq_u32 other = __shfl_down_sync(0xffffffffu, pw[0], 4);
        const tq_u32 both[2] = {pw[0] | (other << (4 * B)), other >> (32 - 4 * B)};
        if (row < N && (g & 1) == 0) tqp::store_piece<B>(codes + row * RB + g * B / 2, both);
      }
    }
    // ---- norms, by lane g = 0 of each row ----
    if constexpr (NC) {
      if constexpr (S >= 2) {
        dot[0] = dot[1] = tqp::row_sum<S>(dot[0] + dot[1]);
      } else {
        dot[0] = tqp::row_sum<S>(dot[0]);
        dot[1] = tqp::row_sum<S>(dot[1]);
      }
    }
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      const int n = 2 * t + col;
      const long long row = row0 + n / S;
      if (g == 0 && n % S == 0 && row < N) {
        const float nrm = sqrtf(ss[col]);
        float stored = nrm;
        if constexpr (NC) {
          const float d = dot[col] * rs * inv[col];  // <y, c> with y normalized
          stored = d > 0.f ? nrm / d : nrm;
        }
        norms[row] = tq_f_to_16<NBF>(stored);
      }
    }
  }
}
