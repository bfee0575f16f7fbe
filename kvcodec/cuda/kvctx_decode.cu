// GPU decoder of the kvctx / predictive stream format 2 (launcher: kvcodec/cuda/kvctx_decode.py; format:
// /work/notes/kvctx_format.md and kvcodec/lossless/predictive/{bins,binned,format2}.py). The CPU kernel
// binned.decode_chunks is the reference: this one computes the same bits in the same order.
//
// One warp per chunk; thread j owns rANS lane j (value i of a chunk uses lane i % 32). A chunk's values
// go in order (g, t, d) and the model of token t depends only on token t - 1, so a token's D values are
// decoded in rounds of up to 32 consecutive values (every round of a token begins at lane s = i % 32 of
// the token's first value i: value order is lane order rotated by s; k below is a thread's place in its
// round), NR rounds at a time (a batch): their models are independent, so they overlap:
//   1. model: the channel's parameters from the stored field bytes (format2.StoredFields, exact:
//      m = mq * 2**(es + eoff), c = cq / 64, a = aq / 64), location mu = base + a * dev[d] (float64,
//      __dmul_rn/__dadd_rn: no FMA, the CPU's order), bins.locate -> (ep, centre, class);
//   2. rANS: one step per value with its class's table, round after round (the lane states chain);
//      the words are read in value order (a ballot rotated by s gives each value its word's place);
//   3. raw bits: each value's bit count follows from its symbol, except a value in bin 0 of a wide bin,
//      whose unary depth is read from the stream: an exclusive scan of the known counts per round gives
//      every value its offset, then those unary values are resolved in value order (each adds its count
//      to the values after it, in its round and the later ones); then every value reads its bits;
//   4. patterns out, dev[d] = value - base for the next token (0 after an ESC; in shared memory: the
//      thread of channel d changes from token to token when 32 does not divide D).
// The chunk's rANS words and raw-bit words are read through per-warp rings in shared memory, filled
// ahead of the reads (each fill step's global loads are issued one step before they are stored), so
// the dependent reads of a round wait for shared memory, not for DRAM.
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
#define KX_Q 64
#define KX_CHUNK_FIELDS 8
#define KX_RING_WORDS 512  // rANS words (uint16) per warp ring
#define KX_RING_BITS 256   // raw-bit words (uint32) per warp ring

// The dtype's bit layout (bins.BinGrid).
struct KxGrid {
  int width, sign, mb, maxmag, eoff;
  double inv_unit;  // 2**-eoff
};

__device__ __forceinline__ double kx_pow2(int e) {  // exact 2**e for -1022 <= e <= 1023
  return __longlong_as_double((long long)(e + 1023) << 52);
}

__device__ __forceinline__ int kx_floor_log2(int u) { return 31 - __clz(u); }

// The stored per-channel fields (format2.StoredFields): byte planes and per field (level, mq, c, a) the
// offset of its low plane, its width (0: not stored) and its value (level's minimum; c's/a's default).
struct KxFields {
  const kx_u8* raw;
  long long n;  // channels (planes' length)
  long long off[4];
  int width[4], value[4];
};

// One field's stored integer (0 when not stored).
__device__ __forceinline__ int kx_field(const KxFields& f, int k, long long pi) {
  if (f.width[k] == 0) return 0;
  int v = __ldg(f.raw + f.off[k] + pi);
  if (f.width[k] == 2) v |= (int)__ldg(f.raw + f.off[k] + f.n + pi) << 8;
  return v;
}

