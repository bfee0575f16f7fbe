// Fused decode attention on a TurboQuant-compressed KV cache (tq layout v1), flash-decoding style.
//
// Kernel 1 (tq_decode_split): one warp owns one (sequence, kv head, 16-row query tile, token split).
// Per 16-token step it loads the packed key codes, value codes and norms straight from the cache,
// dequantizes them in registers into tensor-core fragments (4-bit keys: a register codebook read
// with prmt; other codes: a shared-memory table) and runs, for "narrow" tiles (<= 8 query rows, e.g.
// a GQA group of <= 8 heads at q_len 1, the decode case):
//   S^T = K_rot Q_rot^T          (mma.sync m16n8k16: the 16 tokens are the A rows, the query rows
//                                 the 8 B columns; fp16 in, fp32 out; key norms applied in fp32)
//   online softmax (base 2), P^T transposed to the B layout with movmatrix
//   O^T += V_rot^T (P * value_norms)^T   (values as the A operand, fp32 accumulators)
// and for wide tiles (9-16 rows) the same with S = Q K^T and O += P V. All query heads of a GQA
// group (times q_len) share each loaded K/V byte. Partial (O, m, l) go to scratch; kernel 2
// (tq_decode_merge) merges the splits with a log-sum-exp and applies the inverse rotation once per
// output row. Measured design choices (H200): docs/cuda.md and CHANGELOG.md.
//
// Dimension bookkeeping. The mma k index is a permutation of the head dimension chosen so that each
// thread reads a contiguous run of codes: thread t (= lane % 4) of a key row owns coordinates
// [t*D/4, (t+1)*D/4); at k-step s its B registers hold its coordinates 4s..4s+3. The launcher
// permutes the query the same way (decode_attention.key_permutation). For values, thread g
// (= lane / 4) owns dims [g*D/8, (g+1)*D/8); n-tile i column g is dim g*D/8 + i.
#include "tq_common.cuh"

// 1: the 4-bit key codebook in registers uses the codebook's sign symmetry (TqRegLut4Sym: 4 registers
// per table, ~25% fewer ALU ops per code than TqRegLut4). Only valid for codebooks with
// cb16[15 - i] == -cb16[i] bitwise: the launcher checks each codebook and sets -DTQ_REG_LUT_SYM=1
// only then (decode_kernels.split_defines).
#ifndef TQ_REG_LUT_SYM
#define TQ_REG_LUT_SYM 0
#endif

namespace tq {

// Codebook tables in shared memory: codes are looked up two at a time in a 2^(2b)-entry table of
// packed pairs (256 words at b = 4; 4-byte entries make a shifted and masked code pair the byte
// offset). `single` holds the codes one at a time; it is filled but not read by the lookups below.
template <int BITS, bool BF>
struct CodeTable {
  static constexpr int N1 = 1 << BITS;
  static constexpr int N2 = 1 << (2 * BITS);
  tq_u32 single[N1];  // 16-bit value in the low half
  tq_u32 pair[N2];    // (lo, hi) packed

  TQ_DEVI void fill(const float* __restrict__ cb, int tid, int nthreads) {
    for (int i = tid; i < N1; i += nthreads) single[i] = tq_f_to_16<BF>(cb[i]);
    for (int i = tid; i < N2; i += nthreads)
      pair[i] = tq_pack2(tq_f_to_16<BF>(cb[i & (N1 - 1)]), tq_f_to_16<BF>(cb[i >> BITS]));
  }
  // Packed pair of dequantized codes at bit positions p (lo) and p + BITS (hi) of one row chunk.
  template <int NB>
  TQ_DEVI tq_u32 adjacent(const TqBits<NB>& b, int p) const {
    return tq_lds_at(pair, tq_field_off<2 * BITS, 2>(b, p));
  }
  // 4-bit codes of two rows a (lo) and b (hi) -> words whose byte k is the pair index of coordinate
  // 8i + 2k (ev[i]) or 8i + 2k + 1 (od[i]): two ops per word instead of per coordinate.
  template <int NB>
  TQ_DEVI static void interleave4(const TqBits<NB>& a, const TqBits<NB>& b, tq_u32* ev, tq_u32* od) {
#pragma unroll
    for (int i = 0; i < TqBits<NB>::NW; ++i) {
      ev[i] = (a.w[i] & 0x0F0F0F0Fu) | ((b.w[i] << 4) & 0xF0F0F0F0u);
      od[i] = ((a.w[i] >> 4) & 0x0F0F0F0Fu) | (b.w[i] & 0xF0F0F0F0u);
    }
  }
  // Pair of coordinate c (compile-time) from interleave4 words.
  TQ_DEVI tq_u32 interleaved(const tq_u32* ev, const tq_u32* od, int c) const {
    const tq_u32 x = (c & 1) ? od[c >> 3] : ev[c >> 3];
    const int k = (c >> 1) & 3;
    return tq_lds_at(pair, k ? ((x >> (8 * k - 2)) & 0x3FCu) : ((x << 2) & 0x3FCu));
  }
  // Packed pair of the codes at bit position p of two different rows (lo from a, hi from b).
  template <int NB>
  TQ_DEVI tq_u32 across(const TqBits<NB>& a, const TqBits<NB>& b, int p) const {
    return tq_lds_at(pair, tq_field_off<BITS, 2>(a, p) | tq_field_off<BITS, 2 + BITS>(b, p));
  }
};

// Online softmax, one row: the running max m takes the step's max mx; returns the factor
// exp2(m_old - m_new) for what was accumulated so far, and in mu the max to subtract from this
// step's logits (0 while the row has seen only masked tokens: no inf - inf).
TQ_DEVI float update_max(float& m, float mx, float& mu) {
  const float mn = fmaxf(m, mx);
  mu = (mn == -__int_as_float(0x7f800000)) ? 0.f : mn;
  const float alpha = tq_exp2(m - mu);
  m = mn;
  return alpha;
}

// Online-softmax rescale of mma accumulators: element e of every fragment times f[e].
template <int N>
TQ_DEVI void rescale(float (&acc)[N][4], float f0, float f1, float f2, float f3) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    acc[i][0] *= f0;
    acc[i][1] *= f1;
    acc[i][2] *= f2;
    acc[i][3] *= f3;
  }
}

// +-1 as 16-bit floats from QJL sign bits (bit 1 = +1).
TQ_DEVI tq_u32 qjl_pair(tq_u32 two_bits) {
  const tq_u32 lo = 0x3C00u | (((two_bits & 1u) ^ 1u) << 15);
  const tq_u32 hi = 0x3C00u | ((((two_bits >> 1) & 1u) ^ 1u) << 15);
  return lo | (hi << 16);
}

template <int D, int BK, int BV, bool KBF, bool VBF, bool QJL>
struct DecodeTraits {
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head_dim must be a multiple of 32 in [32, 256]");
  static_assert(BK >= 1 && BK <= 4 && BV >= 1 && BV <= 4, "bits must be in 1..4");
  static constexpr int KS = D / 16;                 // k-steps of Q K^T
  static constexpr int NT = D / 8;                  // n-tiles of P V
  static constexpr int CK = D / 4;                  // key coordinates per thread per token
  static constexpr int CV = D / 8;                  // value dims per thread per token
  static constexpr int KBITS = CK * BK;             // bits per thread of one key row
  static constexpr int VBITS = CV * BV;             // bits per thread of one value row
  static constexpr int QBITS = CK;                  // QJL bits per thread of one key row (m = D)
  static constexpr bool KALIGN = KBITS % 32 == 0;
  static constexpr bool VALIGN = VBITS % 32 == 0;
  static constexpr bool QALIGN = QBITS % 32 == 0;
  static constexpr int KROW_WORDS = D * BK / 32;    // packed row length in 32-bit words
  static constexpr int VROW_WORDS = D * BV / 32;
  static constexpr int QROW_WORDS = D / 32;
  // vector load width (words) for a thread's chunk, 16 or 8 bytes where the chunks and rows stay
  // aligned (the launcher makes the code tensors 16-byte aligned)
  static constexpr int KVEC = !KALIGN ? 1
                              : ((KBITS / 32) % 4 == 0 && KROW_WORDS % 4 == 0) ? 4
                              : ((KBITS / 32) % 2 == 0 && KROW_WORDS % 2 == 0) ? 2 : 1;
  static constexpr int VVEC = !VALIGN ? 1
                              : ((VBITS / 32) % 4 == 0 && VROW_WORDS % 4 == 0) ? 4
                              : ((VBITS / 32) % 2 == 0 && VROW_WORDS % 2 == 0) ? 2 : 1;
  // 4-bit values: the pair-table offsets of a whole word pair built with nibble masks (interleave4)
  static constexpr bool V4I = BV == 4 && VALIGN;
  // 4-bit keys: looked up in a register codebook with prmt (RegLut), no shared-memory load
  static constexpr bool KREG = BK == 4 && KALIGN;
};

// Raw (not yet dequantized) bytes of one 16-token step, held by one thread.
template <class T>
struct StepRegs {
  TqBits<T::KBITS> k[2];     // key tokens g and 8 + g, coordinates of thread t
  TqBits<T::VBITS> v[4];     // value tokens 2t, 2t+1, 2t+8, 2t+9, dims of thread g
  TqBits<T::QBITS> s[2];     // QJL sign bits (prod keys only; unused otherwise)
  tq_u16 kn[4], vn[4], rn[4];  // norms of tokens 2t, 2t+1, 2t+8, 2t+9
};

// Per-thread pointers, computed once: each points at this thread's first word / norm of token 0.
template <class T>
struct LanePtrs {
  const tq_u32* k;   // key row g, chunk of thread t
  const tq_u32* v;   // value row 2t, chunk of thread g
  const tq_u32* q;   // QJL bits row g, chunk of thread t
  const tq_u16* kn;  // norms of token 2t
  const tq_u16* vn;
  const tq_u16* rn;
  int ksh, vsh, qsh;  // bit offset of the chunk inside its first word (0 when aligned)
  int g, t;
};

