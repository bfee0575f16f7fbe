// Fused decode attention on a TurboQuant-compressed KV cache (tq layout v1), flash-decoding style.
//
// Kernel 1 (tq_decode_split): one warp owns one (sequence, kv head, 16-row query tile, token split).
// Per 16-token step it loads the packed key codes, value codes and norms straight from the cache,
// dequantizes them in registers (codebook in shared memory) into tensor-core fragments and runs
//   S = Q_rot K_rot^T           (mma.sync m16n8k16, fp16 in, fp32 out; key norms applied in fp32)
//   online softmax (base 2)
//   O += (P * value_norms) V_rot (mma.sync, fp16 or bf16 in, fp32 accumulators)
// All query heads of a GQA group (times q_len) are the 16 rows of the tile, so each K/V byte is read
// once for the whole group. Partial (O, m, l) go to scratch; kernel 2 (tq_decode_merge) merges the
// splits with a log-sum-exp and applies the inverse rotation once per output row.
//
// Dimension bookkeeping. The mma k index is a permutation of the head dimension chosen so that each
// thread reads a contiguous run of codes: thread t (= lane % 4) of a key row owns coordinates
// [t*D/4, (t+1)*D/4); at k-step s its B registers hold its coordinates 4s..4s+3. The launcher
// permutes the query the same way (decode_attention.key_permutation). For values, thread g
// (= lane / 4) owns dims [g*D/8, (g+1)*D/8); n-tile i column g is dim g*D/8 + i.
#include "tq_common.cuh"

// Blocks per SM the register allocation must allow (128 threads each); set with -DTQ_MIN_BLOCKS=n.
#ifndef TQ_MIN_BLOCKS
#define TQ_MIN_BLOCKS 2
#endif

namespace tq {

// Codebook tables in shared memory. Codes of <= 3 bits are looked up two at a time (a 2^(2b)-entry
// table of packed pairs: 64 words at most, cheap on banks); 4-bit codes one at a time.
template <int BITS, bool BF>
struct CodeTable {
  static constexpr bool PAIRED = BITS <= 3;
  static constexpr int N1 = 1 << BITS;
  static constexpr int N2 = PAIRED ? (1 << (2 * BITS)) : 1;
  tq_u16 single[N1];
  tq_u32 pair[N2];

  TQ_DEVI void fill(const float* __restrict__ cb, int tid, int nthreads) {
    for (int i = tid; i < N1; i += nthreads) single[i] = tq_f_to_16<BF>(cb[i]);
    if constexpr (PAIRED) {
      for (int i = tid; i < N2; i += nthreads)
        pair[i] = tq_pack2(tq_f_to_16<BF>(cb[i & (N1 - 1)]), tq_f_to_16<BF>(cb[i >> BITS]));
    }
  }
  // Packed (lo, hi) pair of dequantized codes.
  TQ_DEVI tq_u32 lookup2(tq_u32 lo, tq_u32 hi) const {
    if constexpr (PAIRED) return pair[lo | (hi << BITS)];
    else return tq_pack2(single[lo], single[hi]);
  }
  // Same, when lo and hi are already adjacent in one 2*BITS-bit field.
  TQ_DEVI tq_u32 lookup_field(tq_u32 f) const {
    if constexpr (PAIRED) return pair[f];
    else return tq_pack2(single[f & (N1 - 1)], single[f >> BITS]);
  }
};

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
};

// Raw (not yet dequantized) bytes of one 16-token step, held by one thread.
template <class T>
struct StepRegs {
  TqBits<T::KBITS> k[2];     // key tokens g and 8 + g, coordinates of thread t
  TqBits<T::VBITS> v[4];     // value tokens 2t, 2t+1, 2t+8, 2t+9, dims of thread g
  TqBits<T::QBITS> s[2];     // QJL sign bits (prod keys only; unused otherwise)
  tq_u16 kn[4], vn[4], rn[4];  // norms of tokens 2t, 2t+1, 2t+8, 2t+9
};