// format2.BinParams.kernel_args of channel pi, exactly, into a warp's channel table at d: m, c, a and
// es | level << 10 (es <= 600).
__device__ __forceinline__ void kx_channel(const KxFields& f, long long pi, int eoff, double* chan, int D, int d) {
  const int level = kx_field(f, 0, pi) + f.value[0];
  const int z = kx_field(f, 1, pi);
  const int mq = (z >> 1) ^ -(z & 1);
  const int es = min(max((level >> 2) - 3, 0), KX_EP_MAX);  // bins.bin_exponent (>> floors)
  const int cq = f.width[2] ? (int)(signed char)kx_field(f, 2, pi) : f.value[2];
  const int aq = f.width[3] ? (int)(signed char)kx_field(f, 3, pi) : f.value[3];
  chan[d] = __dmul_rn((double)mq, kx_pow2(es + eoff));
  chan[D + d] = __dmul_rn((double)cq, 1.0 / KX_Q);
  chan[2 * D + d] = __dmul_rn((double)aq, 1.0 / KX_Q);
  reinterpret_cast<int*>(chan + 3 * D)[d] = es | level << 10;
}

// bins.locate: (ep, centre, class) of a location mv (V units, finite). The bin coordinate is V / 2**ep
// below 2**(ep + mb), one unit per grid step above (bins.bin_of).
__device__ __forceinline__ void kx_locate(double mv, int es, int level, int mb, int& ep, int& centre, int& cls) {
  const long long bits = __double_as_longlong(mv);
  const int ex = (int)(((unsigned long long)bits >> 52) & 0x7FF) - 1023;
  ep = min(es, KX_EP_MAX);
  const double av = fabs(mv);
  const int eu = max(ex - mb, 0);
  double y = __dmul_rn(av, kx_pow2(-ep));
  const double y_steps = __dadd_rn((double)((eu - ep) << mb), __dmul_rn(av, kx_pow2(-min(eu, KX_EP_MAX))));
  if (eu > ep) y = y_steps;
  const int u = (int)y;  // y < 2**19: |mv| < 2**400 (bins.MU_MAX)
  const int neg = bits < 0 ? 1 : 0;
  centre = u ^ (-neg);
  double f = __dsub_rn(y, (double)u);
  f = __dadd_rn(f, __dmul_rn((double)neg, __dsub_rn(1.0, __dmul_rn(2.0, f))));
  const int lvl = level - 4 * max(ep, eu);
  if (lvl >= 12) {
    cls = min(lvl, 15) - 12;
  } else {
    const int q = (int)__dmul_rn(f, (double)KX_N_FRAC);  // f in [0, 1]
    cls = KX_N_FINE + (11 - max(lvl, KX_LVL_LO)) * KX_N_FRAC + min(q, KX_N_FRAC - 1);
  }
}

// Raw bit count of a value from its symbol: width (ESC), its bin's count, or -1 (bin 0 of a bin wider than
// two binades: a unary depth read from the stream).
__device__ __forceinline__ int kx_fixed_bits(int sym, int ep, int centre, int mb, int width) {
  const int j = centre + sym - KX_CENTRE;
  const int u = j ^ (j >> 31);
  const int big_e = kx_floor_log2(max(u, 1)) + ep;
  int nb = u >= (1 << mb) ? 0 : ep - max(big_e - mb, 0);  // 0: one pattern per bin
  nb = u == 0 ? (ep <= mb + 1 ? ep : -1) : nb;
  return sym == KX_ESC ? width : nb;
}

// The unary depth of a bin-0 value of a bin wider than two binades whose raw bits start at bit 0 of win
// (zero bits before a one, at most KX_UNARY).
__device__ __forceinline__ int kx_depth(kx_u64 win) { return win ? min(__ffsll((long long)win) - 1, KX_UNARY) : KX_UNARY; }

// Raw bit count of such a value (kx_fixed_bits' -1): its depth's code and mantissa, as kx_pattern reads them
// (0 for a depth past KX_DEPTH_MAX: kx_pattern flags it).
__device__ __forceinline__ int kx_unary_bits(int ep, int mb, kx_u64 win) {
  const int last = ep - mb - 1;
  const int d = kx_depth(win);
  if (last < KX_DEPTH_MAX && d >= last) return last + mb + 1;
  return d >= KX_DEPTH_MAX ? 0 : d + 1 + mb;
}

