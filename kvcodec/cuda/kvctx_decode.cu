// GPU decoder of the kvctx / predictive stream format 2 (launcher: kvcodec/cuda/kvctx_decode.py; format:
// /work/notes/kvctx_format.md and kvcodec/lossless/predictive/{bins,binned,format2}.py). The CPU kernel
// binned.decode_chunks is the reference: this one computes the same bits in the same order.
//
// One warp per chunk; thread j owns rANS lane j (value i of a chunk uses lane i % 32). A chunk's values
// go in order (g, t, d) and the model of token t depends only on token t - 1, so a token's D values are
// decoded in rounds of up to 32 consecutive values (the round that starts at value i begins at lane
// i % 32: value order is lane order rotated by s = i % 32; k below is a thread's place in its round):
//   1. model: location mu = base + a * dev[d] (float64, __dmul_rn/__dadd_rn: no FMA, the CPU's order),
//      bins.locate -> (ep, centre, class);
//   2. rANS: one step per value with its class's table; the words are read in value order
//      (a ballot rotated by s gives each value its word's place);
//   3. raw bits: each value's bit count follows from its symbol, except a value in bin 0 of a wide bin,
//      whose unary depth is read from the stream: an exclusive scan of the known counts gives every
//      value its offset, then those unary values are resolved in value order (each adds its count to
//      the values after it); then every value reads its bits at its offset;
//   4. patterns out, dev[d] = value - base for the next token (0 after an ESC; in shared memory: the
//      thread of channel d changes from token to token when 32 does not divide D).
// Every read is bounded: rANS words through min(pos, end - 1), raw bits as zeros past the chunk's end
// (as the CPU); a malformed chunk sets its status, checked once on the host after the launch.

typedef unsigned char kx_u8;
typedef unsigned short kx_u16;
typedef unsigned int kx_u32;
typedef unsigned long long kx_u64;

#define KX_FULL 0xffffffffu
#define KX_L 65536u
#define KX_ESC 255
#define KX_CENTRE 127
#define KX_DEPTH_MAX 20
#define KX_UNARY 21
#define KX_N_FINE 4
#define KX_LVL_LO (-4)
#define KX_N_FRAC 4
#define KX_EP_MAX 600
#define KX_CHUNK_FIELDS 8

// The dtype's bit layout (bins.BinGrid) and the model's fixed arrays.
struct KxGrid {
  int width, sign, mb, maxmag, eoff;
  double inv_unit;  // 2**-eoff
};

__device__ __forceinline__ double kx_pow2(int e) {  // exact 2**e for -1022 <= e <= 1023
  return __longlong_as_double((long long)(e + 1023) << 52);
}

__device__ __forceinline__ int kx_floor_log2(long long u) { return 63 - __clzll(u); }

// bins.locate: (ep, centre, class) of a location mv (V units, finite). The bin coordinate is V / 2**ep
// below 2**(ep + mb), one unit per grid step above (bins.bin_of).
__device__ __forceinline__ void kx_locate(double mv, int es, int level, int mb, int& ep, long long& centre, int& cls) {
  const long long bits = __double_as_longlong(mv);
  const int ex = (int)(((unsigned long long)bits >> 52) & 0x7FF) - 1023;
  ep = min(es, KX_EP_MAX);
  const double av = fabs(mv);
  const int eu = max(ex - mb, 0);
  double y = __dmul_rn(av, kx_pow2(-ep));
  const double y_steps = __dadd_rn((double)((long long)(eu - ep) << mb), __dmul_rn(av, kx_pow2(-min(eu, KX_EP_MAX))));
  if (eu > ep) y = y_steps;
  const long long u = (long long)y;
  const long long neg = bits < 0 ? 1 : 0;
  centre = u ^ (-neg);
  double f = __dsub_rn(y, (double)u);
  f = __dadd_rn(f, __dmul_rn((double)neg, __dsub_rn(1.0, __dmul_rn(2.0, f))));
  const int lvl = level - 4 * max(ep, eu);
  if (lvl >= 12) {
    cls = min(lvl, 15) - 12;
  } else {
    const long long q = (long long)__dmul_rn(f, (double)KX_N_FRAC);
    cls = KX_N_FINE + (11 - max(lvl, KX_LVL_LO)) * KX_N_FRAC + (int)min(q, (long long)(KX_N_FRAC - 1));
  }
}

