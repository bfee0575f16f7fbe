// GPU encoder of the kvctx / predictive stream format 2 (launchers: kvcodec/lossless/cuda/kvctx_encode.py; driver:
// kvcodec/lossless/kvctx_device_encode.py; format: kvcodec/lossless/predictive/{bins,binned,format2}.py).
// The CPU encoder (binned.symbolise + binned.write_chunks) is the reference; the model arithmetic is the
// GPU decoder's own (kx_locate, kx_value of kvctx_decode.cu, included), so what the decoder
// computes from a value's predecessors is what was computed here.
//
// A "column" is one channel d of one leading index g over one token block of tb tokens (the previous-token
// term restarts at every block start, in the fit as in the coder): it is a sequential chain, columns are
// independent, so the per-value passes run one thread per column (consecutive d on consecutive threads:
// coalesced loads).
//   ke_fit_moments / ke_fit_residuals: per-column partial sums of params.fit_params (summed over the
//     blocks by the host side; the parameters are stored in the stream, so these need not equal the CPU's
//     bit for bit);
//   ke_symbolise: every value's (class, symbol) key and (raw code, raw bit count) as binned.symbolise finds them, the
//     per-class symbol histogram (a block's in shared memory, ~0.5 ms less than warp-aggregated global atomics
//     on a 256 MB tensor; added into KE_HIST_COPIES copies) and per-chunk raw bits;
//   ke_bits: one warp per chunk, one pass backwards: the LSB-first raw bits (their places known from the
//     chunk's total) through a per-warp ring of 32-bit words in shared memory straight into the bits section;
//     it needs no table, so it runs while the host builds them;
//   ke_encode: one warp per chunk, one pass backwards: the 32-lane rANS stream (rans_lanes.encode's word
//     order, lane_rans.cuh's encode step, as planes_codec.cu's pc_rans_encode) into a scratch slot; the
//     model's field parts ride along as more chunks.
#include "kvctx_decode.cu"
#include "kvcodec/entropy/cuda/lane_rans.cuh"

#ifndef KE_SHARED
#define KE_SHARED __shared__
#endif

// The integer type of kx_locate's bin coordinate (its 6th parameter, a reference), whichever the decoder
// declares, so that the encoder calls the decoder's own function.
template <class T> struct KeDeref { typedef T type; };
template <class T> struct KeDeref<T&> { typedef T type; };
template <class F> struct KeCentreOf;
template <class R, class A, class B, class C, class D, class E, class F, class G>
struct KeCentreOf<R (*)(A, B, C, D, E, F, G)> { typedef typename KeDeref<F>::type type; };
typedef KeCentreOf<decltype(&kx_locate<false>)>::type ke_centre;

#define KE_HIST_COPIES 32
#define KE_RING 64  // raw-bit words per warp ring (a round adds at most 32)

template <int W>
__device__ __forceinline__ int ke_pat(const void* __restrict__ pats, long long i) {
  return W == 1 ? (int)__ldg(reinterpret_cast<const kx_u8*>(pats) + i)
                : (int)__ldg(reinterpret_cast<const kx_u16*>(pats) + i);
}

__device__ __forceinline__ double ke_pred(const float* __restrict__ pred, long long i) {
  if (!pred) return 0.0;
  const float p = __ldg(pred + i);
  return isfinite(p) ? (double)p : 0.0;  // cdf.prediction_at
}

// This thread's column: col = (g * nblk + b) * D + d (one thread per column, consecutive d on consecutive
// threads), its g, d and token range [t0, t1); valid is false past the last column.
struct KeColumn {
  long long col, g, t0, t1;
  int d;
  bool valid;
};

__device__ __forceinline__ KeColumn ke_column(long long G, long long T, int D, long long tb, long long nblk) {
  KeColumn k = {(long long)blockIdx.x * blockDim.x + threadIdx.x, 0, 0, 0, 0, false};
  k.valid = k.col < G * nblk * D;
  if (!k.valid) return k;
  k.d = (int)(k.col % D);
  const long long gb = k.col / D;
  k.g = gb / nblk;
  k.t0 = (gb % nblk) * tb;
  k.t1 = min(T, k.t0 + tb);
  return k;
}

// A consecutive tokens of one column loaded before the first is used: its bit patterns, values (val: float64
// per pattern, NaN where not finite) and predictions, each load independent of the sums. Why: the per-column
// passes are chains of dependent loads (pattern, then its value); one token a step leaves each thread
// waiting a full memory latency per token (H200: moments 0.51 -> 0.37 ms on a 256 MB tensor at
// A = 4; the residual pass ran slower at 4: 78 registers, 3 blocks an SM). Tokens at or past t1 read
// pattern 0's value and are skipped by the caller.
#define KE_MOMENTS_AHEAD 4
#ifndef KE_RES_AHEAD
#define KE_RES_AHEAD 1
#endif
template <int W, int A>
struct KeTokens {
  int pat[A];
  double x[A], p[A];