// The bit pattern of a value whose raw bits start at bit 0 of win (>= 33 valid bits); binned._decode_mag
// (and ESC). ok = false for a malformed value. Every int fits: bin coordinates are below 2**19. Branch-free:
// the bin's (first magnitude, bit shift, bit count) are selected among every kind of bin's (shift amounts
// clamped where a kind does not apply), then one bit field is read, so lanes with different kinds of bins
// and the rounds of a batch run the same straight-line code.
__device__ __forceinline__ int kx_pattern(int sym, int ep, int centre, kx_u64 win, const KxGrid& gr, bool& ok) {
  const int mb = gr.mb;
  const int j = centre + sym - KX_CENTRE;
  const int neg = j >> 31;  // -1 or 0
  const int u = j ^ neg;
  // 1 <= u < 2**mb: 2**nb patterns in one binade
  const int big_e = kx_floor_log2(max(u, 1)) + ep;
  int nb = max(ep - max(big_e - mb, 0), 0);
  int first = big_e < mb ? (u << min(ep, mb)) : (max(big_e - mb + 1, 0) << mb) + (u << min(nb, mb)) - (1 << mb);
  int sh = 0;
  // u >= 2**mb: one pattern per bin
  const bool single = u >= (1 << mb);
  first = single ? u + (ep << mb) : first;
  nb = single ? 0 : nb;
  // u == 0: the bin's patterns straight (ep <= mb + 1), or a unary depth d: the last depth (exponent fields
  // 0 and 1) in mb + 1 bits, a depth d < last in mb bits after d + 1 code bits, a depth >= KX_DEPTH_MAX malformed
  const int last = ep - mb - 1;
  const int d = kx_depth(win);
  const bool at_last = last < KX_DEPTH_MAX && d >= last;
  if (u == 0) {
    first = last <= 0 || at_last ? 0 : max(ep - mb - d, 0) << mb;
    sh = last <= 0 ? 0 : (at_last ? last : d + 1);
    nb = last <= 0 ? ep : (at_last ? mb + 1 : mb);
    ok &= last <= 0 || at_last || d < KX_DEPTH_MAX;
  }
  if (sym == KX_ESC) {  // the pattern verbatim
    first = 0;
    sh = 0;
    nb = gr.width;
  }
  const int mag = first + (int)((win >> sh) & ((1ull << nb) - 1));
  if (sym == KX_ESC) return mag;
  ok &= mag <= gr.maxmag;
  return mag <= gr.maxmag ? mag | (gr.sign & neg) : 0;
}

// bins.value_of: the value of a pattern (0 for a magnitude past maxmag; decoded non-ESC patterns are finite).
__device__ __forceinline__ double kx_value(int pat, const KxGrid& gr) {
  const int mag = pat & ~gr.sign & 0xFFFF;
  if (mag > gr.maxmag) return 0.0;
  const int ef = mag >> gr.mb;
  int mant = mag & ((1 << gr.mb) - 1);
  if (ef > 0) mant |= 1 << gr.mb;
  const double x = __dmul_rn((double)mant, kx_pow2(gr.eoff + max(ef, 1) - 1));
  return __dsub_rn(x, __dmul_rn(__dmul_rn(2.0, x), (pat & gr.sign) != 0 ? 1.0 : 0.0));
}

// A warp's ring of one of its chunk's word streams (n words at src) in shared memory: words [hi - R, hi)
// are in buf (those not yet passed by the reader), and each lane holds its word of the next 32 (stage),
// loaded one fill step before it is stored. Words past n read as 0.
template <typename T, int R>
struct KxRing {
  T* buf;
  const T* src;
  long long n, hi;
  T stage;

  // (streaming loads, evicted first: L1 keeps the class tables)
  __device__ __forceinline__ T load(long long q) const { return q < n ? __ldcs(src + q) : (T)0; }

  __device__ __forceinline__ void init(T* ring, const T* words, long long count, int lane) {
    buf = ring;
    src = words;
    n = count;
#pragma unroll 4
    for (int q = lane; q < R; q += 32) buf[q] = load(q);
    hi = R;
    stage = load(hi + lane);
    __syncwarp();
  }