// Loads of one 16-token step starting at `base`. FULL (base + 16 <= end): every address is a base
// pointer plus a compile-time offset. Otherwise tokens past `end` read the last valid token instead
// (their keys are masked to -inf later) and get value norm 0, so slots past the sequence never reach
// the output whatever they hold. Loads are unconditional: no branches, so they batch.
// KA (keys as the A operand): the norms are those of tokens g and 8 + g (slots 0, 1), not 2t, ...
template <class T, bool QJL, bool FULL, bool KA>
TQ_DEVI void load_step(StepRegs<T>& r, int base, int end, const LanePtrs<T>& L) {
  const int last = end - 1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int rel = FULL ? base + 8 * j : min(base + 8 * j, last - L.g);  // token - g
    tq_load_bits_at<T::KBITS, T::KALIGN, T::KVEC>(r.k[j], L.k + rel * T::KROW_WORDS, L.ksh);
    if constexpr (QJL) tq_load_bits_at<T::QBITS, T::QALIGN>(r.s[j], L.q + rel * T::QROW_WORDS, L.qsh);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int off = (j & 1) + 8 * (j >> 1);
    const int rel = FULL ? base + off : min(base + off, last - 2 * L.t);  // token - 2t
    tq_load_bits_at<T::VBITS, T::VALIGN, T::VVEC>(r.v[j], L.v + rel * T::VROW_WORDS, L.vsh);
    if constexpr (!KA) {
      r.kn[j] = __ldg(L.kn + rel);
      const tq_u16 vnv = __ldg(L.vn + rel);
      r.vn[j] = (FULL || base + off + 2 * L.t <= last) ? vnv : (tq_u16)0;  // masked: value norm 0
      if constexpr (QJL) r.rn[j] = __ldg(L.rn + rel);
    }
  }
  if constexpr (KA) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int rel = FULL ? base + 8 * j : min(base + 8 * j, last - L.g);  // token - g
      r.kn[j] = __ldg(L.kn + rel);
      const tq_u16 vnv = __ldg(L.vn + rel);
      r.vn[j] = (FULL || base + 8 * j + L.g <= last) ? vnv : (tq_u16)0;
      if constexpr (QJL) r.rn[j] = __ldg(L.rn + rel);
    }
  }
}

// Move every pointer of L by n tokens (the split loop's running pointers).
template <class T, bool QJL>
TQ_DEVI void advance(LanePtrs<T>& L, int n) {
  L.k += n * T::KROW_WORDS;
  L.v += n * T::VROW_WORDS;
  L.kn += n;
  L.vn += n;
  if constexpr (QJL) {
    L.q += n * T::QROW_WORDS;
    L.rn += n;
  }
}

#if TQ_REG_LUT_SYM
typedef TqRegLut4Sym RegLut;
#else
typedef TqRegLut4 RegLut;
#endif

// The one-launch kernel's dynamic shared memory: the lane-private pair tables (64 KB in the builds
// with TQ_LANE_LUT, else none).
extern __shared__ __align__(16) char tq_lane_tab[];

// What one warp's split leaves in registers: the unnormalized partial output (mma accumulator
// layout, see split_warp) and, per owned query row, the running max m (base 2) and the sum l.
template <int D, bool NARROW>
struct WarpResult {
  static constexpr int NACC = NARROW ? D / 16 : D / 8;
  float acc[NACC][4];
  float m0, m1, l0, l1;  // rows (2t, 2t + 1) of the tile for NARROW, rows (g, g + 8) otherwise
};

// One warp's work of a split: tokens [begin, end) of the kv row starting at token tok0 (= bh * Tcap)
// against a 16-row query tile. q16t [16, D] fp16 (rotated, key-permuted, divided by each row's max
// |.|; pad rows 0), rst [16] the row scales; qs16t / qsst the QJL analogues (prod keys only). The
// block's shared and register codebook tables must be filled. Empty ranges (begin >= end) give
// m = -inf, l = 0 and zero accumulators. DEPTH: 16-token steps whose loads are issued before the
// first of them is consumed (a register ring; prod keys take 2). The split kernel takes 1 (loads at
// the top of each step, latency covered by the other warps: measured fastest on an H200, where the
// loop is issue and dependency bound; deeper rings were slower), the one-launch kernel TQ_FUSED_STAGES.
// LANE: 4-bit keys and values are looked up in the lane-private pair tables tq_lane_tab (keys: table
// A, values: table B; see tq_lane_pair) instead of ktab / kreg and vtab, which are then unused (KTab /
// VTab may be empty types).
template <int D, int BK, int BV, bool KBF, bool VBF, bool QJL, bool NARROW, int DEPTH = 1, bool LANE = false,
          class KTab, class VTab>