  __device__ __forceinline__ void load(const void* __restrict__ pats, const float* __restrict__ pred,
                                       const double* __restrict__ val, long long at, int D, long long t0,
                                       long long t1) {
#pragma unroll
    for (int j = 0; j < A; ++j) {
      const bool in = t0 + j < t1;
      pat[j] = in ? ke_pat<W>(pats, at + (t0 + j) * D) : 0;
      p[j] = in ? ke_pred(pred, at + (t0 + j) * D) : 0.0;
    }
#pragma unroll
    for (int j = 0; j < A; ++j) x[j] = __ldg(val + pat[j]);
  }
};

// Per column: [n finite, sum x, sum p, sum x p, sum p p, n with a bin width, sum log2 width] (the fields of
// params._fit_moments). val / lw: float64 per bit pattern, NaN where not finite / no width.
template <int W>
__global__ void __launch_bounds__(256)
    ke_fit_moments(const void* __restrict__ pats, const float* __restrict__ pred, const double* __restrict__ val,
                   const double* __restrict__ lw, long long G, long long T, int D, long long tb, long long nblk,
                   double* __restrict__ out) {
  const KeColumn k = ke_column(G, T, D, tb, nblk);
  if (!k.valid) return;
  double n = 0.0, sx = 0.0, sp = 0.0, sxp = 0.0, spp = 0.0, nw = 0.0, slw = 0.0;
  const long long at = k.g * T * D + k.d;  // value (g, t, d) is at + t D
  for (long long t0 = k.t0; t0 < k.t1; t0 += KE_MOMENTS_AHEAD) {
    KeTokens<W, KE_MOMENTS_AHEAD> tok;
    tok.load(pats, pred, val, at, D, t0, k.t1);
    double l[KE_MOMENTS_AHEAD];
#pragma unroll
    for (int j = 0; j < KE_MOMENTS_AHEAD; ++j) l[j] = __ldg(lw + tok.pat[j]);
#pragma unroll
    for (int j = 0; j < KE_MOMENTS_AHEAD; ++j) {  // the tokens in order: the same sums as one token a step
      if (t0 + j >= k.t1) break;
      if (l[j] == l[j]) {
        nw += 1.0;
        slw += l[j];
      }
      const double x = tok.x[j], p = tok.p[j];
      if (x != x) continue;
      n += 1.0;
      sx += x;
      sp += p;
      sxp += __dmul_rn(x, p);
      spp += __dmul_rn(p, p);
    }
  }
  double* o = out + 7 * k.col;
  o[0] = n;
  o[1] = sx;
  o[2] = sp;
  o[3] = sxp;
  o[4] = spp;
  o[5] = nw;
  o[6] = slw;
}

// One parameter set of ke_fit_residuals: m, c, a float64 [Gp * D] (Gp = 1 when shared).
struct KeLocation {
  const double *m, *c, *a;
  int shared;
};

// params._fit_residuals' sums of one column under one location: [sum (x - base) * dev, sum dev**2,
// sum (x - mu)**2] over finite x (dev: the previous token's x - base, 0 at the column start and after a
// non-finite x).
struct KeResidual {
  double mm, cc, aa, dev, s0, s1, s2;

  __device__ __forceinline__ void start(const KeLocation& l, long long g, int D, int d) {
    const long long pi = (l.shared ? 0 : g) * D + d;
    mm = l.m[pi];
    cc = l.c[pi];
    aa = l.a[pi];
    dev = s0 = s1 = s2 = 0.0;
  }

  __device__ __forceinline__ void add(double x, double p) {
    const double base = __dadd_rn(mm, __dmul_rn(cc, p));
    if (x == x) {
      const double r = __dsub_rn(x, __dadd_rn(base, __dmul_rn(aa, dev)));
      s0 += __dmul_rn(__dsub_rn(x, base), dev);
      s1 += __dmul_rn(dev, dev);
      s2 += __dmul_rn(r, r);
      dev = __dsub_rn(x, base);
    } else {
      dev = 0.0;
    }
  }

  __device__ __forceinline__ void store(double* o) const {
    o[0] = s0;
    o[1] = s1;
    o[2] = s2;
  }
};