template <class T, bool QJL>
TQ_DEVI void load_step(StepRegs<T>& r, int base, int len, int g, int t,
                       const tq_u32* __restrict__ kc, const tq_u16* __restrict__ kn,
                       const tq_u32* __restrict__ vc, const tq_u16* __restrict__ vn,
                       const tq_u32* __restrict__ qc, const tq_u16* __restrict__ rn) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int tok = base + 8 * j + g;
    const bool ok = tok < len;
    tq_load_bits<T::KBITS, T::KALIGN>(r.k[j], kc + (long long)tok * T::KROW_WORDS, t * T::KBITS, ok);
    if constexpr (QJL)
      tq_load_bits<T::QBITS, T::QALIGN>(r.s[j], qc + (long long)tok * T::QROW_WORDS, t * T::QBITS, ok);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = base + 2 * t + (j & 1) + 8 * (j >> 1);
    const bool ok = tok < len;
    tq_load_bits<T::VBITS, T::VALIGN>(r.v[j], vc + (long long)tok * T::VROW_WORDS, g * T::VBITS, ok);
    r.kn[j] = ok ? __ldg(kn + tok) : (tq_u16)0;
    r.vn[j] = ok ? __ldg(vn + tok) : (tq_u16)0;  // masked tokens: value norm 0 keeps garbage out
    if constexpr (QJL) r.rn[j] = ok ? __ldg(rn + tok) : (tq_u16)0;
  }
}

}  // namespace tq