  // Store the staged words while that keeps every word from pos on (the reader's next word) in buf.
  // The barriers: every lane's reads of the words replaced are done before, the new words seen after.
  __device__ __forceinline__ void fill(long long pos, int lane) {
    if (hi + 32 - pos > R) return;  // warp-uniform
    __syncwarp();
    do {
      buf[(hi + lane) & (R - 1)] = stage;
      hi += 32;
      stage = load(hi + lane);
    } while (hi + 32 - pos <= R);
    __syncwarp();
  }

  // Word q, for pos <= q < pos + R - 32 (pos: the reader's position at the last fill; a batch reads at most
  // 32 * NR rANS words and 32 raw bits per value past it, well inside).
  __device__ __forceinline__ T get(long long q) const { return buf[q & (R - 1)]; }

  // 64 stream bits from bit pos, shifted so that bit 0 is pos: at least 33 valid bits (32-bit words).
  __device__ __forceinline__ kx_u64 window(long long pos) const {
    const long long wi = pos >> 5;
    return (((kx_u64)get(wi + 1) << 32) | (kx_u64)get(wi)) >> (pos & 31);
  }
};

// chunks [n, 8] int64: rANS word start, word count, raw-bit word start, raw-bit word count, first g,
// g count, first token, token count. pred: float32 [., pred_t, D] at (pred_g0, 0) or null. Parameters:
// the stored field bytes raw (byte planes of Gp * D values, Gp = 1 when shared) and layout int64 [13]:
// format2.StoredFields.layout [4, 3], then Gp * D. out: patterns [G, T, D] (OUT = 1, 2 bytes; 4: float32 = pattern << 16 | lo16).
// Dynamic shared memory: per warp a ring of rANS words and one of raw-bit words, then (scratch null) per
// warp 5 x D doubles: dev and the channel table of the current g (kx_channel); else those in scratch,
// n x 5 x D doubles. status[n]: 0 good, else the CPU's error
// codes (1 short stream, 2 bad state, 4 end checks, 5 bad value).
template <int OUT, int WARPS, int NR>
__global__ void __launch_bounds__(32 * WARPS, 16 / WARPS)  // 16 warps per SM: 2048 chunks in one wave on an H100/H200
    kx_decode(const kx_u16* __restrict__ words, const kx_u32* __restrict__ bits, const long long* __restrict__ chunks,
              int n_chunks, const float* __restrict__ pred, long long pred_g0, long long pred_t,
              const kx_u8* __restrict__ raw, const long long* __restrict__ layout, int shared,
              const kx_u32* __restrict__ tabs, int width, int sign, int mb, int maxmag, int eoff, int D, long long T,
              void* __restrict__ out, const kx_u16* __restrict__ lo16, double* __restrict__ scratch,
              int* __restrict__ status) {
  extern __shared__ double kx_smem[];
  const KxGrid gr = {width, sign, mb, maxmag, eoff, kx_pow2(-eoff)};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ci = blockIdx.x * WARPS + warp;
  if (ci >= n_chunks) return;  // warp-uniform
  const long long* cd = chunks + KX_CHUNK_FIELDS * (long long)ci;
  const long long wlen = cd[1], nbw = cd[3];
  const long long g0 = cd[4], ng = cd[5], t0 = cd[6], nt = cd[7];
  const kx_u16* __restrict__ w = words + cd[0];
  KxFields fl;
  fl.raw = raw;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    fl.off[k] = layout[3 * k];
    fl.width[k] = (int)layout[3 * k + 1];
    fl.value[k] = (int)layout[3 * k + 2];
  }
  fl.n = layout[12];
  kx_u16* ring_w = reinterpret_cast<kx_u16*>(kx_smem) + warp * KX_RING_WORDS;
  kx_u32* ring_b = reinterpret_cast<kx_u32*>(reinterpret_cast<kx_u16*>(kx_smem) + WARPS * KX_RING_WORDS) +
                   warp * KX_RING_BITS;
  double* const dev = scratch ? scratch + (long long)ci * 5 * D
                              : reinterpret_cast<double*>(ring_b + (WARPS - warp) * KX_RING_BITS) + warp * 5 * D;
  const double* const chan = dev + D;  // m, c, a, then es | level << 10 as ints
  if (wlen < 64) {
    if (lane == 0) status[ci] = 1;
    return;
  }
  kx_u32 x = (kx_u32)w[2 * lane] | ((kx_u32)w[2 * lane + 1] << 16);
  if (__any_sync(KX_FULL, x < KX_L)) {
    if (lane == 0) status[ci] = 2;
    return;
  }
  KxRing<kx_u16, KX_RING_WORDS> rw;
  KxRing<kx_u32, KX_RING_BITS> rb;
  rw.init(ring_w, w, wlen, lane);
  rb.init(ring_b, bits + cd[2], nbw, lane);
  long long ptr = 64;  // next rANS word
  long long bpos = 0;  // next raw bit
  long long i = 0;     // values decoded in this chunk
  bool bad = false;
  // D = 32 * NR: every token is one batch starting at lane 0, so thread j always has channels j + 32 r:
  // their parameters (but c: only with a prediction) and deviations stay in registers (no shared-memory
  // round trip per token)
  const bool in_regs = D == 32 * NR;
  double rm[NR], ra[NR], rdev[NR];
  int rel[NR];
  for (long long g = g0; g < g0 + ng && !bad; ++g) {
    const long long gp = shared ? 0 : g;
    for (int d = lane; d < D; d += 32) {
      dev[d] = 0.0;
      kx_channel(fl, gp * D + d, eoff, dev + D, D, d);
    }
    __syncwarp();
    if (in_regs) {
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        rm[r] = chan[lane + 32 * r];
        ra[r] = chan[2 * D + lane + 32 * r];
        rel[r] = reinterpret_cast<const int*>(chan + 3 * D)[lane + 32 * r];
        rdev[r] = 0.0;
      }
    }
    for (long long t = t0; t < t0 + nt; ++t) {
      const int s = (int)(i & 31);
      const int k = (lane - s) & 31;  // this thread's place in a round
      const kx_u32 before = (1u << k) - 1u;
      const float* const prow = pred ? pred + ((g - pred_g0) * pred_t + t) * D : nullptr;
      const long long orow = (g * T + t) * D;
      for (int r0 = 0; r0 < D; r0 += 32 * NR) {
        double base[NR];
        int ep[NR], cls[NR], sym[NR], nbits[NR], known[NR], incl[NR];
        int centre[NR], pat[NR];
        long long off[NR];
        bool act[NR], unary[NR];
        // 1. model: straight-line code for every lane (a lane past D computes channel D - 1 and is
        // masked later), so the rounds' dependent float64 chains interleave
        int dd[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          act[r] = r0 + 32 * r + k < D;
          dd[r] = min(r0 + 32 * r + k, D - 1);
          base[r] = in_regs ? rm[r] : chan[dd[r]];  // m + c * 0 is m exactly (m is never -0.0)
        }
        if (prow) {  // warp-uniform
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            const float pf = __ldcs(prow + dd[r]);
            base[r] = __dadd_rn(base[r], __dmul_rn(chan[D + dd[r]], isfinite(pf) ? (double)pf : 0.0));
          }
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const double mu = __dadd_rn(base[r], in_regs ? __dmul_rn(ra[r], rdev[r]) : __dmul_rn(chan[2 * D + dd[r]], dev[dd[r]]));
          double mv = __dmul_rn(mu, gr.inv_unit);
          if (!(fabs(mv) < kx_pow2(400))) mv = 0.0;  // bins.MU_MAX
          const int el = in_regs ? rel[r] : reinterpret_cast<const int*>(chan + 3 * D)[dd[r]];
          kx_locate(mv, el & 1023, el >> 10, gr.mb, ep[r], centre[r], cls[r]);
        }
        // 2. rANS, round after round
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          sym[r] = 0;
          if (r0 + 32 * r >= D) continue;  // warp-uniform
          const kx_u32 e = act[r] ? __ldg(tabs + (cls[r] << 12) + (x & 4095u)) : 0u;
          kx_u32 xn = (((e >> 12) & 0xFFFu) + 1u) * (x >> 12) + (e & 0xFFFu);
          const bool need = act[r] && xn < KX_L;
          const kx_u32 bal = __ballot_sync(KX_FULL, need);
          const kx_u32 vo = __funnelshift_r(bal, bal, s);  // value order
          if (need) xn = (xn << 16) | (kx_u32)rw.get(min(ptr + __popc(vo & before), wlen - 1));
          if (act[r]) x = xn;
          ptr += __popc(bal);
          sym[r] = (int)(e >> 24);
        }
        // 3. raw bits: offsets by exclusive scans in value order, unary depths resolved in order
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          nbits[r] = act[r] ? kx_fixed_bits(sym[r], ep[r], centre[r], gr.mb, gr.width) : 0;
          unary[r] = nbits[r] < 0;
          known[r] = unary[r] ? 0 : nbits[r];
          incl[r] = known[r];
        }