// Raw bit count of a value from its symbol: width (ESC), its bin's count, or -1 (bin 0 of a bin wider than
// two binades: a unary depth read from the stream).
__device__ __forceinline__ int kx_fixed_bits(int sym, int ep, long long centre, int mb, int width) {
  if (sym == KX_ESC) return width;
  const long long j = centre + sym - KX_CENTRE;
  const long long u = j ^ (j >> 63);
  if (u == 0) return ep <= mb + 1 ? ep : -1;
  if (u >= (1ll << mb)) return 0;  // one pattern per bin
  const int big_e = kx_floor_log2(u) + ep;
  return ep - (big_e > mb ? big_e - mb : 0);
}

// The bit pattern of a value whose raw bits start at bit 0 of win (>= 33 valid bits); binned._decode_mag
// (and ESC). used = bits consumed; ok = false for a malformed value.
__device__ __forceinline__ long long kx_pattern(int sym, int ep, long long centre, kx_u64 win, const KxGrid& gr,
                                                int& used, bool& ok) {
  const int mb = gr.mb;
  if (sym == KX_ESC) {
    used = gr.width;
    return (long long)(win & ((1ull << gr.width) - 1));
  }
  const long long j = centre + sym - KX_CENTRE;
  const long long neg = j >> 63;  // -1 or 0
  const long long u = j ^ neg;
  long long mag;
  if (u == 0) {
    if (ep <= mb + 1) {
      used = ep;
      mag = (long long)(win & ((1ull << ep) - 1));
    } else {
      const int last = ep - mb - 1;
      int d = 0;
      while (d < KX_UNARY && ((win >> d) & 1ull) == 0) ++d;
      if (last < KX_DEPTH_MAX && d >= last) {
        mag = (long long)((win >> last) & ((1ull << (mb + 1)) - 1));
        used = last + mb + 1;
      } else if (d >= KX_DEPTH_MAX) {
        ok = false;
        used = 0;
        return 0;
      } else {
        mag = ((long long)(ep - mb - d) << mb) | (long long)((win >> (d + 1)) & ((1ull << mb) - 1));
        used = d + 1 + mb;
      }
    }
  } else if (u >= (1ll << mb)) {  // one pattern per bin
    mag = u + ((long long)ep << mb);
    used = 0;
  } else {  // 1 <= u < 2**mb: 2**nb patterns in one binade
    const int big_e = kx_floor_log2(u) + ep;
    const int nb = ep - (big_e > mb ? big_e - mb : 0);
    const long long first = big_e < mb ? (u << ep)
                                        : ((long long)(big_e - mb + 1) << mb) + (u << nb) - (1ll << mb);
    mag = first + (long long)(win & ((1ull << nb) - 1));
    used = nb;
  }
  if (mag > gr.maxmag) {
    ok = false;
    return 0;
  }
  return mag | (gr.sign & neg);
}

// bins.value_of: the value of a pattern (0 for a magnitude past maxmag; decoded non-ESC patterns are finite).
__device__ __forceinline__ double kx_value(long long pat, const KxGrid& gr) {
  const long long mag = pat & ~(long long)gr.sign & 0xFFFF;
  if (mag > gr.maxmag) return 0.0;
  const int ef = (int)(mag >> gr.mb);
  long long mant = mag & ((1ll << gr.mb) - 1);
  if (ef > 0) mant |= 1ll << gr.mb;
  const double x = __dmul_rn((double)mant, kx_pow2(gr.eoff + max(ef, 1) - 1));
  return __dsub_rn(x, __dmul_rn(__dmul_rn(2.0, x), (pat & gr.sign) != 0 ? 1.0 : 0.0));
}