// q16:       [BH, RT*16, D] fp16, rotated, key-permuted, each row divided by its max |.| (pad rows 0)
// row_scale: [BH, RT*16] fp32: max|.| * softmax_scale * log2(e) (0 for pad rows)
// kcodes:    [BH, Tcap, D*BK/8] uint8; knorms [BH, Tcap] fp16/bf16 (KBF)
// vcodes:    [BH, Tcap, D*BV/8] uint8; vnorms [BH, Tcap] fp16/bf16 (VBF)
// qs16/qs_scale/qjl/rnorms: the QJL analogues (prod keys, m = D); ignored unless QJL
// seq_lens:  [B] int32 (compressed tokens per sequence, <= Tcap)
// part_o:    [BH, nsplit, R, D] fp32 (unpermuted rotated dims); part_ml: [BH, nsplit, R, 2] (m, l)
template <int D, int BK, int BV, bool KBF, bool VBF, bool QJL>
__global__ void __launch_bounds__(128, (QJL ? 2 : TQ_MIN_BLOCKS)) tq_decode_split(
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
  ktab.fill(k_codebook, threadIdx.x, blockDim.x);
  vtab.fill(v_codebook, threadIdx.x, blockDim.x);
  __syncthreads();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int bh = blockIdx.y, rt = blockIdx.z;
  if (split >= nsplit) return;
  const int b = bh / Hkv;
  const int len = seq_lens[b];
  const int begin = split * tokens_per_warp;
  const int end = min(begin + tokens_per_warp, len);

  // Query fragments (A operand), one set per k-step.
  const int rows = RT * 16;
  const tq_u16* qrow0 = q16 + ((long long)bh * rows + rt * 16 + g) * D;
  const tq_u16* qrow1 = qrow0 + 8 * D;
  tq_u32 qa[T::KS][4];
#pragma unroll
  for (int s = 0; s < T::KS; ++s) {
    qa[s][0] = *reinterpret_cast<const tq_u32*>(qrow0 + 16 * s + 2 * t);
    qa[s][1] = *reinterpret_cast<const tq_u32*>(qrow1 + 16 * s + 2 * t);
    qa[s][2] = *reinterpret_cast<const tq_u32*>(qrow0 + 16 * s + 2 * t + 8);
    qa[s][3] = *reinterpret_cast<const tq_u32*>(qrow1 + 16 * s + 2 * t + 8);
  }
  tq_u32 sa[QJL ? T::KS : 1][4];
  float qjl_scale0 = 0.f, qjl_scale1 = 0.f;
  if constexpr (QJL) {
    const tq_u16* srow0 = qs16 + ((long long)bh * rows + rt * 16 + g) * D;
    const tq_u16* srow1 = srow0 + 8 * D;
#pragma unroll
    for (int s = 0; s < T::KS; ++s) {
      sa[s][0] = *reinterpret_cast<const tq_u32*>(srow0 + 16 * s + 2 * t);
      sa[s][1] = *reinterpret_cast<const tq_u32*>(srow1 + 16 * s + 2 * t);
      sa[s][2] = *reinterpret_cast<const tq_u32*>(srow0 + 16 * s + 2 * t + 8);
      sa[s][3] = *reinterpret_cast<const tq_u32*>(srow1 + 16 * s + 2 * t + 8);
    }
    qjl_scale0 = qs_scale[(long long)bh * rows + rt * 16 + g];
    qjl_scale1 = qs_scale[(long long)bh * rows + rt * 16 + g + 8];
  }
  const float rs0 = row_scale[(long long)bh * rows + rt * 16 + g];
  const float rs1 = row_scale[(long long)bh * rows + rt * 16 + g + 8];

  const long long tok0 = (long long)bh * Tcap;
  const tq_u32* kc = reinterpret_cast<const tq_u32*>(kcodes) + tok0 * T::KROW_WORDS;
  const tq_u32* vc = reinterpret_cast<const tq_u32*>(vcodes) + tok0 * T::VROW_WORDS;
  const tq_u16* kn = knorms + tok0;
  const tq_u16* vn = vnorms + tok0;
  const tq_u32* qc = QJL ? reinterpret_cast<const tq_u32*>(qjl) + tok0 * T::QROW_WORDS : nullptr;
  const tq_u16* rn = QJL ? rnorms + tok0 : nullptr;

  float acc[T::NT][4];
#pragma unroll
  for (int i = 0; i < T::NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const float NEG_INF = -__int_as_float(0x7f800000);
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

  tq::StepRegs<T> ra, rb;
  auto step = [&](const tq::StepRegs<T>& cur, int base) {
      // ---- scores: two n8 tiles (tokens base + 0..7 and base + 8..15)
      float sc[2][4];
      float sq[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
        sq[j][0] = sq[j][1] = sq[j][2] = sq[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < T::KS; ++s) {
          const tq_u32 b0 = ktab.lookup_field(tq_field<2 * BK>(cur.k[j], (4 * s) * BK));
          const tq_u32 b1 = ktab.lookup_field(tq_field<2 * BK>(cur.k[j], (4 * s + 2) * BK));
          tq_mma16816<false>(sc[j], qa[s], b0, b1);
          if constexpr (QJL) {
            const tq_u32 c0 = tq::qjl_pair(tq_field<2>(cur.s[j], 4 * s));
            const tq_u32 c1 = tq::qjl_pair(tq_field<2>(cur.s[j], 4 * s + 2));
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
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float mu0 = (mn0 == NEG_INF) ? 0.f : mn0;  // all-masked row so far: avoid inf - inf
      const float mu1 = (mn1 == NEG_INF) ? 0.f : mn1;
      const float al0 = tq_exp2(m0 - mu0), al1 = tq_exp2(m1 - mu1);
      m0 = mn0;
      m1 = mn1;
      float ps0 = 0.f, ps1 = 0.f;
      tq_u32 pa[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float e0 = tq_exp2(p[j][0] - mu0), e1 = tq_exp2(p[j][1] - mu0);
        float e2 = tq_exp2(p[j][2] - mu1), e3 = tq_exp2(p[j][3] - mu1);
        ps0 += e0 + e1;
        ps1 += e2 + e3;
        const float vn0 = tq_16_to_f<VBF>(cur.vn[2 * j]), vn1 = tq_16_to_f<VBF>(cur.vn[2 * j + 1]);
        pa[2 * j + 0] = tq_pack2(tq_f_to_16<VBF>(e0 * vn0), tq_f_to_16<VBF>(e1 * vn1));
        pa[2 * j + 1] = tq_pack2(tq_f_to_16<VBF>(e2 * vn0), tq_f_to_16<VBF>(e3 * vn1));
      }
      l0 = l0 * al0 + ps0;
      l1 = l1 * al1 + ps1;
      // A fragment order: (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..)
      const tq_u32 pfrag[4] = {pa[0], pa[1], pa[2], pa[3]};
#pragma unroll
      for (int i = 0; i < T::NT; ++i) {
        acc[i][0] *= al0;
        acc[i][1] *= al0;
        acc[i][2] *= al1;
        acc[i][3] *= al1;
        const tq_u32 b0 = vtab.lookup2(tq_field<BV>(cur.v[0], i * BV), tq_field<BV>(cur.v[1], i * BV));
        const tq_u32 b1 = vtab.lookup2(tq_field<BV>(cur.v[2], i * BV), tq_field<BV>(cur.v[3], i * BV));
        tq_mma16816<VBF>(acc[i], pfrag, b0, b1);
      }
  };
  // Two register buffers alternate so the loads of step i+1 are in flight while step i computes.
  if (begin < end) tq::load_step<T, QJL>(ra, begin, end, g, t, kc, kn, vc, vn, qc, rn);
  for (int base = begin; base < end; base += 32) {
    if (base + 16 < end) tq::load_step<T, QJL>(rb, base + 16, end, g, t, kc, kn, vc, vn, qc, rn);
    step(ra, base);
    if (base + 16 >= end) break;
    if (base + 32 < end) tq::load_step<T, QJL>(ra, base + 32, end, g, t, kc, kn, vc, vn, qc, rn);
    step(rb, base + 16);
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

  const int r0 = rt * 16 + g, r1 = r0 + 8;
  float* po = part_o + ((long long)bh * nsplit + split) * R * D;
  float* pml = part_ml + ((long long)bh * nsplit + split) * R * 2;
#pragma unroll
  for (int i = 0; i < T::NT; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int dim = T::CV * (2 * t + e) + i;
      if (r0 < R) po[(long long)r0 * D + dim] = acc[i][e];
      if (r1 < R) po[(long long)r1 * D + dim] = acc[i][2 + e];
    }
  }
  if (t == 0) {
    if (r0 < R) { pml[2 * r0] = m0; pml[2 * r0 + 1] = l0; }
    if (r1 < R) { pml[2 * r1] = m1; pml[2 * r1 + 1] = l1; }
  }
}

// Merge the splits of one output row (log-sum-exp), then undo the rotation: out = y @ rotation.
// Grid: BH * R blocks of D threads. out: [BH, R, D] fp32; lse: [BH, R] natural log of the sum of
// exp(softmax_scale * score) over the compressed tokens (-inf when there are none).
template <int D>
__global__ void __launch_bounds__(D) tq_decode_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const float* __restrict__ rotation,
    int R, int nsplit, float* __restrict__ out, float* __restrict__ lse) {
  __shared__ float y[D];
  __shared__ float red[2];
  const int row = blockIdx.x;  // bh * R + r
  const int bh = row / R, r = row % R;
  const int d = threadIdx.x;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const float* ml = part_ml + (long long)bh * nsplit * R * 2;
  float M = NEG_INF;
  for (int s = 0; s < nsplit; ++s) M = fmaxf(M, ml[((long long)s * R + r) * 2]);
  const float Mu = (M == NEG_INF) ? 0.f : M;
  float L = 0.f, acc = 0.f;
  const float* po = part_o + (long long)bh * nsplit * R * D;
  for (int s = 0; s < nsplit; ++s) {
    const float m = ml[((long long)s * R + r) * 2];
    const float l = ml[((long long)s * R + r) * 2 + 1];
    if (l > 0.f) {
      const float w = tq_exp2(m - Mu);
      L += w * l;
      acc += w * po[((long long)s * R + r) * D + d];
    }
  }
  y[d] = (L > 0.f) ? acc / L : 0.f;
  if (d == 0) { red[0] = L; red[1] = M; }
  __syncthreads();
  float o = 0.f;
#pragma unroll 8
  for (int i = 0; i < D; ++i) o += y[i] * __ldg(rotation + i * D + d);
  out[(long long)row * D + d] = o;
  if (d == 0) lse[row] = (red[0] > 0.f) ? (red[1] + __log2f(red[0])) * 0.69314718055994531f : NEG_INF;
}