TQ_DEVI void split_warp(WarpResult<D, NARROW>& res, const KTab& ktab, const VTab& vtab, const RegLut& kreg,
                        const tq_u16* q16t, const float* rst, const tq_u16* qs16t, const float* qsst,
                        const tq_u8* __restrict__ kcodes, const tq_u16* __restrict__ knorms,
                        const tq_u8* __restrict__ vcodes, const tq_u16* __restrict__ vnorms,
                        const tq_u8* __restrict__ qjl, const tq_u16* __restrict__ rnorms, long long tok0, int begin,
                        int end) {
  using T = DecodeTraits<D, BK, BV, KBF, VBF, QJL>;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  static_assert(!LANE || (NARROW && !QJL && BK == 4 && BV == 4 && T::KALIGN && T::VALIGN),
                "lane tables: narrow tiles of 4-bit MSE keys and values with word-aligned chunks");
  const tq_u32 lanec = 4u * lane;  // the lane byte of the lane-table offsets

  // Query fragments (A operand), one set per k-step.
  const tq_u16* qrow0 = q16t + g * D;
  const tq_u16* qrow1 = qrow0 + 8 * D;
  tq_u32 qa[T::KS][4];
#pragma unroll
  for (int s = 0; s < T::KS; ++s) {
    qa[s][0] = *reinterpret_cast<const tq_u32*>(qrow0 + 16 * s + 2 * t);
    qa[s][1] = NARROW ? 0u : *reinterpret_cast<const tq_u32*>(qrow1 + 16 * s + 2 * t);
    qa[s][2] = *reinterpret_cast<const tq_u32*>(qrow0 + 16 * s + 2 * t + 8);
    qa[s][3] = NARROW ? 0u : *reinterpret_cast<const tq_u32*>(qrow1 + 16 * s + 2 * t + 8);
  }
  tq_u32 sa[QJL ? T::KS : 1][4];
  float qjl_scale0 = 0.f, qjl_scale1 = 0.f;
  if constexpr (QJL) {
    const tq_u16* srow0 = qs16t + g * D;
    const tq_u16* srow1 = srow0 + 8 * D;
#pragma unroll
    for (int s = 0; s < T::KS; ++s) {
      sa[s][0] = *reinterpret_cast<const tq_u32*>(srow0 + 16 * s + 2 * t);
      sa[s][1] = NARROW ? 0u : *reinterpret_cast<const tq_u32*>(srow1 + 16 * s + 2 * t);
      sa[s][2] = *reinterpret_cast<const tq_u32*>(srow0 + 16 * s + 2 * t + 8);
      sa[s][3] = NARROW ? 0u : *reinterpret_cast<const tq_u32*>(srow1 + 16 * s + 2 * t + 8);
    }
    qjl_scale0 = qsst[NARROW ? 2 * t : g];
    qjl_scale1 = qsst[NARROW ? 2 * t + 1 : g + 8];
  }
  // narrow tiles: this thread's score columns are rows 2t and 2t + 1 (of the 8 rows), not g, g + 8
  constexpr bool KA = NARROW;
  const int srow0 = KA ? 2 * t : g, srow1 = KA ? 2 * t + 1 : g + 8;
  const float rs0 = rst[srow0];
  const float rs1 = rst[srow1];

  LanePtrs<T> L;
  L.g = g;
  L.t = t;
  L.ksh = (t * T::KBITS) & 31;
  L.vsh = (g * T::VBITS) & 31;
  L.qsh = (t * T::QBITS) & 31;
  L.k = reinterpret_cast<const tq_u32*>(kcodes) + (tok0 + g) * T::KROW_WORDS + ((t * T::KBITS) >> 5);
  L.v = reinterpret_cast<const tq_u32*>(vcodes) + (tok0 + 2 * t) * T::VROW_WORDS + ((g * T::VBITS) >> 5);
  L.kn = knorms + tok0 + (KA ? g : 2 * t);
  L.vn = vnorms + tok0 + (KA ? g : 2 * t);
  L.q = QJL ? reinterpret_cast<const tq_u32*>(qjl) + (tok0 + g) * T::QROW_WORDS + ((t * T::QBITS) >> 5) : nullptr;
  L.rn = QJL ? rnorms + tok0 + (KA ? g : 2 * t) : nullptr;

  // Accumulators: NARROW: acc[mt] = O^T tile of dims (16 mt + g, 16 mt + g + 8) x rows (2t, 2t+1),
  // dims being the thread-chunk coordinates 2mt / 2mt+1 (dim CV*g + 2mt + {0,1}); otherwise
  // acc[i] = O tile of rows (g, g+8) x n-tile i, columns 2t, 2t+1 (dims CV*(2t+e) + i).
  constexpr int NACC = WarpResult<D, NARROW>::NACC;
  float (&acc)[NACC][4] = res.acc;
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const float NEG_INF = -__int_as_float(0x7f800000);
  float &m0 = res.m0, &m1 = res.m1, &l0 = res.l0, &l1 = res.l1;
  m0 = m1 = NEG_INF;
  l0 = l1 = 0.f;

  constexpr int STAGES = QJL ? 2 : DEPTH;  // prod keys: more regs
  StepRegs<T> ring[STAGES];
  // O^T += V^T P^T for narrow tiles: A = values (dims x the 16 tokens), B = P^T fragments pb0 (row g |
  // tokens 2t, 2t+1) and pb1 (tokens 8 + 2t, 8 + 2t + 1), value norms already applied
  auto pv_narrow = [&](float (&acc)[NACC][4], const StepRegs<T>& cur, tq_u32 pb0, tq_u32 pb1) {
    if constexpr (NARROW) {
      if constexpr (LANE) {
        // interleaved words as for T::V4I: byte k of ev[i] / od[i] is the pair index of coordinate
        // 8i + 2k / 8i + 2k + 1 of the two tokens; looked up in table B (byte 128 of each row)
        constexpr int NW = TqBits<T::VBITS>::NW;
        tq_u32 ev01[NW], od01[NW], ev23[NW], od23[NW];
        CodeTable<BV, VBF>::interleave4(cur.v[0], cur.v[1], ev01, od01);
        CodeTable<BV, VBF>::interleave4(cur.v[2], cur.v[3], ev23, od23);
        const char* vt = tq_lane_tab + 128;
#pragma unroll
        for (int i = 0; i < NW; ++i) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const tq_u32 va[4] = {tq_lane_pair(vt, ev01[i], lanec, k), tq_lane_pair(vt, od01[i], lanec, k),
                                  tq_lane_pair(vt, ev23[i], lanec, k), tq_lane_pair(vt, od23[i], lanec, k)};
            tq_mma16816<VBF>(acc[4 * i + k], va, pb0, pb1);
          }
        }
      } else if constexpr (T::V4I) {
        constexpr int NW = TqBits<T::VBITS>::NW;
        tq_u32 ev01[NW], od01[NW], ev23[NW], od23[NW];
        vtab.interleave4(cur.v[0], cur.v[1], ev01, od01);
        vtab.interleave4(cur.v[2], cur.v[3], ev23, od23);
#pragma unroll
        for (int mt = 0; mt < NACC; ++mt) {
          const tq_u32 va[4] = {vtab.interleaved(ev01, od01, 2 * mt), vtab.interleaved(ev01, od01, 2 * mt + 1),
                                vtab.interleaved(ev23, od23, 2 * mt), vtab.interleaved(ev23, od23, 2 * mt + 1)};
          tq_mma16816<VBF>(acc[mt], va, pb0, pb1);
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < NACC; ++mt) {
          const tq_u32 va[4] = {vtab.across(cur.v[0], cur.v[1], (2 * mt) * BV),
                                vtab.across(cur.v[0], cur.v[1], (2 * mt + 1) * BV),
                                vtab.across(cur.v[2], cur.v[3], (2 * mt) * BV),
                                vtab.across(cur.v[2], cur.v[3], (2 * mt + 1) * BV)};
          tq_mma16816<VBF>(acc[mt], va, pb0, pb1);
        }
      }
    }
  };
  // one 16-token step into the online-softmax state st (called with res)
  auto step_on = [&](WarpResult<D, NARROW>& st, const StepRegs<T>& cur, int base) {
    float (&acc)[NACC][4] = st.acc;
    float &m0 = st.m0, &m1 = st.m1, &l0 = st.l0, &l1 = st.l1;
    if constexpr (KA) {
      // ---- S^T (16 tokens x 8 rows) = K Q^T: A = keys (slot g = token base + g, slot g + 8 =
      // token base + 8 + g), B = query rows; s4 = (slot g | rows 2t, 2t+1), (slot g + 8 | same rows)
      // two accumulators (even / odd k-steps): two mma dependency chains of KS / 2 instead of one of KS
      float s4[2][4] = {}, q4[2][4] = {};
      tq_u32 kw0[4], kw1[4];  // KREG: the 8 codes of word s / 2 of both key rows, looked up per word
#pragma unroll
      for (int s = 0; s < T::KS; ++s) {
        tq_u32 ka[4];
        if constexpr (LANE) {  // table A: word s / 2 of both key rows, byte k = pair (4s' + 2k, + 1)
          if ((s & 1) == 0) {
            const tq_u32 w0 = cur.k[0].w[s >> 1], w1 = cur.k[1].w[s >> 1];
            kw0[0] = tq_lane_pair(tq_lane_tab, w0, lanec, 0), kw1[0] = tq_lane_pair(tq_lane_tab, w1, lanec, 0);
            kw0[1] = tq_lane_pair(tq_lane_tab, w0, lanec, 1), kw1[1] = tq_lane_pair(tq_lane_tab, w1, lanec, 1);
            kw0[2] = tq_lane_pair(tq_lane_tab, w0, lanec, 2), kw1[2] = tq_lane_pair(tq_lane_tab, w1, lanec, 2);
            kw0[3] = tq_lane_pair(tq_lane_tab, w0, lanec, 3), kw1[3] = tq_lane_pair(tq_lane_tab, w1, lanec, 3);
          }
          ka[0] = kw0[2 * (s & 1)];
          ka[1] = kw1[2 * (s & 1)];
          ka[2] = kw0[2 * (s & 1) + 1];
          ka[3] = kw1[2 * (s & 1) + 1];
        } else if constexpr (T::KREG) {
          if ((s & 1) == 0) {
            kreg.lut8(cur.k[0].w[s >> 1], kw0);
            kreg.lut8(cur.k[1].w[s >> 1], kw1);
          }
          ka[0] = kw0[2 * (s & 1)];
          ka[1] = kw1[2 * (s & 1)];
          ka[2] = kw0[2 * (s & 1) + 1];
          ka[3] = kw1[2 * (s & 1) + 1];
        } else {
          ka[0] = ktab.adjacent(cur.k[0], (4 * s) * BK);
          ka[1] = ktab.adjacent(cur.k[1], (4 * s) * BK);
          ka[2] = ktab.adjacent(cur.k[0], (4 * s + 2) * BK);
          ka[3] = ktab.adjacent(cur.k[1], (4 * s + 2) * BK);
        }
        tq_mma16816<false>(s4[s & 1], ka, qa[s][0], qa[s][2]);
        if constexpr (QJL) {
          const tq_u32 ca[4] = {qjl_pair(tq_field<2>(cur.s[0], 4 * s)), qjl_pair(tq_field<2>(cur.s[1], 4 * s)),
                                qjl_pair(tq_field<2>(cur.s[0], 4 * s + 2)),
                                qjl_pair(tq_field<2>(cur.s[1], 4 * s + 2))};
          tq_mma16816<false>(q4[s & 1], ca, sa[s][0], sa[s][2]);
        }
      }
      // ---- logits in base 2 (x[2 slot + row]); row max over the 16 tokens: 2 local, 8 lanes (g)
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int slot = i >> 1;
        const float knf = tq_16_to_f<KBF>(cur.kn[slot]);
        float v = ((i & 1) ? rs1 : rs0) * knf * (s4[0][i] + s4[1][i]);
        if constexpr (QJL)
          v += ((i & 1) ? qjl_scale1 : qjl_scale0) * tq_16_to_f<KBF>(cur.rn[slot]) * (q4[0][i] + q4[1][i]);
        x[i] = (base + 8 * slot + g < end) ? v : NEG_INF;
      }
      float mx0 = fmaxf(x[0], x[2]), mx1 = fmaxf(x[1], x[3]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      float mu0, mu1;
      const float al0 = update_max(m0, mx0, mu0), al1 = update_max(m1, mx1, mu1);
      const float e0 = tq_exp2(x[0] - mu0), e1 = tq_exp2(x[1] - mu1);
      const float e2 = tq_exp2(x[2] - mu0), e3 = tq_exp2(x[3] - mu1);
      l0 = l0 * al0 + (e0 + e2);  // this thread's tokens only; summed over the lanes at the end
      l1 = l1 * al1 + (e1 + e3);
      const float vn0 = tq_16_to_f<VBF>(cur.vn[0]), vn1 = tq_16_to_f<VBF>(cur.vn[1]);
      // (slot | row 2t, 2t+1) pairs, transposed to (row g | slots 2t, 2t+1): the B fragments of O^T
      const tq_u32 pb0 = tq_movmatrix_t(tq_pack2(tq_f_to_16<VBF>(e0 * vn0), tq_f_to_16<VBF>(e1 * vn0)));
      const tq_u32 pb1 = tq_movmatrix_t(tq_pack2(tq_f_to_16<VBF>(e2 * vn1), tq_f_to_16<VBF>(e3 * vn1)));
      // a running max moved: rescale (accumulator columns are rows 2t, 2t + 1)
      if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) rescale(acc, al0, al1, al0, al1);
      pv_narrow(acc, cur, pb0, pb1);
    } else {
      // ---- wide tiles (more than 8 rows): S = Q K^T, two n8 tiles (tokens base + 0..7, base + 8..15)
      float sc[2][4];
      float sq[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
        sq[j][0] = sq[j][1] = sq[j][2] = sq[j][3] = 0.f;
        // KREG: k-step s uses codes 4s..4s+3 = pairs 2 (s & 1), 2 (s & 1) + 1 of word s >> 1
        tq_u32 kb[T::KREG ? T::KS / 2 : 1][4];
        if constexpr (T::KREG) {
#pragma unroll
          for (int w = 0; w < T::KS / 2; ++w) kreg.lut8(cur.k[j].w[w], kb[w]);
        }
#pragma unroll
        for (int s = 0; s < T::KS; ++s) {
          tq_u32 b0, b1;
          if constexpr (T::KREG) {
            b0 = kb[s >> 1][2 * (s & 1)];
            b1 = kb[s >> 1][2 * (s & 1) + 1];
          } else {
            b0 = ktab.adjacent(cur.k[j], (4 * s) * BK);
            b1 = ktab.adjacent(cur.k[j], (4 * s + 2) * BK);
          }
          tq_mma16816<false>(sc[j], qa[s], b0, b1);
          if constexpr (QJL) {
            const tq_u32 c0 = qjl_pair(tq_field<2>(cur.s[j], 4 * s));
            const tq_u32 c1 = qjl_pair(tq_field<2>(cur.s[j], 4 * s + 2));
            tq_mma16816<false>(sq[j], sa[s], c0, c1);
          }
        }
      }
      // ---- logits in base 2; c[0..1] row g, c[2..3] row g+8; column e of tile j = token 8j + 2t + e
      float p[2][4];
      float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int slot = 2 * j + e;  // index into kn/vn: tokens 2t, 2t+1, 2t+8, 2t+9
          const bool ok = base + 8 * j + 2 * t + e < end;
          const float knf = tq_16_to_f<KBF>(cur.kn[slot]);
          float x0 = rs0 * knf * sc[j][e];
          float x1 = rs1 * knf * sc[j][2 + e];
          if constexpr (QJL) {
            const float rnf = tq_16_to_f<KBF>(cur.rn[slot]);
            x0 += qjl_scale0 * rnf * sq[j][e];
            x1 += qjl_scale1 * rnf * sq[j][2 + e];
          }
          p[j][e] = ok ? x0 : NEG_INF;
          p[j][2 + e] = ok ? x1 : NEG_INF;
          mx0 = fmaxf(mx0, p[j][e]);
          mx1 = fmaxf(mx1, p[j][2 + e]);
        }
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      float mu0, mu1;
      const float al0 = update_max(m0, mx0, mu0), al1 = update_max(m1, mx1, mu1);
      float ps0 = 0.f, ps1 = 0.f;
      tq_u32 pa[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float e0 = tq_exp2(p[j][0] - mu0), e1 = tq_exp2(p[j][1] - mu0);
        const float e2 = tq_exp2(p[j][2] - mu1), e3 = tq_exp2(p[j][3] - mu1);
        ps0 += e0 + e1;
        ps1 += e2 + e3;
        const float vn0 = tq_16_to_f<VBF>(cur.vn[2 * j]), vn1 = tq_16_to_f<VBF>(cur.vn[2 * j + 1]);
        pa[2 * j + 0] = tq_pack2(tq_f_to_16<VBF>(e0 * vn0), tq_f_to_16<VBF>(e1 * vn1));
        pa[2 * j + 1] = tq_pack2(tq_f_to_16<VBF>(e2 * vn0), tq_f_to_16<VBF>(e3 * vn1));
      }
      l0 = l0 * al0 + ps0;
      l1 = l1 * al1 + ps1;
      // the running max moved: rescale (accumulator rows g, g + 8)
      if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) rescale(acc, al0, al0, al1, al1);
      // A fragment order: (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..)
      const tq_u32 pfrag[4] = {pa[0], pa[1], pa[2], pa[3]};
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        const tq_u32 b0 = vtab.across(cur.v[0], cur.v[1], i * BV);
        const tq_u32 b1 = vtab.across(cur.v[2], cur.v[3], i * BV);
        tq_mma16816<VBF>(acc[i], pfrag, b0, b1);
      }
    }
  };
  auto step = [&](const StepRegs<T>& cur, int base) { step_on(res, cur, base); };
  // A ring of STAGES register buffers: the loads of the next STAGES - 1 steps are in flight while one
  // step computes (the loop is unrolled by the ring size so every index is static).
  // Loads go strictly forward 16 tokens at a time: running pointers, so a full step's addresses are
  // a register plus compile-time offsets (against addresses rebuilt from the token index in every
  // step: ~12 fewer 64-bit address computations per step, ~8 more registers, measured 6% faster on an
  // H200).
  LanePtrs<T> Lrun = L;
  advance<T, QJL>(Lrun, begin);
  auto load_next = [&](StepRegs<T>& r, int at) {
    if (at + 16 <= end) load_step<T, QJL, true, KA>(r, 0, end, Lrun);
    else load_step<T, QJL, false, KA>(r, 0, end - at, Lrun);  // Lrun is at token `at`
    advance<T, QJL>(Lrun, 16);
  };
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k)
    if (begin + 16 * k < end) load_next(ring[k], begin + 16 * k);
  for (int base = begin; base < end; base += 16 * STAGES) {
#pragma unroll
    for (int k = 0; k < STAGES; ++k) {
      const int here = base + 16 * k;
      if (here < end) {
        const int ahead = here + 16 * (STAGES - 1);
        if (ahead < end)
          load_next(ring[(k + STAGES - 1) % STAGES], ahead);
        step(ring[k], here);
      }
    }
  }

  // l: sum over the lanes holding the other tokens of the same rows (t for S = Q K^T, g for KA)