// Per column: KeResidual's 3 sums under each of SETS locations (out [columns, 3 * SETS]): the shared and
// the per-(g, d) candidates of the model are fitted in the same passes over the tensor.
template <int W, int SETS>
__global__ void __launch_bounds__(256)
    ke_fit_residuals(const void* __restrict__ pats, const float* __restrict__ pred, const double* __restrict__ val,
                     const double* __restrict__ m0, const double* __restrict__ c0, const double* __restrict__ a0,
                     int shared0, const double* __restrict__ m1, const double* __restrict__ c1,
                     const double* __restrict__ a1, int shared1, long long G, long long T, int D, long long tb,
                     long long nblk, double* __restrict__ out) {
  const KeColumn k = ke_column(G, T, D, tb, nblk);
  if (!k.valid) return;
  const KeLocation loc[2] = {{m0, c0, a0, shared0}, {m1, c1, a1, shared1}};
  KeResidual r[SETS];
  for (int j = 0; j < SETS; ++j) r[j].start(loc[j], k.g, D, k.d);
  const long long at = k.g * T * D + k.d;
  for (long long t0 = k.t0; t0 < k.t1; t0 += KE_RES_AHEAD) {
    KeTokens<W, KE_RES_AHEAD> tok;
    tok.load(pats, pred, val, at, D, t0, k.t1);
#pragma unroll
    for (int j = 0; j < KE_RES_AHEAD; ++j) {  // the tokens in order
      if (t0 + j >= k.t1) break;
      for (int q = 0; q < SETS; ++q) r[q].add(tok.x[j], tok.p[j]);
    }
  }
  for (int j = 0; j < SETS; ++j) r[j].store(out + (3 * SETS) * k.col + 3 * j);
}

// ---- the fit's per-channel formulas (params.fit_params, format2.BinParams.from_channel / kernel_args; the
// host side: kvcodec/lossless/kvctx_device_fit.py). One thread per channel of the candidates stacked into
// [R, D] rows (the per-(g, d) rows, then the shared row when both are fitted): every formula step of every
// candidate is one launch. Same operations and order as the host formulas (no FMA: __dmul_rn / __dadd_rn),
// round to nearest even (rint), NaN / inf as numpy's nan_to_num.
// The host's constants (kvctx_encode.fit_constants): params.S_MIN, S_MAX, Q, format2's level range,
// bins.EP_MAX, format2's mq bound, as float64 [7].
struct KeFitConsts {
  double s_min, s_max;
  int q, level_lo, level_hi, ep_max, mq_max;
};

__device__ __forceinline__ KeFitConsts ke_consts(const double* __restrict__ p) {
  return {p[0], p[1], (int)p[2], (int)p[3], (int)p[4], (int)p[5], (int)p[6]};
}

#define KE_DBL_MAX 1.7976931348623157e308

__device__ __forceinline__ double ke_nan_to_num(double x) {
  return x != x ? 0.0 : x > KE_DBL_MAX ? KE_DBL_MAX : x < -KE_DBL_MAX ? -KE_DBL_MAX : x;
}

__device__ __forceinline__ double ke_clamp(double x, double lo, double hi) { return x < lo ? lo : x > hi ? hi : x; }

// params.to_bf16_bits / from_bf16_bits: x rounded to float32, then to bf16 (nearest even), as float64.
__device__ __forceinline__ double ke_bf16(double x) {
  const double f = (double)(float)x;
  if (f == 0.0 || !(fabs(f) <= KE_DBL_MAX)) return f;
  if (fabs(f) < 1.1754943508222875e-38) return ldexp(rint(ldexp(f, 133)), -133);  // bf16 subnormals: steps of 2**-133
  int e;
  const double mant = frexp(f, &e);
  return ldexp(rint(ldexp(mant, 8)), e - 8);  // 8 significant bits
}

// Gain and location of channel i from its moments (7 per channel): m, c = c_q / Q, c_q; a_q / a start
// at Q / 1 (prev_one: the previous-token coefficient is fixed) or 0. gain: 0 zero, 1 one, 2 fitted.
__global__ void __launch_bounds__(256)
    ke_fit_location(const double* __restrict__ mom, long long n_ch, int gain, int prev_one,
                    const double* __restrict__ consts,
                    double* __restrict__ m, double* __restrict__ c, signed char* __restrict__ c_q,
                    double* __restrict__ a, signed char* __restrict__ a_q) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_ch) return;
  const KeFitConsts k = ke_consts(consts);
  const double* mo = mom + 7 * i;
  const double n = mo[0], safe_n = n < 1.0 ? 1.0 : n;
  double cq = gain == 1 ? (double)k.q : 0.0;
  if (gain == 2) {
    const double cov = __dsub_rn(mo[3], __dmul_rn(mo[1], mo[2]) / safe_n);
    const double var = __dsub_rn(mo[4], __dmul_rn(mo[2], mo[2]) / safe_n);
    const double cf = var > 1e-300 ? cov / var : 0.0;
    cq = ke_clamp(rint(__dmul_rn(ke_nan_to_num(cf), (double)k.q)), -127.0, 127.0);
  }
  const double cc = cq / k.q;
  double mm = 0.0;
  if (!prev_one) {
    const double mean = n > 0.0 ? __dsub_rn(mo[1], __dmul_rn(cc, mo[2])) / safe_n : 0.0;
    mm = ke_bf16(ke_clamp(ke_nan_to_num(mean), -3e38, 3e38));
  }
  m[i] = mm;
  c[i] = cc;
  c_q[i] = (signed char)cq;
  a[i] = prev_one ? 1.0 : 0.0;
  a_q[i] = (signed char)(prev_one ? k.q : 0);
}