// 64 stream bits from bit pos of a chunk's raw words (zeros past its nw words), shifted so that bit 0 is
// pos: at least 33 valid bits.
__device__ __forceinline__ kx_u64 kx_window(const kx_u32* __restrict__ bw, long long nw, long long pos) {
  const long long wi = pos >> 5;
  const kx_u64 w0 = wi < nw ? bw[wi] : 0u;
  const kx_u64 w1 = wi + 1 < nw ? bw[wi + 1] : 0u;
  return ((w1 << 32) | w0) >> (pos & 31);
}

// chunks [n, 8] int64: rANS word start, word count, raw-bit word start, raw-bit word count, first g,
// g count, first token, token count. pred: float32 [., pred_t, D] at (pred_g0, 0) or null; m/c/a/es/level:
// [Gp, D] (Gp = 1 when shared). out: patterns [G, T, D] (OUT = 1, 2 bytes; 4: float32 = pattern << 16 |
// lo16). dev_global: n x D doubles, or null to keep dev in dynamic shared memory (WARPS x D doubles).
// status[n]: 0 good, else the CPU's error codes (1 short stream, 2 bad state, 4 end checks, 5 bad value).
template <int OUT, int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
    kx_decode(const kx_u16* __restrict__ words, const kx_u32* __restrict__ bits, const long long* __restrict__ chunks,
              int n_chunks, const float* __restrict__ pred, long long pred_g0, long long pred_t,
              const double* __restrict__ m, const double* __restrict__ c, const double* __restrict__ a,
              const int* __restrict__ es, const int* __restrict__ level, int shared, const kx_u32* __restrict__ tabs,
              int width, int sign, int mb, int maxmag, int eoff, double inv_unit, int D,
              long long T, void* __restrict__ out, const kx_u16* __restrict__ lo16,
              double* __restrict__ dev_global, int* __restrict__ status) {
  extern __shared__ double kx_smem[];
  const KxGrid gr = {width, sign, mb, maxmag, eoff, inv_unit};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ci = blockIdx.x * WARPS + warp;
  if (ci >= n_chunks) return;  // warp-uniform
  const long long* cd = chunks + KX_CHUNK_FIELDS * (long long)ci;
  const long long wlen = cd[1], nbw = cd[3];
  const long long g0 = cd[4], ng = cd[5], t0 = cd[6], nt = cd[7];
  const kx_u16* __restrict__ w = words + cd[0];
  const kx_u32* __restrict__ bw = bits + cd[2];
  double* dev = dev_global ? dev_global + (long long)ci * D : kx_smem + (long long)warp * D;
  if (wlen < 64) {
    if (lane == 0) status[ci] = 1;
    return;
  }
  kx_u32 x = (kx_u32)w[2 * lane] | ((kx_u32)w[2 * lane + 1] << 16);
  if (__any_sync(KX_FULL, x < KX_L)) {
    if (lane == 0) status[ci] = 2;
    return;
  }
  long long ptr = 64;  // next rANS word
  long long bpos = 0;  // next raw bit
  long long i = 0;     // values decoded in this chunk
  bool bad = false;
  for (long long g = g0; g < g0 + ng && !bad; ++g) {
    const long long gp = shared ? 0 : g;
    for (int d = lane; d < D; d += 32) dev[d] = 0.0;
    __syncwarp();
    for (long long t = t0; t < t0 + nt; ++t) {
      const int s = (int)(i & 31);
      const int k = (lane - s) & 31;  // this thread's place in a round
      const kx_u32 before = (1u << k) - 1u;
      for (int r0 = 0; r0 < D; r0 += 32) {
        const int cnt = min(32, D - r0);
        const int d = r0 + k;
        const bool active = k < cnt;
        // 1. model
        double base = 0.0;
        int ep = 0, cls = 0;
        long long centre = 0;
        if (active) {
          const long long pi = gp * D + d;
          double p = 0.0;
          if (pred) {
            const float pf = pred[((g - pred_g0) * pred_t + t) * D + d];
            p = isfinite(pf) ? (double)pf : 0.0;
          }
          base = __dadd_rn(m[pi], __dmul_rn(c[pi], p));
          const double mu = __dadd_rn(base, __dmul_rn(a[pi], dev[d]));
          double mv = __dmul_rn(mu, gr.inv_unit);
          if (!(fabs(mv) < kx_pow2(400))) mv = 0.0;  // bins.MU_MAX
          kx_locate(mv, es[pi], level[pi], gr.mb, ep, centre, cls);
        }
        // 2. rANS
        int sym = 0;
        {
          const kx_u32 e = active ? __ldg(tabs + (cls << 12) + (x & 4095u)) : 0u;
          kx_u32 xn = (((e >> 12) & 0xFFFu) + 1u) * (x >> 12) + (e & 0xFFFu);
          const bool need = active && xn < KX_L;
          const kx_u32 bal = __ballot_sync(KX_FULL, need);
          const kx_u32 vo = __funnelshift_r(bal, bal, s);  // value order
          if (need) {
            const long long wi = min(ptr + __popc(vo & before), wlen - 1);
            xn = (xn << 16) | (kx_u32)w[wi];
          }
          if (active) x = xn;
          ptr += __popc(bal);
          sym = (int)(e >> 24);
        }
        // 3. raw bits: offsets by an exclusive scan in value order, unary depths resolved in order
        bool ok = true;
        int nbits = active ? kx_fixed_bits(sym, ep, centre, gr.mb, gr.width) : 0;
        const bool unary = nbits < 0;
        int known = unary ? 0 : nbits;
        int incl = known;
        for (int delta = 1; delta < 32; delta <<= 1) {
          const int o = __shfl_sync(KX_FULL, incl, (lane - delta) & 31);
          if (k >= delta) incl += o;
        }
        long long off = bpos + (incl - known);
        long long pat = 0;
        const kx_u32 ub = __ballot_sync(KX_FULL, unary);
        kx_u32 pending = __funnelshift_r(ub, ub, s);
        while (pending) {  // at most 32 turns
          const int jv = __ffs(pending) - 1;
          if (k == jv) pat = kx_pattern(sym, ep, centre, kx_window(bw, nbw, off), gr, nbits, ok);
          const int add = __shfl_sync(KX_FULL, nbits, (jv + s) & 31);
          if (k > jv) off += add;
          pending &= pending - 1u;
        }
        if (active && !unary) {
          int used = 0;
          pat = kx_pattern(sym, ep, centre, kx_window(bw, nbw, off), gr, used, ok);
        }
        bpos = __shfl_sync(KX_FULL, off + (active ? nbits : 0), (cnt - 1 + s) & 31);
        bad |= !ok;
        // 4. patterns out, previous-token deviations
        if (active) {
          const long long oi = (g * T + t) * D + d;
          if (OUT == 1) {
            reinterpret_cast<kx_u8*>(out)[oi] = (kx_u8)pat;
          } else if (OUT == 2) {
            reinterpret_cast<kx_u16*>(out)[oi] = (kx_u16)pat;
          } else {
            reinterpret_cast<kx_u32*>(out)[oi] = ((kx_u32)pat << 16) | (kx_u32)lo16[oi];
          }
          dev[d] = sym != KX_ESC ? __dsub_rn(kx_value(pat, gr), base) : 0.0;  // an escaped value: no residual
        }
      }
      i += D;
      __syncwarp();
      if (__any_sync(KX_FULL, bad)) {
        bad = true;
        break;
      }
    }
  }
  if (bad) {
    if (lane == 0) status[ci] = 5;
    return;
  }
  const bool end_bad = x != KX_L || ptr != wlen || (bpos + 31) / 32 != nbw;
  if (__any_sync(KX_FULL, end_bad) && lane == 0) status[ci] = 4;
}