#pragma unroll
  for (int o = KA ? 4 : 1; o < (KA ? 32 : 4); o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
}

// Hand a warp's result to sink.o(row, a, b, value) (row of the 16-row tile, dim D / 8 * a + b of the
// head, in the values' rotated space) and sink.ml(row, m, l) (one call per owned row, from one lane).
template <int D, bool NARROW, class Sink>
TQ_DEVI void emit_warp(const WarpResult<D, NARROW>& res, Sink& sink) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (NARROW) {
#pragma unroll
    for (int mt = 0; mt < WarpResult<D, NARROW>::NACC; ++mt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sink.o(2 * t + e, g, 2 * mt, res.acc[mt][e]);
        sink.o(2 * t + e, g, 2 * mt + 1, res.acc[mt][2 + e]);
      }
    }
    if (g == 0) {
      sink.ml(2 * t, res.m0, res.l0);
      sink.ml(2 * t + 1, res.m1, res.l1);
    }
  } else {
#pragma unroll
    for (int i = 0; i < WarpResult<D, NARROW>::NACC; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sink.o(g, 2 * t + e, i, res.acc[i][e]);
        sink.o(g + 8, 2 * t + e, i, res.acc[i][2 + e]);
      }
    }
    if (t == 0) {
      sink.ml(g, res.m0, res.l0);
      sink.ml(g + 8, res.m1, res.l1);
    }
  }
}

// The rows of a tile a thread's m0/l0 and m1/l1 belong to.
template <bool NARROW>
TQ_DEVI void owned_rows(int& ra, int& rb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  ra = NARROW ? 2 * t : g;
  rb = NARROW ? 2 * t + 1 : g + 8;
}

// Sink of the split kernel: partial outputs of one warp's split straight to global scratch.
template <int D>
struct GlobalSink {
  float* po;   // [R, D] of this split
  float* pml;  // [R, 2]
  int row0, R;
  TQ_DEVI void o(int r, int a, int b, float v) const {
    if (row0 + r < R) po[(long long)(row0 + r) * D + D / 8 * a + b] = v;
  }
  TQ_DEVI void ml(int r, float m, float l) const {
    if (row0 + r < R) {
      pml[2 * (row0 + r)] = m;
      pml[2 * (row0 + r) + 1] = l;
    }
  }
};

// Fill a block's codebook tables (shared always, the key register table where the traits use it); SYNC:
// then wait for the whole block (otherwise the caller's next barrier must come before the first lookup).
template <class T, int BK, int BV, bool VBF, bool SYNC = true>
TQ_DEVI void fill_tables(CodeTable<BK, false>& ktab, CodeTable<BV, VBF>& vtab, RegLut& kreg,
                         const float* __restrict__ k_codebook, const float* __restrict__ v_codebook) {
  ktab.fill(k_codebook, threadIdx.x, blockDim.x);
  vtab.fill(v_codebook, threadIdx.x, blockDim.x);
  if constexpr (T::KREG) kreg.template fill<false>(k_codebook);
  if constexpr (SYNC) __syncthreads();
}

}  // namespace tq


// q16:       [BH, RT*16, D] fp16, rotated, key-permuted, each row divided by its max |.| (pad rows 0)
// row_scale: [BH, RT*16] fp32: max|.| * softmax_scale * log2(e) (0 for pad rows)
// kcodes:    [BH, Tcap, D*BK/8] uint8; knorms [BH, Tcap] fp16/bf16 (KBF)
// vcodes:    [BH, Tcap, D*BV/8] uint8; vnorms [BH, Tcap] fp16/bf16 (VBF)
// qs16/qs_scale/qjl/rnorms: the QJL analogues (prod keys, m = D); ignored unless QJL
// seq_lens:  [B] int32 (compressed tokens per sequence, <= Tcap)
// part_o:    [BH, nsplit, R, D] fp32 (unpermuted rotated dims); part_ml: [BH, nsplit, R, 2] (m, l)
// NARROW (at most 8 used rows in the tile, e.g. GQA group <= 8 at q_len 1): rows g+8 are skipped
// and P V runs transposed, O^T = V^T P^T (values are the A operand, M = 16 dims; P^T the B operand,
// N = 8 rows): half the mma count and half the accumulator registers.
// Blocks per SM the register allocation must allow (128 threads each): 2 for wide tiles and prod keys;
// narrow tiles need fewer registers: 4 at head_dim <= 64, else 3 (<= 168 registers; 4 would fit the
// 4-bit builds on sm_90 but spill a little on sm_100).
template <int D, int BK, int BV, bool KBF, bool VBF, bool QJL, bool NARROW>
__global__ void __launch_bounds__(128, ((QJL || !NARROW) ? 2 : D <= 64 ? 4 : 3))
tq_decode_split(
    const tq_u16* __restrict__ q16, const float* __restrict__ row_scale,
    const tq_u8* __restrict__ kcodes, const tq_u16* __restrict__ knorms,
    const tq_u8* __restrict__ vcodes, const tq_u16* __restrict__ vnorms,
    const tq_u16* __restrict__ qs16, const float* __restrict__ qs_scale,
    const tq_u8* __restrict__ qjl, const tq_u16* __restrict__ rnorms,
    const float* __restrict__ k_codebook, const float* __restrict__ v_codebook,
    const int* __restrict__ seq_lens, int Hkv, int R, int RT, int Tcap, int tokens_per_warp,
    int nsplit, float* __restrict__ part_o, float* __restrict__ part_ml) {
  using T = tq::DecodeTraits<D, BK, BV, KBF, VBF, QJL>;
  __shared__ tq::CodeTable<BK, false> ktab;
  __shared__ tq::CodeTable<BV, VBF> vtab;
  tq::RegLut kreg;  // register table of 4-bit keys, filled only where used
  tq::fill_tables<T>(ktab, vtab, kreg, k_codebook, v_codebook);

  const int split = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int bh = blockIdx.y, rt = blockIdx.z;
  if (split >= nsplit) return;
  const int len = min(max(seq_lens[bh / Hkv], 0), Tcap);
  const int begin = split * tokens_per_warp;
  const int end = min(begin + tokens_per_warp, len);
  const long long tile = (long long)bh * RT * 16 + rt * 16;  // first row of the tile in q16 / row_scale
  tq::WarpResult<D, NARROW> res;
  tq::split_warp<D, BK, BV, KBF, VBF, QJL, NARROW>(res, ktab, vtab, kreg, q16 + tile * D, row_scale + tile,
                                                   qs16 + tile * D, qs_scale + tile, kcodes, knorms, vcodes,
                                                   vnorms, qjl, rnorms, (long long)bh * Tcap, begin, end);
  tq::GlobalSink<D> sink{part_o + ((long long)bh * nsplit + split) * R * D,
                         part_ml + ((long long)bh * nsplit + split) * R * 2, rt * 16, R};
  tq::emit_warp<D, NARROW>(res, sink);
}

namespace tq {
// sum_i v[i] * M[i][d] for a shared-memory vector v and a row-major [D, D] matrix in global memory
// (thread d reads column d: coalesced). The column is loaded in independent batches of 32, so the
// small launches wait for a few memory round trips instead of one per 8 elements.
template <int D>
TQ_DEVI float col_dot(const float* v, const float* __restrict__ M, int d) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i0 = 0; i0 < D; i0 += 32) {
    float m[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) m[k] = __ldg(M + (i0 + k) * D + d);
#pragma unroll
    for (int k = 0; k < 32; ++k) acc[k & 3] += v[i0 + k] * m[k];
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
}  // namespace tq