// The previous-token coefficient from the residual sums (3 per channel): a_q, a = a_q / Q.
__global__ void __launch_bounds__(256)
    ke_fit_coefficient(const double* __restrict__ res, long long n_ch, const double* __restrict__ consts,
                       double* __restrict__ a, signed char* __restrict__ a_q) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_ch) return;
  const KeFitConsts k = ke_consts(consts);
  const double* r = res + 3 * i;
  const double af = r[1] > 0.0 ? r[0] / r[1] : 0.0;
  const double aq = ke_clamp(rint(__dmul_rn(ke_nan_to_num(af), (double)k.q)), -(double)k.q, (double)k.q);
  a[i] = aq / k.q;
  a_q[i] = (signed char)aq;
}

// The scale from the residual sums and the bin-width moments: s; and the channel's term of
// params.estimated_bits (n log2 s + r2 / (2 s s ln 2)), summed per candidate by the host side.
__global__ void __launch_bounds__(256)
    ke_fit_scale(const double* __restrict__ mom, const double* __restrict__ res, long long n_ch,
                 const double* __restrict__ consts, double* __restrict__ s_out, double* __restrict__ bits) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_ch) return;
  const KeFitConsts k = ke_consts(consts);
  const double* mo = mom + 7 * i;
  const double n = mo[0], safe_n = n < 1.0 ? 1.0 : n, r2 = res[3 * i + 2];
  double s = sqrt(r2 / safe_n);
  const double fl = ke_nan_to_num(mo[5] > 0.0 ? exp2(mo[6] / (mo[5] < 1.0 ? 1.0 : mo[5])) / 4.0 : 0.0);
  s = isfinite(s) ? s : k.s_max;
  s = ke_bf16(ke_clamp(s > fl ? s : fl, k.s_min, k.s_max));
  s_out[i] = s;
  bits[i] = __dadd_rn(__dmul_rn(n, log2(s)), r2 / __dmul_rn(__dmul_rn(__dmul_rn(2.0, s), s), 0.6931471805599453));
}

// format2.BinParams.from_channel + kernel_args of channel i of the chosen candidate (n_ch channels): the
// shared row (row `shared_row` of the stack, index i % D) where *won, else row-major channel i. Writes the
// kernel's arguments (m, c, a float64, (es, level) int32 pairs) and the stored fields' values as int32
// [4, n_ch] in format2.FIELD_ORDER: level, zigzag mq, c and a as bytes.
__global__ void __launch_bounds__(256)
    ke_bin_params(const double* __restrict__ s_in, const double* __restrict__ m_in,
                  const signed char* __restrict__ c_in, const signed char* __restrict__ a_in,
                  const long long* __restrict__ won, long long shared_row, long long n_ch, int D, int eoff,
                  const double* __restrict__ consts, double* __restrict__ pm, double* __restrict__ pc,
                  double* __restrict__ pa, int* __restrict__ pel, int* __restrict__ values) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_ch) return;
  const KeFitConsts k = ke_consts(consts);
  const long long j = won && *won ? shared_row * D + i % D : i;
  const double sv = __dmul_rn(s_in[j], ldexp(1.0, -eoff));  // exact: a power of two
  int ex;
  const double m2 = 2.0 * frexp(sv, &ex);
  const int quarter = (m2 >= 1.189207115002721) + (m2 >= 1.4142135623730951) + (m2 >= 1.6817928305074290);
  int level = 4 * (ex - 1) + quarter;
  level = level < k.level_lo ? k.level_lo : level > k.level_hi ? k.level_hi : level;
  int es = (level >= 0 ? level / 4 : -((-level + 3) / 4)) - 3;  // floor division
  es = es < 0 ? 0 : es > k.ep_max ? k.ep_max : es;
  const double step = ldexp(1.0, es + eoff);
  const double mqf = ke_clamp(ke_nan_to_num(rint(m_in[j] / step)), -(double)k.mq_max, (double)k.mq_max);
  const long long mq = (long long)mqf;
  const int cq = c_in[j], aq = a_in[j];
  pm[i] = __dmul_rn((double)mq, step);
  pc[i] = (double)cq / k.q;
  pa[i] = (double)aq / k.q;
  pel[2 * i] = es;
  pel[2 * i + 1] = level;
  values[i] = level;
  values[n_ch + i] = (int)((mq << 1) ^ (mq >> 63));
  values[2 * n_ch + i] = cq & 0xFF;
  values[3 * n_ch + i] = aq & 0xFF;
}