#pragma unroll
        for (int delta = 1; delta < 32; delta <<= 1) {
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            const int o = __shfl_sync(KX_FULL, incl[r], (lane - delta) & 31);
            if (k >= delta) incl[r] += o;
          }
        }
        long long end = bpos;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          off[r] = end + (incl[r] - known[r]);
          end += __shfl_sync(KX_FULL, incl[r], (31 + s) & 31);  // the round's known total
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          if (r0 + 32 * r >= D) continue;  // warp-uniform
          const kx_u32 ub = __ballot_sync(KX_FULL, unary[r]);
          kx_u32 pending = __funnelshift_r(ub, ub, s);
          while (pending) {  // at most 32 turns: their bit counts, in value order
            const int jv = __ffs(pending) - 1;
            if (k == jv) nbits[r] = kx_unary_bits(ep[r], gr.mb, rb.window(off[r]));
            const int add = __shfl_sync(KX_FULL, nbits[r], (jv + s) & 31);
            if (k > jv) off[r] += add;
#pragma unroll
            for (int r2 = r + 1; r2 < NR; ++r2) off[r2] += add;
            end += add;
            pending &= pending - 1u;
          }
        }
        bool ok = true;  // 4. patterns, every value at its offset
#pragma unroll
        for (int r = 0; r < NR; ++r) pat[r] = act[r] ? kx_pattern(sym[r], ep[r], centre[r], rb.window(off[r]), gr, ok) : 0;
        bpos = end;
        bad |= !ok;
        // 4. patterns out, previous-token deviations
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          if (!act[r]) continue;
          const int d = r0 + 32 * r + k;
          const long long oi = orow + d;
          if (OUT == 1) {
            reinterpret_cast<kx_u8*>(out)[oi] = (kx_u8)pat[r];
          } else if (OUT == 2) {
            reinterpret_cast<kx_u16*>(out)[oi] = (kx_u16)pat[r];
          } else {
            reinterpret_cast<kx_u32*>(out)[oi] = ((kx_u32)pat[r] << 16) | (kx_u32)__ldcs(lo16 + oi);
          }
          const double dv = sym[r] != KX_ESC ? __dsub_rn(kx_value(pat[r], gr), base[r]) : 0.0;  // ESC: no residual
          if (in_regs) {
            rdev[r] = dv;
          } else {
            dev[d] = dv;
          }
        }
        rw.fill(ptr, lane);
        rb.fill(bpos >> 5, lane);
      }
      i += D;
      if (!in_regs) __syncwarp();  // dev[] written, read by other threads next token
    }
    bad = __any_sync(KX_FULL, bad);  // a malformed chunk decodes on (every read is bounded) to its g's end
  }
  if (bad) {
    if (lane == 0) status[ci] = 5;
    return;
  }
  const bool end_bad = x != KX_L || ptr != wlen || (bpos + 31) / 32 != nbw;
  if (__any_sync(KX_FULL, end_bad) && lane == 0) status[ci] = 4;
}