// Query preparation, one block of D threads per padded row: y = q @ rotation.T (rt = rotation.T,
// row-major, so thread j reads rt[i][j] coalesced); q16[k] = y[perm[k]] / max|y| as fp16;
// row_scale = max|y| * mult. Rows r >= R of a kv head's tile are padding: zeros.
// q: [BH, R, D] (QIN: 0 fp32, 1 fp16, 2 bf16); q16: [BH, RP, D]; row_scale: [BH, RP].
template <int D, int QIN>
__global__ void __launch_bounds__(D) tq_decode_prep(
    const void* __restrict__ q, const float* __restrict__ rt, const int* __restrict__ perm, float mult, int R,
    int RP, tq_u16* __restrict__ q16, float* __restrict__ row_scale) {
  __shared__ float x[D];
  __shared__ float y[D];
  __shared__ float wmax[D / 32];
  const int row = blockIdx.x;  // bh * RP + r
  const int bh = row / RP, r = row % RP;
  const int d = threadIdx.x;
  if (r >= R) {
    q16[(long long)row * D + d] = 0;
    if (d == 0) row_scale[row] = 0.f;
    return;
  }
  const long long src = ((long long)bh * R + r) * D + d;
  if constexpr (QIN == 0) x[d] = reinterpret_cast<const float*>(q)[src];
  else if constexpr (QIN == 1) x[d] = tq_h2f(reinterpret_cast<const tq_u16*>(q)[src]);
  else x[d] = tq_bf2f(reinterpret_cast<const tq_u16*>(q)[src]);
  __syncthreads();
  const float acc = tq::col_dot<D>(x, rt, d);
  y[d] = acc;
  float m = fabsf(acc);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((d & 31) == 0) wmax[d >> 5] = m;
  __syncthreads();
  m = wmax[0];
#pragma unroll
  for (int w = 1; w < D / 32; ++w) m = fmaxf(m, wmax[w]);
  const float amax = m > 0.f ? m : 1e-30f;
  q16[(long long)row * D + d] = tq_f2h(y[__ldg(perm + d)] / amax);
  if (d == 0) row_scale[row] = amax * mult;
}

// Merge the splits of one output row (log-sum-exp), then undo the rotation: out = y @ rotation.
// Grid: BH * R blocks of D threads; dynamic shared memory: 2 * nsplit floats (split maxima / weights
// and sums). Every phase issues its loads in independent batches: the partials and the rotation
// come from L2 or DRAM, so the kernel's time is a few memory round trips, not one per split.
// out: [BH, R, D] fp32; lse: [BH, R] natural log of the sum of exp(softmax_scale * score) over the
// compressed tokens (-inf when there are none).
template <int D>
__global__ void __launch_bounds__(D) tq_decode_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const float* __restrict__ rotation,
    int R, int nsplit, float* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float wsplit[];  // [nsplit] maxima, then weights; [nsplit] sums
  float* lsplit = wsplit + nsplit;
  __shared__ float y[D];
  __shared__ float red[D / 32];
  const int row = blockIdx.x;  // bh * R + r
  const int bh = row / R, r = row % R;
  const int d = threadIdx.x;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const float* ml = part_ml + (long long)bh * nsplit * R * 2;
  // 1. (m, l) of every split, read once; max of the split maxima
  float M = NEG_INF;
  for (int s = d; s < nsplit; s += D) {
    const float2 v = *reinterpret_cast<const float2*>(ml + ((long long)s * R + r) * 2);
    wsplit[s] = v.x;
    lsplit[s] = v.y;
    M = fmaxf(M, v.x);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if ((d & 31) == 0) red[d >> 5] = M;
  __syncthreads();
  M = red[0];
#pragma unroll
  for (int w = 1; w < D / 32; ++w) M = fmaxf(M, red[w]);
  __syncthreads();
  const float Mu = (M == NEG_INF) ? 0.f : M;
  // 2. split weights and the total mass
  float L = 0.f;
  for (int s = d; s < nsplit; s += D) {
    const float l = lsplit[s];
    const float w = (l > 0.f) ? tq_exp2(wsplit[s] - Mu) : 0.f;
    wsplit[s] = w;
    L += w * l;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  if ((d & 31) == 0) red[d >> 5] = L;
  __syncthreads();
  L = 0.f;
#pragma unroll
  for (int w = 0; w < D / 32; ++w) L += red[w];
  // 3. weighted sum of the partial outputs: 16 loads in flight per batch (every split's partials
  // are written by the split kernel, empty ones as zeros; the select keeps them out of the sum)
  const float* po = part_o + ((long long)bh * nsplit * R + r) * D + d;
  const long long stride = (long long)R * D;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  int s = 0;
  for (; s + 16 <= nsplit; s += 16) {
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = po[(s + k) * stride];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const float w = wsplit[s + k];
      a[k & 3] += (w != 0.f) ? w * v[k] : 0.f;
    }
  }
  for (; s < nsplit; ++s) {
    const float w = wsplit[s];
    a[s & 3] += (w != 0.f) ? w * po[s * stride] : 0.f;
  }
  y[d] = (L > 0.f) ? ((a[0] + a[1]) + (a[2] + a[3])) / L : 0.f;
  __syncthreads();
  // 4. out[d] = sum_i y[i] rotation[i][d]
  out[(long long)row * D + d] = tq::col_dot<D>(y, rotation, d);
  if (d == 0) lse[row] = (L > 0.f) ? (M + __log2f(L)) * 0.69314718055994531f : NEG_INF;
}

// ------------------------------------------------------------------------------------------------
// One-launch decode (small batches): query prep, split-KV and merge in one kernel.
//
// Grid (nblk, BH, RT), 4 warps per block; block x of tile (bh, rt) owns warp splits 4x .. 4x + 3.
//   1. prologue: the block rotates its tile's query rows itself (y = q @ R_k^T, fp32, the rotation
//      read from L2), scales them by their max |.| and stores the fp16 key-permuted tile in shared
//      memory (what tq_decode_prep writes to global memory for the three-launch path);
//   2. each warp runs its split (split_warp, the same code as tq_decode_split);
//   3. the four warps' partials are merged in shared memory (one log-sum-exp rescale per warp and
//      row, summed in warp order: deterministic) and written as one partial per block;
//   4. the last block of the tile to finish (an atomicInc on the tile's counter, which wraps back to
//      0 on that last increment: the counters are zero again after every launch, so a CUDA-graph
//      replay starts clean) merges the blocks' partials and applies the inverse rotation y @ R_v.
// Launch and memory round trips saved against the three launches: the q16/row-scale round trip,
// two launches, and 4x fewer partials to merge. Concurrent launches sharing one counter buffer
// (the same plan on two streams at once) are not allowed.
// 16-token steps of loads in flight per warp (split_warp's DEPTH): 3 (measured 2-8% faster than 1,
// H200); the launcher sets 2 with the lane tables (decode_kernels.LANE_LUT_COMPANIONS).
#ifndef TQ_FUSED_STAGES
#define TQ_FUSED_STAGES 3
#endif
// Nonzero: the narrow 4/4-bit tiles with word-aligned chunks look their key and value codes up in
// lane-private pair tables (tq_lane_pair: 64 KB of dynamic shared memory per block; per two codes one
// prmt, one add and one conflict-free shared load, instead of register prmt tables for keys (~2 ALU ops
// per code) and a shared pair table for values with ~3.5-way bank conflicts). Set by the launcher
// together with the dynamic shared memory (decode_kernels.fused_defines); never set it without that
// memory. Default 0.
#ifndef TQ_LANE_LUT
#define TQ_LANE_LUT 0
#endif
// 1: lane-table builds rotate the query in registers in the prologue and merge one row per warp in the
// last block, Hadamard rotations as warp butterflies (tq::rotate_query_rows, tq::merge_row: no block
// barrier in either; H200, b1 x 32k: the prologue 4.1 -> 2.0 us, the final merge 4.3 -> 2.4 us). Set by
// the launcher with the lane tables (decode_kernels.LANE_LUT_COMPANIONS); no effect without them.
#ifndef TQ_FUSED_WARP_ROTATE
#define TQ_FUSED_WARP_ROTATE 0
#endif

namespace tq {
// Blocks per tile the last block merges (its shared weights per row); decode_kernels.FUSED_MAX_BLOCKS.
constexpr int FUSED_MAX_BLOCKS = 64;

// A one-launch instance's build choices. LANE: the lane-private pair tables (TQ_LANE_LUT; 64 KB of
// dynamic shared memory, passed by the launcher exactly when it sets the macro). MIN_BLOCKS: blocks per
// SM its registers must allow: 2 for wide tiles, 4 for narrow ones of head_dim <= 64, else 3 (3 load
// stages need ~167 registers).
template <int D, int BK, int BV, bool NARROW>
struct FusedBuild {
  using T = DecodeTraits<D, BK, BV, false, false, false>;
  static constexpr bool LANE = TQ_LANE_LUT && NARROW && BK == 4 && BV == 4 && T::KALIGN && T::VALIGN;
  static constexpr int MIN_BLOCKS = !NARROW ? 2 : D <= 64 ? 4 : 3;
};

// acc[k] = sum_i v[k][i] * M[i][j] for N rows v (shared, row stride D) and column j of a row-major
// [D, D] matrix in global memory (coalesced across j; the column loaded in batches of NB loads: one
// L2 round trip per batch, NB registers).
template <int D, int N, int NB = 32>
TQ_DEVI void col_dot_rows(const float* v, const float* __restrict__ M, int j, float (&acc)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = 0.f;
#pragma unroll 1
  for (int i0 = 0; i0 < D; i0 += NB) {  // not unrolled: NB loads in flight, not D (registers)
    float m[NB];
#pragma unroll
    for (int k = 0; k < NB; ++k) m[k] = __ldg(M + (i0 + k) * D + j);
#pragma unroll
    for (int k = 0; k < NB; ++k) {
#pragma unroll
      for (int n = 0; n < N; ++n) acc[n] += v[n * D + i0 + k] * m[k];
    }
  }
}

TQ_DEVI float load_query(const void* q, long long i, int qin) {
  if (qin == 0) return reinterpret_cast<const float*>(q)[i];
  const tq_u16 h = reinterpret_cast<const tq_u16*>(q)[i];
  return qin == 1 ? tq_h2f(h) : tq_bf2f(h);
}

// The output rows r < nr of a tile (first row row0 of out) = y @ M for the rows y of ybuf (shared, synced)
// and a dense rotation M (row-major [D, D] in global memory, read through L2), in the output dtype.
template <int D>
TQ_DEVI void dense_rotate_out(const float* ybuf, int nr, const float* __restrict__ M, void* out, int out_kind,
                              long long row0) {
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    for (int r0 = 0; r0 < nr; r0 += 4) {
      float a[4];
      col_dot_rows<D, 4>(ybuf + r0 * D, M, j, a);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (r0 + k < nr) {
          const long long o = (row0 + r0 + k) * D + j;
          if (out_kind == 0) reinterpret_cast<float*>(out)[o] = a[k];
          else if (out_kind == 1) reinterpret_cast<tq_u16*>(out)[o] = tq_f2h(a[k]);
          else reinterpret_cast<tq_u16*>(out)[o] = tq_f2bf(a[k]);
        }
      }
    }
  }
}

