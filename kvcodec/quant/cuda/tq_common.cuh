// Shared device helpers for the TurboQuant kernels (tq layout v1).
// No CUDA headers are included on purpose: the same text compiles through NVRTC (CuPy RawModule)
// and through nvcc (CI compile tests) without include paths. Half/bfloat16 values travel as raw
// 16-bit patterns and are converted with PTX.
#pragma once

#define TQ_DEVI __device__ __forceinline__

typedef unsigned int tq_u32;
typedef unsigned short tq_u16;
typedef unsigned char tq_u8;

TQ_DEVI tq_u16 tq_f2h(float f) { tq_u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
TQ_DEVI float tq_h2f(tq_u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
TQ_DEVI tq_u16 tq_f2bf(float f) { tq_u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
TQ_DEVI float tq_bf2f(tq_u16 h) { return __uint_as_float(((tq_u32)h) << 16); }

// 16-bit float pattern <-> float; BF selects bfloat16 instead of float16.
template <bool BF> TQ_DEVI float tq_16_to_f(tq_u16 h) { return BF ? tq_bf2f(h) : tq_h2f(h); }
template <bool BF> TQ_DEVI tq_u16 tq_f_to_16(float f) { return BF ? tq_f2bf(f) : tq_f2h(f); }

TQ_DEVI tq_u32 tq_pack2(tq_u16 lo, tq_u16 hi) { return (tq_u32)lo | ((tq_u32)hi << 16); }

// 2^x, approximate (one MUFU op); 2^-inf = 0.
TQ_DEVI float tq_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

// D += A * B for one m16n8k16 tile, float accumulators. A: 4 regs (row-major fragment), B: 2 regs.
template <bool BF>
TQ_DEVI void tq_mma16816(float (&c)[4], const tq_u32 (&a)[4], tq_u32 b0, tq_u32 b1) {
  if constexpr (BF) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Transpose of an 8x8 matrix of 16-bit values held in the mma fragment layout (lane 4i + j holds
// row i, columns 2j and 2j + 1): afterwards it holds row i, columns 2j, 2j + 1 of the transpose.
TQ_DEVI tq_u32 tq_movmatrix_t(tq_u32 x) {
  tq_u32 y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Load NBITS consecutive bits of a packed row starting at bit `start`, re-aligned so that bit 0 of
// w[0] is the first requested bit. Rows are little-endian bit streams whose start is 4-byte aligned
// (true for head_dim % 32 == 0), so they can be read as 32-bit words. Only words that hold
// requested bits are touched (never past the row's last byte). `valid == false` gives zeros.
template <int NBITS>
struct TqBits {
  static constexpr int NW = (NBITS + 31) / 32;
  tq_u32 w[NW + 1];  // one spare word keeps straddling field reads in range
};

// The 16/8-byte code loads are ld.global.nc.L1::no_allocate: streamed codes do not take L1 lines from
// the other warps (measured 8% faster than plain ld.global.nc on an H200; the L2::256B prefetch hint on
// top was measured and not adopted).
template <int NBITS, bool ALIGNED, int VEC = 1>
TQ_DEVI void tq_load_bits_at(TqBits<NBITS>& b, const tq_u32* __restrict__ p, int sh) {
  // p: the word holding the first requested bit; sh: that bit's position in it (0 when ALIGNED)
  constexpr int NW = TqBits<NBITS>::NW;
  b.w[NW] = 0u;
  if constexpr (ALIGNED && VEC == 4 && NW % 4 == 0) {  // caller guarantees 16-byte alignment
#pragma unroll
    for (int i = 0; i < NW; i += 4)
      asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(b.w[i]), "=r"(b.w[i + 1]), "=r"(b.w[i + 2]), "=r"(b.w[i + 3]) : "l"(p + i));
  } else if constexpr (ALIGNED && VEC >= 2 && NW % 2 == 0) {  // 8-byte alignment
#pragma unroll
    for (int i = 0; i < NW; i += 2)
      asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(b.w[i]), "=r"(b.w[i + 1]) : "l"(p + i));
  } else if constexpr (ALIGNED) {
#pragma unroll
    for (int i = 0; i < NW; ++i) b.w[i] = __ldg(p + i);
  } else {
    tq_u32 raw[NW + 1];
#pragma unroll
    for (int i = 0; i < NW; ++i) raw[i] = __ldg(p + i);
    raw[NW] = (sh + NBITS > NW * 32) ? __ldg(p + NW) : 0u;
#pragma unroll
    for (int i = 0; i < NW; ++i) b.w[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
  }
}

template <int NBITS, bool ALIGNED, int VEC = 1>
TQ_DEVI void tq_load_bits(TqBits<NBITS>& b, const tq_u32* __restrict__ row, int start, bool valid) {
  constexpr int NW = TqBits<NBITS>::NW;
  if (!valid) {
#pragma unroll
    for (int i = 0; i <= NW; ++i) b.w[i] = 0u;
    return;
  }
  tq_load_bits_at<NBITS, ALIGNED, VEC>(b, row + (start >> 5), start & 31);
}

// The W-bit field at bit position P of the re-aligned words (P, W compile-time after unrolling).
template <int W, int NBITS>
TQ_DEVI tq_u32 tq_field(const TqBits<NBITS>& b, int p) {
  const int i = p >> 5, s = p & 31;
  const tq_u32 mask = (W >= 32) ? 0xffffffffu : ((1u << W) - 1u);
  if (s + W <= 32) return (b.w[i] >> s) & mask;
  return __funnelshift_r(b.w[i], b.w[i + 1], s) & mask;
}

// The same field shifted left by SH (a ready-made byte offset into a table of 2^SH-byte entries):
// one shift + one mask when the field does not straddle a word.
template <int W, int SH, int NBITS>
TQ_DEVI tq_u32 tq_field_off(const TqBits<NBITS>& b, int p) {
  const int i = p >> 5, s = p & 31;
  const tq_u32 mask = ((1u << W) - 1u) << SH;
  if (s + W <= 32) {
    if (s >= SH) return (b.w[i] >> (s - SH)) & mask;
    return (b.w[i] << (SH - s)) & mask;
  }
  return (__funnelshift_r(b.w[i], b.w[i + 1], s) << SH) & mask;
}

// 32-bit shared-memory word at a byte offset from a table base.
TQ_DEVI tq_u32 tq_lds_at(const void* base, tq_u32 off) {
  return *reinterpret_cast<const tq_u32*>(reinterpret_cast<const char*>(base) + off);
}

// prmt.b32 in its default mode: byte n of the result is byte (c >> 4n) & 7 of {b, a} (a = bytes
// 0-3); only c[15:0] is used. Selector nibbles with bit 3 set would replicate a sign bit instead; the
// callers never build such nibbles. Inline PTX on purpose: __byte_perm() is specified to ignore bit
// 3 and may cost an extra mask.
TQ_DEVI tq_u32 tq_prmt(tq_u32 a, tq_u32 b, tq_u32 c) {
  tq_u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The first 4 * W codebook entries as 16-bit floats in W register pairs of byte planes: byte j of
// lo[i] / hi[i] is the low / high byte of entry 4i + j (the prmt tables below).
template <bool BF, int W>
TQ_DEVI void tq_byte_planes(const float* __restrict__ cb, tq_u32 (&lo)[W], tq_u32 (&hi)[W]) {
#pragma unroll
  for (int i = 0; i < W; ++i) {
    tq_u32 l = 0u, h = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const tq_u32 e = tq_f_to_16<BF>(__ldg(cb + 4 * i + j));
      l |= (e & 0xFFu) << (8 * j);
      h |= (e >> 8) << (8 * j);
    }
    lo[i] = l;
    hi[i] = h;
  }
}

// A 16-entry table of 16-bit values (4-bit codebook, fp16 or bf16 patterns) held in 8 registers as
// two byte planes: lo[i] byte j = low byte of entry 4i + j, hi[i] the high bytes. Lookup of four
// 4-bit codes (one 16-bit half of a packed word, code k in bits 4k..4k+3) without shared memory:
//   level 1: sel = codes & 0x7777 picks entry (c & 7) from entries 0-7 (lo[0], lo[1]) and from
//            entries 8-15 (lo[2], lo[3]), per plane: 4 prmt;
//   level 2: sel2 nibble k = k + 4 * bit3(c_k) picks, per code, the right one of the two: 2 prmt;
//   interleave the planes into two packed pairs (c0, c1), (c2, c3): 2 prmt.
// Both selectors of a whole 32-bit word (8 codes) cost 3 ops (one LOP3, one shift + LOP3).
// tests/test_cuda_build.py emulates this bit for bit.
struct TqRegLut4 {
  tq_u32 lo[4], hi[4];
  template <bool BF>
  TQ_DEVI void fill(const float* __restrict__ cb) { tq_byte_planes<BF, 4>(cb, lo, hi); }
  // selectors of the 8 codes of a word: a = level 1 (low half: codes 0-3), s2 = level 2
  TQ_DEVI static tq_u32 sel1(tq_u32 x) { return x & 0x77777777u; }
  TQ_DEVI static tq_u32 sel2(tq_u32 x) { return ((x >> 1) & 0x44444444u) | 0x32103210u; }
  // four codes (selectors in the low 16 bits) -> o0 = (c0, c1), o1 = (c2, c3) packed 16-bit pairs
  TQ_DEVI void lut4(tq_u32 a, tq_u32 s2, tq_u32& o0, tq_u32& o1) const {
    const tq_u32 l = tq_prmt(tq_prmt(lo[0], lo[1], a), tq_prmt(lo[2], lo[3], a), s2);
    const tq_u32 h = tq_prmt(tq_prmt(hi[0], hi[1], a), tq_prmt(hi[2], hi[3], a), s2);
    o0 = tq_prmt(l, h, 0x5140u);
    o1 = tq_prmt(l, h, 0x7362u);
  }
  // all 8 codes of a word: o[0] = (c0, c1), o[1] = (c2, c3), o[2] = (c4, c5), o[3] = (c6, c7)
  TQ_DEVI void lut8(tq_u32 x, tq_u32 (&o)[4]) const {
    const tq_u32 a = sel1(x), s2 = sel2(x);
    lut4(a, s2, o[0], o[1]);
    lut4(a >> 16, s2 >> 16, o[2], o[3]);
  }
};

// Symmetric 4-bit codebooks (bitwise cb16[15 - i] == cb16[i] ^ 0x8000, true for the Lloyd-Max
// codebooks in fp16 and bf16; the launcher checks and otherwise builds without TQ_REG_LUT_SYM): only
// entries 0-7 are stored (4 registers). Code c >= 8 reads entry 15 - c with the sign flipped:
//   sel  = (x ^ 7 * bit3) & 0x7777        (per nibble: c & 7, or 7 - (c & 7) when bit 3 is set)
//   S    = prmt sign-replicate of bit 3   (0xFF in byte k when code k has bit 3 set)
//   hi  ^= S & 0x80808080
// 16 ALU ops per 8 codes instead of 21 (4 + 4 prmt lookups/interleaves per half, 2 sign prmt).
struct TqRegLut4Sym {
  tq_u32 lo[2], hi[2];
  template <bool BF>
  TQ_DEVI void fill(const float* __restrict__ cb) { tq_byte_planes<BF, 2>(cb, lo, hi); }
  TQ_DEVI void lut8(tq_u32 x, tq_u32 (&o)[4]) const {
    const tq_u32 a = (x ^ (((x >> 3) & 0x11111111u) * 7u)) & 0x77777777u;
    const tq_u32 xs = x << 4;
    const tq_u32 s_lo = tq_prmt(xs, x, 0xD9C8u);  // codes 0-3: bit 3 of nibble k -> byte k
    const tq_u32 s_hi = tq_prmt(xs, x, 0xFBEAu);  // codes 4-7
    const tq_u32 a_hi = a >> 16;
    const tq_u32 l0 = tq_prmt(lo[0], lo[1], a), h0 = tq_prmt(hi[0], hi[1], a) ^ (s_lo & 0x80808080u);
    const tq_u32 l1 = tq_prmt(lo[0], lo[1], a_hi), h1 = tq_prmt(hi[0], hi[1], a_hi) ^ (s_hi & 0x80808080u);
    o[0] = tq_prmt(l0, h0, 0x5140u);
    o[1] = tq_prmt(l0, h0, 0x7362u);
    o[2] = tq_prmt(l1, h1, 0x5140u);
    o[3] = tq_prmt(l1, h1, 0x7362u);
  }
};

// Lane-private pair tables (the one-launch kernel's TQ_LANE_LUT builds, 4-bit codes). A shared-memory table
// of the 256 code pairs in which every lane has its own copy in its own bank: row e (256 bytes) holds
// pair e (cb[e & 15] low half, cb[e >> 4] high half) at bytes 4 * lane (table A) and 128 + 4 * lane
// (table B). Lookups never conflict on banks (a shared 256-word table: ~3.5-way conflicts for random
// codes), and the byte offset of pair e is e * 256 + 4 * lane: one prmt that puts byte k of the codes
// word x (two adjacent 4-bit codes) over the lane byte `lanec` (= 4 * lane, bytes 1-3 zero).
// tab: the table (a __shared__ array, referenced directly so that the compiler addresses it as
// [offset + uniform base]); k (0-3) a compile-time constant after unrolling (an immediate selector).
TQ_DEVI tq_u32 tq_lane_pair(const char* tab, tq_u32 x, tq_u32 lanec, int k) {
  return tq_lds_at(tab, tq_prmt(x, lanec, 0x5504u | ((tq_u32)k << 4)));
}