// Byte histograms of the stored fields' planes (kvctx_device_fit.field_planes: uint8 [n_planes, n]) for the
// model's rANS table: out [2, n_planes, 256] u64 (zeroed) over each plane's first d bytes (the shared row)
// and over all n. One warp a block (its histogram in shared memory), `per_plane` blocks a plane. Zero bytes
// (most of a high plane) are counted in registers and added once a warp: 32 lanes on one shared counter
// would serialize.
__global__ void __launch_bounds__(32)
    ke_plane_hist(const kx_u8* __restrict__ planes, int n_planes, long long n, int d, int per_plane,
                  kx_u64* __restrict__ out) {
  KE_SHARED unsigned hs[512];
  const int lane = threadIdx.x, plane = blockIdx.x / per_plane;
  for (int j = lane; j < 512; j += 32) hs[j] = 0u;
  __syncwarp();
  const kx_u8* p = planes + (long long)plane * n;
  long long zeros_first = 0, zeros = 0;
  for (long long i = (long long)(blockIdx.x % per_plane) * 32 + lane; i < n; i += 32ll * per_plane) {
    const unsigned b = __ldg(p + i);
    if (b) {
      atomicAdd(hs + 256 + b, 1u);
      if (i < d) atomicAdd(hs + b, 1u);
    } else {
      ++zeros;
      zeros_first += i < d;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    zeros += __shfl_xor_sync(KX_FULL, zeros, o);
    zeros_first += __shfl_xor_sync(KX_FULL, zeros_first, o);
  }
  __syncwarp();
  if (lane == 0) {  // bin 0 was not touched above
    hs[0] = (unsigned)zeros_first;
    hs[256] = (unsigned)zeros;
  }
  __syncwarp();
  for (int j = lane; j < 512; j += 32)
    if (hs[j]) atomicAdd(out + ((j >> 8) * n_planes + plane) * 256 + (j & 255), (kx_u64)hs[j]);
}

// bins.bin_of: the bin coordinate of a magnitude pattern (mag < 2**16, 0 <= ep <= EP_MAX), in 32-bit
// integers: shifts of 31 or more give 0, as the 64-bit ones did for these magnitudes.
__device__ __forceinline__ int ke_bin_of(int mag, int ep, int mb) {
  const int ef = mag >> mb;
  if (ef > ep) return mag - (ep << mb);
  if (ef == 0) return ep < 31 ? mag >> ep : 0;
  const int sh = ep + 1 - ef;
  return sh < 31 ? ((1 << mb) | (mag & ((1 << mb) - 1))) >> sh : 0;
}

// bins.encode_value: (symbol, raw code, raw bit count) of pattern pat (< 2**16) in the bins of (ep, centre),
// in 32-bit integers (a raw code has at most 32 bits: bins.DEPTH_MAX). Why: the 64-bit form was a large share
// of ke_symbolise's instructions.
__device__ __forceinline__ int ke_encode_value(int pat, int ep, ke_centre centre, const KxGrid& gr,
                                               const kx_u8* __restrict__ escape, kx_u32& code, int& nb) {
  const int mb = gr.mb;
  code = (kx_u32)pat;
  nb = gr.width;
  if (__ldg(escape + pat)) return KX_ESC;
  const int mag = pat & ~gr.sign & ((1 << gr.width) - 1);
  const int u = ke_bin_of(mag, ep, mb);
  const int j = u ^ -(int)((pat & gr.sign) != 0);
  const ke_centre r = (ke_centre)j - centre;
  if (r < -KX_CENTRE || r > KX_CENTRE) return KX_ESC;
  const int sym = (int)r + KX_CENTRE;
  if (u >= (1 << mb)) {  // one pattern per bin
    code = 0;
    nb = 0;
    return sym;
  }
  if (u == 0) {
    if (ep <= mb + 1) {
      code = (kx_u32)mag;
      nb = ep;
      return sym;
    }
    const int last = ep - mb - 1;  // the level holding both exponent fields 0 and 1
    const int ef = mag >> mb;
    const int dd = ef <= 1 ? last : ep - mb - ef;
    if (dd >= KX_DEPTH_MAX) return KX_ESC;
    if (dd == last) {
      code = (kx_u32)mag << dd;
      nb = dd + mb + 1;
      return sym;
    }
    code = ((kx_u32)(mag & ((1 << mb) - 1)) << (dd + 1)) | (1u << dd);
    nb = dd + 1 + mb;
    return sym;
  }
  const int big_e = kx_floor_log2(u) + ep;  // 1 <= u < 2**mb: 2**nb patterns in one binade
  nb = ep - (big_e > mb ? big_e - mb : 0);
  code = (kx_u32)mag & ((1u << nb) - 1u);
  return sym;
}

#ifndef KE_SYM_AHEAD
#define KE_SYM_AHEAD 1  // ke_symbolise: steps of patterns and predictions loaded ahead
#endif

// Every value's key class << 8 | symbol into keys and raw code << 8 | nbits into raw (tensor order: the rANS
// kernel reads 2 bytes a value, the raw-bit kernel 8), the histogram of
// class << 8 | symbol (hist: KE_HIST_COPIES x n_keys u64, zeroed) and each chunk's raw bit total (the chunks
// of format2.chunk_layout with gb g's a block, blocks within multiples of unit). The model: per channel (pi = gp * D + d) m, c, a = pm, pc, pa[pi]
// and es, level = pel[2 pi], pel[2 pi + 1] (format2.BinParams.kernel_args, which the decoder recomputes
// exactly from the stored fields), then the decoder's kx_locate / kx_value. MAG: the stream's "mag" flag (symbols
// and mu's place in its bin counted by magnitude: bins.magnitude_symbol, binned.symbolise's mag).
template <int W, bool MAG>
__global__ void __launch_bounds__(256)
    ke_symbolise(const void* __restrict__ pats, const float* __restrict__ pred, const double* __restrict__ pm,
                 const double* __restrict__ pc, const double* __restrict__ pa, const int* __restrict__ pel,
                 int shared, const kx_u8* __restrict__ escape, int width,
                 int sign, int mb, int maxmag, int eoff, long long G, long long T, int D, long long tb,
                 long long nblk, long long gb, long long unit, int n_keys, kx_u16* __restrict__ keys,
                 kx_u64* __restrict__ raw, kx_u64* __restrict__ hist, kx_u64* __restrict__ chunk_bits) {
  const KxGrid gr = {width, sign, mb, maxmag, eoff, kx_pow2(-eoff)};
  const int lane = threadIdx.x & 31;
  const KeColumn k = ke_column(G, T, D, tb, nblk);
  const bool valid = k.valid;
  const long long g = k.g, t0 = k.t0, t1 = k.t1;
  const int d = k.d;
  long long steps = t1 - t0;  // warp maximum: every lane runs the same iterations (match-safe)
  for (int o = 16; o > 0; o >>= 1) steps = max(steps, __shfl_xor_sync(KX_FULL, steps, o));
  double m = 0.0, c = 0.0, a = 0.0;
  int es = 0, level = 0;
  if (valid) {
    const long long pi = (shared ? 0 : g) * D + d;
    m = pm[pi];
    c = pc[pi];
    a = pa[pi];
    es = pel[2 * pi];
    level = pel[2 * pi + 1];
  }
  kx_u64* h = hist + (long long)(blockIdx.x % KE_HIST_COPIES) * n_keys;
#ifndef KE_HIST_IN_GLOBAL
  extern __shared__ unsigned ke_hist_s[];  // the block's histogram (n_keys counters, dynamic shared memory)
  for (int j = threadIdx.x; j < n_keys; j += blockDim.x) ke_hist_s[j] = 0u;
  __syncthreads();
#endif
  double dev = 0.0;
  long long total = 0;
  const long long nt = t1 - t0;
  long long i = (g * T + t0) * D + d;  // this step's value (steps D apart)
  int pat_q[KE_SYM_AHEAD];  // the next KE_SYM_AHEAD steps' patterns and predictions, loaded ahead
  double p_q[KE_SYM_AHEAD];
#pragma unroll
  for (int k = 0; k < KE_SYM_AHEAD; ++k) {
    pat_q[k] = valid && k < nt ? ke_pat<W>(pats, i + k * D) : 0;
    p_q[k] = valid && k < nt ? ke_pred(pred, i + k * D) : 0.0;
  }
  for (long long s = 0; s < steps; ++s, i += D) {
    const bool act = valid && s < nt;
    unsigned key = 0x80000000u | lane;  // inactive lanes match nobody
    const int pat = pat_q[0];
    const double p = p_q[0];
#pragma unroll
    for (int k = 0; k + 1 < KE_SYM_AHEAD; ++k) {
      pat_q[k] = pat_q[k + 1];
      p_q[k] = p_q[k + 1];
    }
    const bool more = valid && s + KE_SYM_AHEAD < nt;
    pat_q[KE_SYM_AHEAD - 1] = more ? ke_pat<W>(pats, i + KE_SYM_AHEAD * D) : 0;
    p_q[KE_SYM_AHEAD - 1] = more ? ke_pred(pred, i + KE_SYM_AHEAD * D) : 0.0;
    if (act) {
      const double base = __dadd_rn(m, __dmul_rn(c, p));
      const double mu = __dadd_rn(base, __dmul_rn(a, dev));
      double mv = __dmul_rn(mu, gr.inv_unit);
      if (!(fabs(mv) < kx_pow2(400))) mv = 0.0;  // bins.MU_MAX
      int ep, cls;
      ke_centre centre;
      kx_locate<MAG>(mv, es, level, mb, ep, centre, cls);
      kx_u32 code;
      int nb;
      int sym = ke_encode_value(pat, ep, centre, gr, escape, code, nb);
      sym = kx_magnitude_symbol<MAG>(sym, centre);
      key = ((unsigned)cls << 8) | (unsigned)sym;
      keys[i] = (kx_u16)key;
      raw[i] = ((kx_u64)code << 8) | (kx_u64)nb;
      total += nb;
      dev = sym != KX_ESC ? __dsub_rn(kx_value(pat, gr), base) : 0.0;  // an escaped value: no residual
    }
#ifdef KE_HIST_IN_GLOBAL  // the CPU emulation (a block's warps run one after the other: no block barrier)
    const unsigned peers = __match_any_sync(KX_FULL, key);
    if (act && lane == __ffs(peers) - 1) atomicAdd(h + key, (kx_u64)__popc(peers));
#else
    if (act) atomicAdd(ke_hist_s + key, 1u);
#endif
  }
#ifndef KE_HIST_IN_GLOBAL
  __syncthreads();
  for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
    const unsigned cnt = ke_hist_s[j];
    if (cnt) atomicAdd(h + j, (kx_u64)cnt);
  }
#endif
  if (valid && t1 > t0) {  // format2.chunk_layout: blocks of gb g's that never cross a multiple of unit
    const long long per_unit = (unit + gb - 1) / gb;
    atomicAdd(chunk_bits + ((g / unit) * per_unit + (g % unit) / gb) * nblk + t0 / tb, (kx_u64)total);
  }
}