// The one-launch kernel rotates in shared memory, except lane-table builds with TQ_FUSED_WARP_ROTATE
// (registers, below; not offered to the builds without lane tables: their split loop sits at the
// register cap, and with the register rotations ptxas spilled 24-28 bytes in the 3/3 and 4/2-bit
// builds, on sm_90 or sm_100 depending on the build).
// In-place fast Walsh-Hadamard transform (Sylvester order, unnormalized) of rows r < nr of a shared
// [*, D] buffer: log2(D) butterfly passes, one block barrier after each. D a power of two.
template <int D>
TQ_DEVI void fwht_rows(float* buf, int nr) {
  for (int lg = 0; (1 << lg) < D; ++lg) {
    const int h = 1 << lg;
    for (int i = threadIdx.x; i < nr * (D / 2); i += blockDim.x) {
      const int r = i / (D / 2), k = i - r * (D / 2);
      const int lo = r * D + ((k >> lg) << (lg + 1)) + (k & (h - 1));
      const float a = buf[lo], b = buf[lo + h];
      buf[lo] = a + b;
      buf[lo + h] = a - b;
    }
    __syncthreads();
  }
}

// Randomized Hadamard rotations without a matrix (kvcodec's "hadamard" R = H diag(s) / sqrt(D) and
// "hadamard2" R = H diag(s2) H diag(s1) / D; signs [rounds, D]), on rows r < nr of shared buffers.
// forward: dst = R src (the query prep's q @ R^T); the caller has synced src and the signs (shared
// memory, loaded at kernel start: no global round trip here); ends synced.
template <int D>
TQ_DEVI void hadamard_forward(const float* src, float* dst, int nr, const float* signs, int rounds) {
  const float scale = rounds == 1 ? 1.f / sqrtf((float)D) : 1.f / (float)D;
  for (int rd = 0; rd < rounds; ++rd) {
    for (int i = threadIdx.x; i < nr * D; i += blockDim.x)
      dst[i] = (rd == 0 ? src[i] * scale : dst[i]) * signs[rd * D + (i % D)];
    __syncthreads();
    fwht_rows<D>(dst, nr);
  }
}

// inverse, in place: buf = R^T buf (the merge's y @ R); the caller has synced buf; ends synced.
template <int D>
TQ_DEVI void hadamard_inverse(float* buf, int nr, const float* signs, int rounds) {
  const float scale = rounds == 1 ? 1.f / sqrtf((float)D) : 1.f / (float)D;
  for (int rd = rounds - 1; rd >= 0; --rd) {
    fwht_rows<D>(buf, nr);
    for (int i = threadIdx.x; i < nr * D; i += blockDim.x)
      buf[i] *= signs[rd * D + (i % D)] * (rd == 0 ? scale : 1.f);
    __syncthreads();
  }
}

// Randomized Hadamard rotations of rows held in registers, one row per warp: lane l owns the E = D / 32
// elements E l .. E l + E - 1 (D a power of two, 32 <= D). No shared memory and no block barrier: the
// in-register butterflies first, then five shuffle levels (the butterflies of a Sylvester-order FWHT
// commute). The prologue and the last block's merge rotate their rows this way.
template <int E>
TQ_DEVI void fwht_warp(float (&x)[E]) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int k = 0; k < E; ++k) {
      if (!(k & h)) {
        const float a = x[k], b = x[k + h];
        x[k] = a + b;
        x[k + h] = a - b;
      }
    }
  }
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool hi = (lane & m) != 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float p = __shfl_xor_sync(0xffffffffu, x[k], m);
      x[k] = hi ? p - x[k] : x[k] + p;
    }
  }
}

// this lane's signs of a rotation of `rounds` (1 or 2) rounds ([rounds, D] in global memory)
template <int E>
TQ_DEVI void load_lane_signs(float (&s)[2][E], const float* __restrict__ signs, int rounds) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int rd = 0; rd < 2; ++rd)
#pragma unroll
    for (int k = 0; k < E; ++k) s[rd][k] = rd < rounds ? __ldg(signs + rd * 32 * E + E * lane + k) : 0.f;
}

// x = R x (forward: the query prep's q @ R^T) or x = R^T x (inverse: the merge's y @ R), R = H diag(s)
// / sqrt(D) (1 round) or H diag(s2) H diag(s1) / D (2 rounds)
template <int E, bool INVERSE>
TQ_DEVI void hadamard_warp(float (&x)[E], const float (&s)[2][E], int rounds) {
  const float scale = rounds == 1 ? 1.f / sqrtf((float)(32 * E)) : 1.f / (float)(32 * E);  // as hadamard_forward
  if (!INVERSE) {
#pragma unroll
    for (int rd = 0; rd < 2; ++rd) {
      if (rd < rounds) {
#pragma unroll
        for (int k = 0; k < E; ++k) x[k] *= s[rd][k] * (rd == 0 ? scale : 1.f);
        fwht_warp<E>(x);
      }
    }
  } else {
#pragma unroll
    for (int rd = 1; rd >= 0; --rd) {
      if (rd < rounds) {
        fwht_warp<E>(x);
#pragma unroll
        for (int k = 0; k < E; ++k) x[k] *= s[rd][k] * (rd == 0 ? scale : 1.f);
      }
    }
  }
}

// E consecutive floats from L2 (the partials other blocks wrote: __ldcg), in 16- or 8-byte loads
template <int E>
TQ_DEVI void ldcg_vec(float (&x)[E], const float* p) {
  if constexpr (E % 4 == 0) {
#pragma unroll
    for (int k = 0; k < E / 4; ++k) {
      const float4 t = __ldcg(reinterpret_cast<const float4*>(p) + k);
      x[4 * k] = t.x, x[4 * k + 1] = t.y, x[4 * k + 2] = t.z, x[4 * k + 3] = t.w;
    }
  } else if constexpr (E == 2) {
    const float2 t = __ldcg(reinterpret_cast<const float2*>(p));
    x[0] = t.x, x[1] = t.y;
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = __ldcg(p + k);
  }
}

// The prologue's query rotation with a Hadamard key rotation: warp w rotates rows w + 4 j (j < NJ, rows
// < nr of the tile whose first query element is q + q0) in registers, one round trip for the query and
// the signs and no block barrier, and leaves row r in ybuf[r D ..] for the same warp.
template <int D, int NJ>
TQ_DEVI void rotate_query_rows(const void* __restrict__ q, int qin, int q0, int nr, const float* __restrict__ k_signs,
                               int k_rounds, float* ybuf) {
  constexpr int E = D / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float ks[2][E], x[NJ][E];
  load_lane_signs<E>(ks, k_signs, k_rounds);
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int r = warp + 4 * j;
#pragma unroll
    for (int k = 0; k < E; ++k) x[j][k] = r < nr ? load_query(q, q0 + r * D + E * lane + k, qin) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int r = warp + 4 * j;
    if (r < nr) {
      hadamard_warp<E, false>(x[j], ks, k_rounds);
#pragma unroll
      for (int k = 0; k < E; ++k) ybuf[r * D + E * lane + k] = x[j][k];
    }
  }
  __syncwarp();
}

// The last block's merge of one query row, by one warp (lane l owns elements E l .. E l + E - 1, E =
// D / 32: one float4 of each block's partial at D = 128): the log-sum-exp weights of the row's nblk
// block partials (po: block b's row at po + b R D; ml: its (m, l) at ml + 2 b R; weights through w,
// MAXB floats of shared memory the warp owns), their weighted sum (TB loads in flight per lane, the
// first batch issued before the weights are known), the lse, and then either the inverse Hadamard
// value rotation in registers and the output row in its dtype (v_signs set), or the un-rotated row
// into ybuf_row for the caller's dense rotation.
template <int D, int TB, int MAXB, bool HAD>
TQ_DEVI void merge_row(const float* __restrict__ po, const float* __restrict__ ml, int nblk, int R, float* w,
                       const float* __restrict__ v_signs, int v_rounds, void* out, int out_kind, long long out_off,
                       float* lse, float* ybuf_row) {
  constexpr int E = D / 32;
  constexpr int MB = MAXB / 32;  // (m, l) pairs per lane
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int lane = threadIdx.x & 31;
  const long long bstride = (long long)R * D;
  const float* p = po + E * lane;
  // (m, l) and the signs first, then the first batch of partials: it does not depend on the weights and
  // arrives while they are computed
  float mb[MB], lb[MB];
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    const int b = lane + 32 * j;
    float2 t = make_float2(NEG_INF, 0.f);
    if (b < nblk) t = __ldcg(reinterpret_cast<const float2*>(ml + (long long)b * R * 2));
    mb[j] = t.x;
    lb[j] = t.y;
  }
  float vs[2][E];
  if (HAD && v_signs) load_lane_signs<E>(vs, v_signs, v_rounds);
  float v[TB][E];
#pragma unroll
  for (int k = 0; k < TB; ++k) {
    if (k < nblk) ldcg_vec<E>(v[k], p + k * bstride);
  }
  float M = NEG_INF;