// A chunk (descriptor int64 [4]): `per` consecutive values of each of its g's (g count cd[1]), the g's
// `stride` values apart, from `first` on; value i = gg per + r of the chunk is element first + gg stride + r
// of the per-value arrays (keys, raw).
struct KeChunk {
  long long first, per, stride, n, rounds;

  __device__ __forceinline__ explicit KeChunk(const long long* cd)
      : first(cd[0]), per(cd[2]), stride(cd[3]), n(cd[1] * cd[2]), rounds((cd[1] * cd[2] + 31) >> 5) {}
};

#ifndef KE_LOAD
#define KE_LOAD __ldg  // KeValues' loads (benchmark variant __ldcs: evict-first, so a co-running kernel's tables keep L1)
#endif
// One lane's values of a chunk, backwards, 32 a step from value 32 (rounds - 1) + lane, loaded N rounds
// ahead (the rounds are a chain: a round's loads would otherwise wait a full memory latency): q[0] is this
// round's value, pop() returns it and loads the one N rounds on (0 outside the chunk). Their places follow
// by additions (one division at the start). Why: a 64-bit division per value was most of the payload
// kernel's instructions (H200: 1.49 ms for both halves -> 0.89 rANS alone).
template <class E, int N>
struct KeValues {
  long long i, r, pos;
  E q[N];

  __device__ __forceinline__ KeValues(const E* __restrict__ p, const KeChunk& ck, int lane)
      : i(32 * (ck.rounds - 1) + lane) {
    const long long gg = i >= 0 && ck.per > 0 ? i / ck.per : 0;
    r = i - gg * ck.per;
    pos = ck.first + gg * ck.stride + r;
#pragma unroll
    for (int k = 0; k < N; ++k) q[k] = next(p, ck);
  }

  __device__ __forceinline__ E next(const E* __restrict__ p, const KeChunk& ck) {
    const E v = i >= 0 && i < ck.n ? KE_LOAD(p + pos) : (E)0;
    i -= 32;
    r -= 32;
    pos -= 32;
    while (r < 0 && i >= 0) {  // into the previous g (several when per < 32)
      r += ck.per;
      pos += ck.per - ck.stride;
    }
    return v;
  }

  __device__ __forceinline__ E pop(const E* __restrict__ p, const KeChunk& ck) {
    const E v = q[0];
#pragma unroll
    for (int k = 0; k + 1 < N; ++k) q[k] = q[k + 1];
    q[N - 1] = next(p, ck);
    return v;
  }
};

#ifndef KE_RANS_AHEAD
#define KE_RANS_AHEAD 8  // rounds of keys in flight per lane (2 bytes each)
#endif
#ifndef KE_BITS_AHEAD
#define KE_BITS_AHEAD 4  // rounds of raw codes in flight per lane (8 bytes each)
#endif