#pragma unroll
  for (int j = 0; j < MB; ++j) M = fmaxf(M, mb[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  const float Mu = (M == NEG_INF) ? 0.f : M;
  float L = 0.f;
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    const float wj = (lb[j] > 0.f) ? tq_exp2(mb[j] - Mu) : 0.f;
    w[lane + 32 * j] = wj;
    L += wj * lb[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  __syncwarp();
  float a[E];
#pragma unroll
  for (int k = 0; k < E; ++k) a[k] = 0.f;
  for (int b = 0; b < nblk; b += TB) {
    if (b > 0) {
#pragma unroll
      for (int k = 0; k < TB; ++k)
        if (b + k < nblk) ldcg_vec<E>(v[k], p + (b + k) * bstride);
    }
#pragma unroll
    for (int k = 0; k < TB; ++k) {
      const float wk = (b + k < nblk) ? w[b + k] : 0.f;
      if (wk != 0.f) {
#pragma unroll
        for (int e = 0; e < E; ++e) a[e] += wk * v[k][e];
      }
    }
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
  for (int k = 0; k < E; ++k) a[k] *= inv;
  if (lane == 0) *lse = (L > 0.f) ? (M + __log2f(L)) * 0.69314718055994531f : NEG_INF;
  if (HAD && v_signs) {
    hadamard_warp<E, true>(a, vs, v_rounds);
    const long long o = out_off + E * lane;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      if (out_kind == 0) reinterpret_cast<float*>(out)[o + k] = a[k];
      else if (out_kind == 1) reinterpret_cast<tq_u16*>(out)[o + k] = tq_f2h(a[k]);
      else reinterpret_cast<tq_u16*>(out)[o + k] = tq_f2bf(a[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) ybuf_row[E * lane + k] = a[k];
  }
}

// Fill the lane-private pair tables at tab (tq_lane_pair's layout, 64 KB): table A from
// the key codebook (fp16), table B from the value codebook (fp16 or bf16: VBF). 128 threads: thread
// tid writes 16-byte column tid % 16 (0-7: table A, 8-15: table B) of rows tid / 16 + 8 i.
template <bool VBF>
TQ_DEVI void fill_lane_tables(char* tab, const float* __restrict__ kcb, const float* __restrict__ vcb) {
  const int tid = threadIdx.x, col = tid & 15, lo = tid >> 4;
  const bool val = col >= 8;
  const float* cb = val ? vcb : kcb;
  auto to16 = [&](float f) -> tq_u32 { return val ? tq_f_to_16<VBF>(f) : tq_f2h(f); };
  const tq_u32 l0 = to16(__ldg(cb + lo)), l1 = to16(__ldg(cb + lo + 8));
  tq_u32 hi[16];  // all loads in flight at once (one round trip)
#pragma unroll
  for (int j = 0; j < 16; ++j) hi[j] = to16(__ldg(cb + j)) << 16;
  uint4* row = reinterpret_cast<uint4*>(tab) + col;
#pragma unroll
  for (int i = 0; i < 32; ++i) {  // row e = lo + 8 i: low code e & 15 = lo + 8 (i & 1), high code i / 2
    const tq_u32 w = ((i & 1) ? l1 : l0) | hi[i >> 1];
    row[(lo + 8 * i) * 16] = make_uint4(w, w, w, w);
  }
}

// atomicInc (wraps to 0 after `limit`) with acquire-release semantics at GPU scope: releases what the
// calling thread ordered before it (with a block barrier: its whole block's stores), acquires the releases
// of the increments before it.
TQ_DEVI unsigned int atomic_inc_acq_rel(unsigned int* p, unsigned int limit) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(limit) : "memory");
  return old;
}

struct NoTable {};  // stands in for the shared tables a build does not use
template <bool C, class A, class B> struct Pick { typedef A type; };
template <class A, class B> struct Pick<false, A, B> { typedef B type; };

// Where the block's [ROWS, D] partial lives in shared memory while its four warps accumulate it: dim
// CV a + b (CV = D / 8, b < CV) of row r at r RS + a AS + b. A warp's sink stores vary (a = g, row 2t + e)
// in narrow tiles and (row g, a = 2t + e) in wide ones (emit_warp); the padding spreads each store over 32
// banks: narrow AS odd (g AS distinct mod 8) and RS = 12 mod 16 (2t RS = 24t mod 32); wide AS = 4 mod 8
// (2t AS = 8t mod 32) and RS odd. (The plain layout, AS = CV and RS = D, makes a narrow tile's stores
// 16-way and a wide tile's 32-way bank conflicts: H200, b1 x 32k, the last block's warp merge 2.8 us
// against 1.2; same arithmetic, same results.)
template <int D, bool NARROW>
struct MergeLayout {
  static constexpr int CV = D / 8;
  static constexpr int AS = NARROW ? CV + 1 : CV + (12 - CV % 8) % 8;
  static constexpr int RS = NARROW ? 8 * AS + 4 : 8 * AS + 1;
  static constexpr int ROWS = NARROW ? 8 : 16;
  static constexpr int FLOATS = ROWS * RS;
  static_assert(CV % 4 == 0, "four dims of a float4 stay in one chunk");
  TQ_DEVI static int at(int r, int dim) { return r * RS + (unsigned)dim / CV * AS + (unsigned)dim % CV; }
};

// Accumulates one warp's partial into the block's shared partial (MergeLayout), scaled per row.
template <int D, bool NARROW>
struct SharedSink {
  float* buf;
  float fa, fb;  // scale of the thread's rows ra, rb
  int ra, rb;
  bool first;    // the first warp stores, the others add
  TQ_DEVI void o(int r, int a, int b, float v) const {
    const float x = v * (r == ra ? fa : fb);
    float* p = buf + r * MergeLayout<D, NARROW>::RS + a * MergeLayout<D, NARROW>::AS + b;
    *p = first ? x : *p + x;
  }
  TQ_DEVI void ml(int, float, float) const {}
};
}  // namespace tq

// q:         [BH, R, D] the query rows (QIN 0 fp32, 1 fp16, 2 bf16; runtime qin); kr_t = R_k^T
//            row-major, perm the key permutation, mult = softmax_scale * log2(e)
// k_signs / k_rounds, v_signs / v_rounds: rotations that are randomized Hadamard transforms
//            (rounds 1 or 2, signs [rounds, D]) run as butterflies in shared memory instead of reading
//            the [D, D] matrix; rounds 0: the matrix (kr_t, v_rotation)
// part_o:    [BH, nblk, R, D] fp32, part_ml [BH, nblk, R, 2]: scratch, one partial per block
// counters:  [BH * RT] uint32, zero before the launch (and again after it)
// out:       [BH, R, D] (out_kind 0 fp32, 1 fp16, 2 bf16); lse [BH, R] fp32 (natural log)
template <int D, int BK, int BV, bool KBF, bool VBF, bool NARROW>
__global__ void __launch_bounds__(128, (tq::FusedBuild<D, BK, BV, NARROW>::MIN_BLOCKS))
tq_decode_fused(
    const void* __restrict__ q, int qin, const float* __restrict__ kr_t, const int* __restrict__ perm, float mult,
    const tq_u8* __restrict__ kcodes, const tq_u16* __restrict__ knorms,
    const tq_u8* __restrict__ vcodes, const tq_u16* __restrict__ vnorms,
    const float* __restrict__ k_codebook, const float* __restrict__ v_codebook,
    const float* __restrict__ v_rotation, const float* __restrict__ k_signs, int k_rounds,
    const float* __restrict__ v_signs, int v_rounds, const int* __restrict__ seq_lens, int Hkv, int R, int RT,
    int Tcap, int tokens_per_warp, int nsplit, float* __restrict__ part_o, float* __restrict__ part_ml,
    unsigned int* __restrict__ counters, void* __restrict__ out, int out_kind, float* __restrict__ lse) {
  using T = tq::DecodeTraits<D, BK, BV, KBF, VBF, false>;
  constexpr int ROWS = NARROW ? 8 : 16;  // query rows of a tile that can be used
  constexpr int MAXB = tq::FUSED_MAX_BLOCKS;
  constexpr int XQ = (ROWS * D > 2 * ROWS * MAXB) ? ROWS * D : 2 * ROWS * MAXB;
  constexpr bool LANE = tq::FusedBuild<D, BK, BV, NARROW>::LANE;
  constexpr bool WROT = LANE && TQ_FUSED_WARP_ROTATE;  // rotations in registers (TQ_FUSED_WARP_ROTATE)
  __shared__ typename tq::Pick<LANE, tq::NoTable, tq::CodeTable<BK, false>>::type ktab;
  __shared__ typename tq::Pick<LANE, tq::NoTable, tq::CodeTable<BV, VBF>>::type vtab;
  constexpr int QROWS = NARROW ? 8 : 16;           // query rows the split reads
  static_assert(QROWS * D * 2 <= XQ * 4, "the query tile fits the xq buffer");
  // prologue: query rows, then (aliased: the rows are dead by then) the fp16 query tile the splits read;
  // last block: (m, l) of every block
  __shared__ __align__(16) float xq[XQ];
  // builds with the lane tables alias the query tile into xq (they need the room; in the others the
  // alias costs a few spilled bytes at the register cap: 4/2 bits)
  __shared__ __align__(16) tq_u16 q16own[LANE ? 8 : QROWS * D];
  tq_u16* q16s = LANE ? reinterpret_cast<tq_u16*>(xq) : q16own;
  // prologue: rotated rows [ROWS, D]; then the block's partial (tq::MergeLayout); last block: merged rows
  using ML = tq::MergeLayout<D, NARROW>;
  __shared__ __align__(16) float ybuf[ML::FLOATS > ROWS * D ? ML::FLOATS : ROWS * D];
  __shared__ float rss[16];
  __shared__ float ksg[WROT ? 1 : 2 * D], vsg[WROT ? 1 : 2 * D];  // Hadamard signs (shared-memory rotations)
  __shared__ float wm[4][ROWS], wl[4][ROWS];      // per warp (m, l) of each row
  __shared__ float rowm[ROWS], rowl[ROWS];        // block max and sum per row
  __shared__ int is_last;
  tq::RegLut kreg;
  // the tables' loads overlap the query's: one barrier for both (below)
  if constexpr (LANE) tq::fill_lane_tables<VBF>(tq::tq_lane_tab, k_codebook, v_codebook);
  else tq::fill_tables<T, BK, BV, VBF, false>(ktab, vtab, kreg, k_codebook, v_codebook);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.y, rt = blockIdx.z, nblk = gridDim.x;
  const int R0 = rt * 16;               // first row of the tile
  const int nr = min(ROWS, R - R0);     // rows of the tile that exist
  const float NEG_INF = -__int_as_float(0x7f800000);
  // rows of D = 32 E values held one per warp (E per lane) in the prologue and the tail; HAD: the
  // randomized Hadamard rotations run there as warp butterflies (tq::hadamard_warp)
  static_assert(D % 32 == 0, "head_dim a multiple of 32");
  constexpr int E = D / 32;
  constexpr bool HAD = (D & (D - 1)) == 0;

  // ---- 1. query prep for this tile: y = q @ R_k^T, then fp16(y[perm] / max|y|)
  int pk[D / 32];  // this lane's permutation entries, loaded early (used after two barriers)
#pragma unroll
  for (int i = 0; i < D / 32; ++i) pk[i] = __ldg(perm + lane + 32 * i);
  // TQ_FUSED_WARP_ROTATE lane-table builds with a Hadamard key rotation: warp w rotates rows w, w + 4,
  // ... in registers (tq::rotate_query_rows: one round trip, no block barrier); the others stage the
  // rows in shared memory
  if (WROT && HAD && k_rounds > 0) {
    tq::rotate_query_rows<D, QROWS / 4>(q, qin, (bh * R + R0) * D, nr, k_signs, k_rounds, ybuf);
  } else {
    for (int i = tid; i < ROWS * D; i += blockDim.x) {
      const int r = i / D;
      xq[i] = (r < nr) ? tq::load_query(q, ((long long)bh * R + R0 + r) * D + (i - r * D), qin) : 0.f;
    }
    // the signs come with the query (the last block's value signs too: one round trip less in its tail)
    if constexpr (!WROT) {
      for (int i = tid; i < k_rounds * D; i += blockDim.x) ksg[i] = __ldg(k_signs + i);
      for (int i = tid; i < v_rounds * D; i += blockDim.x) vsg[i] = __ldg(v_signs + i);
    }
    __syncthreads();
    if (!WROT && k_rounds > 0) {
      if constexpr ((D & (D - 1)) == 0) tq::hadamard_forward<D>(xq, ybuf, nr, ksg, k_rounds);
    } else {
      for (int j = tid; j < D; j += blockDim.x) {
        for (int r0 = 0; r0 < nr; r0 += 4) {
          float a[4];
          tq::col_dot_rows<D, 4>(xq + r0 * D, kr_t, j, a);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (r0 + k < ROWS) ybuf[(r0 + k) * D + j] = a[k];
        }
      }
      __syncthreads();
    }
  }
  for (int r = warp; r < QROWS; r += 4) {
    float m = 0.f;
    if (r < nr)
      for (int k = lane; k < D; k += 32) m = fmaxf(m, fabsf(ybuf[r * D + k]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float amax = m > 0.f ? m : 1e-30f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i)
      q16s[r * D + lane + 32 * i] = (r < nr) ? tq_f2h(ybuf[r * D + pk[i]] / amax) : (tq_u16)0;
    if (lane == 0) rss[r] = (r < nr) ? amax * mult : 0.f;
  }
  __syncthreads();

  // ---- 2. this warp's split
  const int split = blockIdx.x * 4 + warp;
  const int len = min(max(seq_lens[bh / Hkv], 0), Tcap);
  const int begin = split < nsplit ? split * tokens_per_warp : 0;
  const int end = split < nsplit ? min(begin + tokens_per_warp, len) : 0;
  tq::WarpResult<D, NARROW> res;
  tq::split_warp<D, BK, BV, KBF, VBF, false, NARROW, TQ_FUSED_STAGES, LANE>(
      res, ktab, vtab, kreg, q16s, rss, q16s, rss, kcodes, knorms, vcodes, vnorms, nullptr, nullptr,
      (long long)bh * Tcap, begin, end);

  // ---- 3. merge the four warps in shared memory
  int ra, rb;
  tq::owned_rows<NARROW>(ra, rb);
  if (NARROW ? (lane >> 2) == 0 : (lane & 3) == 0) {
    wm[warp][ra] = res.m0;
    wl[warp][ra] = res.l0;
    wm[warp][rb] = res.m1;
    wl[warp][rb] = res.l1;
  }
  __syncthreads();
  float ma = NEG_INF, mb = NEG_INF;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    ma = fmaxf(ma, wm[w][ra]);
    mb = fmaxf(mb, wm[w][rb]);
  }
  tq::SharedSink<D, NARROW> sink{ybuf, res.m0 == NEG_INF ? 0.f : tq_exp2(res.m0 - ma),
                         res.m1 == NEG_INF ? 0.f : tq_exp2(res.m1 - mb), ra, rb, true};
  if (tid < ROWS) {
    float m = NEG_INF, l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) m = fmaxf(m, wm[w][tid]);
#pragma unroll
    for (int w = 0; w < 4; ++w) l += wm[w][tid] == NEG_INF ? 0.f : tq_exp2(wm[w][tid] - m) * wl[w][tid];
    rowm[tid] = m;
    rowl[tid] = l;
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if (warp == w) {
      sink.first = (w == 0);
      tq::emit_warp<D, NARROW>(res, sink);
    }
    __syncthreads();
  }
  // the block's partial: rows < nr of [ROWS, D] and (m, l)
  {
    float* po = part_o + ((long long)bh * nblk + blockIdx.x) * R * D + (long long)R0 * D;
    for (int i = tid; i < nr * D / 4; i += blockDim.x) {
      const float* y = ybuf + ML::at(4 * i / D, 4 * i % D);
      reinterpret_cast<float4*>(po)[i] = make_float4(y[0], y[1], y[2], y[3]);
    }
    float* pml = part_ml + (((long long)bh * nblk + blockIdx.x) * R + R0) * 2;
    if (tid < nr) *reinterpret_cast<float2*>(pml + 2 * tid) = make_float2(rowm[tid], rowl[tid]);
  }

  // ---- 4. the last block of the tile merges every block's partial
  unsigned int* counter = counters + (long long)bh * RT + rt;
  // the barrier orders every thread's partial stores before thread 0's release; its acquire and the
  // next barrier order the last block's partial loads (ld.cg, L2) after every other block's release
  // (the CTA-wide release pattern of cooperative groups' grid sync; __threadfence by every thread before
  // and after instead: H200, b1 x 32k, the publish 1.1 us against 0.7)
  __syncthreads();
  if (tid == 0) is_last = tq::atomic_inc_acq_rel(counter, (unsigned)nblk - 1u) == (unsigned)nblk - 1u;
  __syncthreads();
  if (!is_last) return;
  if constexpr (WROT) {
    // warp w merges rows w, w + 4, ... (tq::merge_row: no block barrier in this tail); partial loads in
    // flight per lane: 8 for narrow tiles of head_dim <= 64 (their 128-register bound) and above
    // head_dim 128, else 16
    constexpr int TB = ((NARROW && D <= 64) || E > 4) ? 8 : 16;
    const bool vhad = HAD && v_rounds > 0;
    for (int r = warp; r < nr; r += 4) {
      const long long row = (long long)bh * R + R0 + r;  // output row
      tq::merge_row<D, TB, MAXB, HAD>(part_o + ((long long)bh * nblk * R + R0 + r) * D,
                                      part_ml + ((long long)bh * nblk * R + R0 + r) * 2, nblk, R, xq + r * MAXB,
                                      vhad ? v_signs : nullptr, v_rounds, out, out_kind, row * D, lse + row,
                                      ybuf + r * D);
    }
    if (!vhad) {
      // out = y @ R_v with a dense rotation (read from L2), in the output dtype
      __syncthreads();
      tq::dense_rotate_out<D>(ybuf, nr, v_rotation, out, out_kind, (long long)bh * R + R0);
    }
  } else {
    constexpr int TPR = D / 4;  // threads per row in the weighted sum (one float4 each)
    // partial loads in flight per thread: 8 for narrow tiles of head_dim <= 64 (their 128-register
    // bound), else 16
    constexpr int TB = (NARROW && D <= 64) ? 8 : 16;
    const float* pbase = part_o + (long long)bh * nblk * R * D + (long long)R0 * D;
    const long long bstride = (long long)R * D;
    // the first batch of this thread's first (row, float4) does not depend on the weights: in flight
    // while they are computed
    float4 pre[TB];
    if (tid < nr * TPR) {
      const float* p = pbase + (long long)(tid / TPR) * D + 4 * (tid % TPR);
#pragma unroll
      for (int k = 0; k < TB; ++k)
        pre[k] = k < nblk ? __ldcg(reinterpret_cast<const float4*>(p + k * bstride)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float* sm = xq;                // [ROWS][MAXB] maxima, then weights
    float* sl = xq + ROWS * MAXB;  // [ROWS][MAXB] sums
    for (int i = tid; i < nr * nblk; i += blockDim.x) {
      const int r = i / nblk, b = i - r * nblk;
      const float2 v = __ldcg(reinterpret_cast<const float2*>(part_ml + (((long long)bh * nblk + b) * R + R0 + r) * 2));
      sm[r * MAXB + b] = v.x;
      sl[r * MAXB + b] = v.y;
    }
    __syncthreads();
    for (int r = warp; r < nr; r += 4) {
      float M = NEG_INF;
      for (int b = lane; b < nblk; b += 32) M = fmaxf(M, sm[r * MAXB + b]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
      const float Mu = (M == NEG_INF) ? 0.f : M;
      float Ls = 0.f;
      for (int b = lane; b < nblk; b += 32) {
        const float l = sl[r * MAXB + b];
        const float w = (l > 0.f) ? tq_exp2(sm[r * MAXB + b] - Mu) : 0.f;
        sm[r * MAXB + b] = w;
        Ls += w * l;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) Ls += __shfl_xor_sync(0xffffffffu, Ls, o);
      if (lane == 0) {
        rowm[r] = M;
        rowl[r] = Ls;
      }
    }
    __syncthreads();
    // weighted sum of the block partials: one float4 of one row per thread, TB loads in flight
    {
      for (int i = tid; i < nr * TPR; i += blockDim.x) {
        const int r = i / TPR, c = 4 * (i - r * TPR);
        const float* p = pbase + (long long)r * D + c;
        const float* w = sm + r * MAXB;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int b = 0; b < nblk; b += TB) {
          float4 v[TB];
#pragma unroll
          for (int k = 0; k < TB; ++k)
            v[k] = (i == tid && b == 0) ? pre[k]
                   : (b + k < nblk) ? __ldcg(reinterpret_cast<const float4*>(p + (b + k) * bstride))
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int k = 0; k < TB; ++k) {
            const float wk = (b + k < nblk) ? w[b + k] : 0.f;
            if (wk != 0.f) {
              a.x += wk * v[k].x;
              a.y += wk * v[k].y;
              a.z += wk * v[k].z;
              a.w += wk * v[k].w;
            }
          }
        }
        const float L = rowl[r];
        const float inv = L > 0.f ? 1.f / L : 0.f;
        float* y = ybuf + r * D + c;
        y[0] = a.x * inv;
        y[1] = a.y * inv;
        y[2] = a.z * inv;
        y[3] = a.w * inv;
      }
    }
    __syncthreads();
    // out = y @ R_v, in the output dtype; lse in natural log
    if (v_rounds > 0) {
      if constexpr ((D & (D - 1)) == 0) tq::hadamard_inverse<D>(ybuf, nr, vsg, v_rounds);
      for (int i = tid; i < nr * D; i += blockDim.x) {
        const long long o = ((long long)bh * R + R0) * D + i;
        if (out_kind == 0) reinterpret_cast<float*>(out)[o] = ybuf[i];
        else if (out_kind == 1) reinterpret_cast<tq_u16*>(out)[o] = tq_f2h(ybuf[i]);
        else reinterpret_cast<tq_u16*>(out)[o] = tq_f2bf(ybuf[i]);
      }
    } else {
      tq::dense_rotate_out<D>(ybuf, nr, v_rotation, out, out_kind, (long long)bh * R + R0);
    }
    if (tid < nr) {
      const float L = rowl[tid];
      lse[(long long)bh * R + R0 + tid] = (L > 0.f) ? (rowm[tid] + __log2f(L)) * 0.69314718055994531f : NEG_INF;
    }
  }
}