// ke_encode: one warp per chunk (the tensor's chunks, then the model's field parts: format2.code_model's
// "mfields" parts, one g of its bytes each), one pass backwards over its keys, 32 (one per lane) a round: the
// 32-lane rANS stream (rans_lanes.encode's word order, as planes_codec.cu's pc_rans_encode) to the end of
// scratch slot ci (cap words); lens[ci] = its length, or -1 if a value's symbol has no frequency (internal
// error). Table entries are loaded a round ahead. ftab [n_keys]: freq | cum << 16 of class << 8 | symbol;
// rcp [n_keys]: floor(2**32 / freq) (0xffffffff for freq <= 1: lr_reciprocal, computed on the host).
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
    ke_encode(const kx_u16* __restrict__ keys, const long long* __restrict__ chunks, int n_chunks,
              const long long* __restrict__ parts, int n_parts, const kx_u32* __restrict__ ftab,
              const kx_u32* __restrict__ rcp, kx_u16* __restrict__ scratch, long long cap,
              long long* __restrict__ lens) {
  const int lane = threadIdx.x & 31;
  const int ci = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (ci >= n_chunks + n_parts) return;  // warp-uniform
  const KeChunk ck(ci < n_chunks ? chunks + 4 * (long long)ci : parts + 4 * (long long)(ci - n_chunks));
  kx_u16* __restrict__ wb = scratch + (long long)ci * cap;
  const kx_u32 below = (1u << lane) - 1u;
  long long wp = cap;
  kx_u32 x = LR_L;
  bool bad = false;
  KeValues<kx_u16, KE_RANS_AHEAD> val(keys, ck, lane);
  kx_u32 fc = __ldg(ftab + val.q[0]), rc = __ldg(rcp + val.q[0]);
  for (long long grp = ck.rounds - 1; grp >= 0; --grp) {
    val.pop(keys, ck);
    const kx_u32 fcn = __ldg(ftab + val.q[0]), rcn = __ldg(rcp + val.q[0]);
    const bool act = 32 * grp + lane < ck.n;
    // value 32 grp + lane on lane `lane`: emitted words land in ascending lane order
    const kx_u32 f = act ? fc & 0xFFFFu : 0u;
    bad |= act && f == 0u;
    lr_encode_step<LR_PREC>(x, act, f, rc, fc >> 16, below, wb, wp);
    fc = fcn;
    rc = rcn;
  }
  lr_encode_head(x, lane, wb, wp);
  const bool any_bad = __any_sync(KX_FULL, bad);
  if (lane == 0) lens[ci] = any_bad ? -1 : cap - wp;
}

// ke_bits: one warp per chunk of the tensor, the chunk's LSB-first raw bits (binned.write_chunks) into bits
// from word starts[ci] on (totals: the raw-bit totals ke_symbolise counted), in one pass backwards over the
// raw codes, 32 values a round. Their places are known backwards too: the round's bits end where the later
// rounds' begin (hi, from the chunk's total), each value's offset is hi - the round's total + the bit
// counts of the lanes below it. Each value ORs its code into a per-warp ring of 32-bit words in shared
// memory; the words wholly above the round's start are complete: stored, their slots cleared. A chunk whose
// values' bit counts do not add up to its total is counted in *n_bad (internal error; every chunk is
// checked, those without raw bits too). Needs no table: kvctx_device_encode runs it beside the host's
// table work and the rANS kernel.
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
    ke_bits(const kx_u64* __restrict__ raw, const long long* __restrict__ chunks, int n_chunks,
            const long long* __restrict__ totals, const long long* __restrict__ starts, kx_u32* __restrict__ bits,
            long long* __restrict__ n_bad) {
  KE_SHARED kx_u32 ring_all[WARPS][KE_RING];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ci = blockIdx.x * WARPS + warp;
  if (ci >= n_chunks) return;  // warp-uniform; no block barrier below
  const KeChunk ck(chunks + 4 * (long long)ci);
  const long long total = totals[ci];
  kx_u32* __restrict__ out = bits + starts[ci];
  kx_u32* __restrict__ ring = ring_all[warp];
  const kx_u32 below = (1u << lane) - 1u;
  ring[lane] = 0u;
  ring[lane + 32] = 0u;
  __syncwarp();
  long long hi = total;             // raw bits at and above hi are written
  long long done = (hi + 31) >> 5;  // words at and above done are stored
  KeValues<kx_u64, KE_BITS_AHEAD> val(raw, ck, lane);
  for (long long grp = ck.rounds - 1; grp >= 0; --grp) {
    const kx_u64 v = val.pop(raw, ck);
    const int nb = (int)(v & 0xFFu);  // 0 past the chunk's end (KeValues); <= 32
    int before = 0, sum = 0;  // the bit counts of the lanes below, of all lanes: one ballot per bit of nb (no
#pragma unroll              // chain of shuffles)
    for (int b = 0; b < 6; ++b) {
      const kx_u32 bb = __ballot_sync(KX_FULL, (nb >> b) & 1);
      before += __popc(bb & below) << b;
      sum += __popc(bb) << b;
    }
    const long long lo = hi - sum;
    if (nb) {
      const long long off = lo + before;
      const kx_u64 c = (v >> 8) << (off & 31);
      atomicOr(ring + ((off >> 5) & (KE_RING - 1)), (kx_u32)c);
      if ((off & 31) + nb > 32) atomicOr(ring + (((off >> 5) + 1) & (KE_RING - 1)), (kx_u32)(c >> 32));
    }
    __syncwarp();
    const long long first = lo > 0 ? (lo + 31) >> 5 : 0;  // words from here up are complete
    const long long w = first + lane;
    if (w < done) {
      out[w] = ring[w & (KE_RING - 1)];
      ring[w & (KE_RING - 1)] = 0u;
    }
    done = first;
    hi = lo;
    __syncwarp();
  }
  if (lane == 0 && hi != 0) atomicAdd(reinterpret_cast<unsigned long long*>(n_bad), 1ull);
}
