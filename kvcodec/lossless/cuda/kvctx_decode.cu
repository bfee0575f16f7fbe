// GPU decoder of the kvctx / predictive stream format 2 (launcher: kvcodec/lossless/cuda/kvctx_decode.py; format:
// docs/format.md, docs/lossless_kv.md and kvcodec/lossless/predictive/{bins,binned,format2}.py). The CPU kernel
// binned.decode_chunks is the reference: this one computes the same bits in the same order.
//
// One warp per chunk; thread j owns rANS lane j (value i of a chunk uses lane i % 32). A chunk's values
// go in order (g, t, d) and the model of token t depends only on token t - 1, so a token's D values are
// decoded in rounds of up to 32 consecutive values (every round of a token begins at lane s = i % 32 of
// the token's first value i: value order is lane order rotated by s; k below is a thread's place in its
// round), NR rounds at a time (a batch): their models are independent, so they overlap:
//   1. model: the channel's parameters from the stored field bytes (format2.StoredFields, exact:
//      m = mq * 2**(es + eoff), c = cq / 64, a = aq / 64), location mu = base + a * dev[d] (float64 in the
//      CPU's order, __dmul_rn/__dadd_rn; __fma_rn only where its product is exact, so it rounds once where the
//      CPU rounds: base = m + c p and the bin coordinate), bins.locate -> (ep, centre, class) (kx_locate_ep);
//   2. rANS: one step per value with its class's table, round after round (the lane states chain);
//      the words are read in value order (a ballot rotated by s gives each value its word's place);
//   3. raw bits: every value's field (bits skipped, bit count, magnitude base) follows from its symbol,
//      except a value in bin 0 of a wide bin (a "unary" value), whose depth d is read from the stream.
//      One exclusive scan of the known counts (two rounds packed in one word) places every value as if
//      each unary value had depth 0; then the unary values are resolved in value order from 64-bit windows
//      read at those places beforehand, the warp carrying the sum of their depths (a short dependent
//      chain: shuffle, shift, count zeros, add); every value then reads its field from a 32-bit window;
//   4. patterns out, dev[d] = value - base for the next token (0 after an ESC).
// The chunk's rANS words and raw-bit words are read through per-warp rings in shared memory, filled
// ahead of the reads (each fill step's global loads are issued one step before they are stored), so
// the dependent reads of a round wait for shared memory, not for DRAM. Positions within a chunk are
// 32-bit (a chunk holds < 2**26 raw-bit words and < 2**30 rANS words, else its status says 4).
// Every read is bounded: the rings read zeros past the chunk's words (an overrun then fails the end
// checks, as on the CPU); a malformed chunk sets its status, checked once on the host after the launch.
//
// Template: OUT (bytes per output element), WARPS (chunks per block), NR (rounds per batch), LAYOUT
// (KX_ALIGNED: D is a multiple of 32 * NR, every batch starts at lane 0 and fills its rounds, so the rotation
// and the per-lane masks fold away; KX_REGS: D = 32 * NR, also the channels' parameters in registers),
// BF16 (the bf16 grid as constants: a value is its float32 upper half), MAG (the stream's "mag" flag: symbols and
// mu's place in its bin counted by magnitude, bins.magnitude_symbol; its own instances, so that streams without it
// run the code they ran before).
// The rANS (constants, table entries, steps) is lane_rans.cuh's.

#include "kvcodec/entropy/cuda/lane_rans.cuh"

typedef unsigned char kx_u8;
typedef unsigned short kx_u16;
typedef unsigned int kx_u32;
typedef unsigned long long kx_u64;

#define KX_FULL 0xffffffffu
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
#define KX_RING_BITS 256   // raw-bit words (uint32) per warp ring, and a copy of its first 32 after it
#define KX_GENERAL 0  // kernel layouts (template LAYOUT): any D
#define KX_ALIGNED 1  // 32 * NR divides D: every batch starts at lane 0 with full rounds
#define KX_REGS 2     // D = 32 * NR: one batch a token, each thread's channels' parameters in registers

// The dtype's bit layout (bins.BinGrid).
struct KxGrid {
  int width, sign, mb, maxmag, eoff;
  double inv_unit;  // 2**-eoff
};

__device__ __forceinline__ double kx_pow2(int e) {  // exact 2**e for -1022 <= e <= 1023
  return __longlong_as_double((long long)(e + 1023) << 52);
}

// bfind (FLO in SASS, one instruction; 31 - __clz compiles to three): the index of w's top set bit, or with
// LEAD its leading zero bits; 0xffffffff for w = 0.
template <bool LEAD>
__device__ __forceinline__ kx_u32 kx_bfind(kx_u32 w) {
#ifdef __CUDA_ARCH__
  kx_u32 r;
  if (LEAD)
    asm("bfind.shiftamt.u32 %0, %1;" : "=r"(r) : "r"(w));
  else
    asm("bfind.u32 %0, %1;" : "=r"(r) : "r"(w));
  return r;
#else
  return w ? (kx_u32)(LEAD ? __clz((int)w) : 31 - __clz((int)w)) : 0xffffffffu;
#endif
}

// x, which the compiler cannot see through: a value so made is kept in its register, not recomputed from what it was
// made of at every use (a rematerialisation that costs an instruction a use).
__device__ __forceinline__ int kx_opaque(int x) {
#ifdef __CUDA_ARCH__
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
#endif
  return x;
}

// The lanes below this one, (1 << lane) - 1 (a special register: read once, kept, not rebuilt by two instructions at
// every use as the compiler does with the shift).
__device__ __forceinline__ kx_u32 kx_lanemask_lt() {
#ifdef __CUDA_ARCH__
  kx_u32 r;
  asm volatile("mov.u32 %0, %%lanemask_lt;" : "=r"(r));
  return r;
#else
  return (1u << (threadIdx.x & 31)) - 1u;
#endif
}

__device__ __forceinline__ int kx_floor_log2(int u) { return (int)kx_bfind<false>((kx_u32)u); }  // -1 for 0

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

// bins.locate's tail: centre and class from the bin coordinate y >= 0 of |mv| (hw: mv's high word, for its sign;
// lvl = level - 4 max(ep, eu)). MAG: the stream's "mag" flag (bins.locate's mag: mv's place in its bin measured
// towards larger magnitudes, so f unflipped for a negative mv).
template <bool MAG>
__device__ __forceinline__ void kx_locate_tail(double y, int hw, int lvl, int& centre, int& cls) {
  const int u = (int)y;  // y < 2**19
  const int sg = hw >> 31;  // -1 for a negative mv
  const int sf = MAG ? 0 : sg;  // the fraction's flip: by value (a negative mv), or none by magnitude
  centre = u ^ sg;
  // where mv lies in its bin, f = y - u (exact), or for a negative mv the CPU's f + (1 - 2 f): that is seen only
  // through q below, which is min(floor(4 (1 - f)), 3) for the rounded 1 - f either way (for f >= 1/4, 1 - 2 f is exact
  // (Sterbenz), so both round the exact 1 - f once; for f < 1/4 both are >= 3/4: q = 3); here 1 - f rounded as
  // |y - (u + 1)|, one rounding of the same exact value (round to nearest even is symmetric); MAG: f = |y - u|
  const double fr = fabs(__dsub_rn(y, (double)(u - sf)));
  const int q = min((int)__dmul_rn(fr, (double)KX_N_FRAC), KX_N_FRAC - 1);  // fr in [0, 1]
  cls = lvl >= 12 ? min(lvl - 12, 3) : KX_N_FINE + 11 * KX_N_FRAC + q - KX_N_FRAC * max(lvl, KX_LVL_LO);
}

// bins.locate: (ep, centre, class) of a location mv (V units, finite, |mv| < 2**400). The bin coordinate
// is V / 2**ep below 2**(ep + mb), one unit per grid step above (bins.bin_of). (Also the encoder's.) MAG: as
// kx_locate_tail's.
template <bool MAG>
__device__ __forceinline__ void kx_locate(double mv, int es, int level, int mb, int& ep, int& centre, int& cls) {
  const int hw = __double2hiint(mv);
  const int ex = ((hw >> 20) & 0x7FF) - 1023;
  ep = min(es, KX_EP_MAX);
  const double av = fabs(mv);
  const int eu = max(ex - mb, 0);  // < 400 - mb
  double y = __dmul_rn(av, kx_pow2(-ep));
  const double y_steps = __dadd_rn((double)((eu - ep) << mb), __dmul_rn(av, kx_pow2(-eu)));
  if (eu > ep) y = y_steps;
  kx_locate_tail<MAG>(y, hw, level - 4 * max(ep, eu), centre, cls);
}

// kx_locate's (centre, class) for a channel's ep = min(es, KX_EP_MAX) >= 0 (kx_channel's), its bin coordinate in
// one fma, |mv| 2**-e + (e - ep) 2**mb with e = max(ep, eu), bit for bit the CPU's: for eu <= ep that is |mv| 2**-ep
// + 0, one rounding of the same product; for eu > ep the product is exact (a normal |mv| scaled into
// [2**mb, 2**(mb + 1))), so the fma rounds the CPU's sum once, as its addition does. MAG: as kx_locate_tail's.
template <bool MAG>
__device__ __forceinline__ void kx_locate_ep(double mv, int ep, int level, int mb, int& centre, int& cls) {
  const int hw = __double2hiint(mv);
  const int e = max(((hw >> 20) & 0x7FF) - 1023 - mb, ep);  // max(ep, eu) (ep >= 0)
  const double p2 = __hiloint2double(0x3FF00000 - (e << 20), 0);  // 2**-e
  kx_locate_tail<MAG>(__fma_rn(fabs(mv), p2, (double)((e << mb) - (ep << mb))), hw, level - 4 * e, centre, cls);
}

// bins.magnitude_symbol: a coded symbol counted by magnitude (mirrored when the centre bin is negative; ESC
// as it is) under a "mag" stream's flag, and the inverse mapping too (it is its own inverse). Also the encoder's.
template <bool MAG>
__device__ __forceinline__ int kx_magnitude_symbol(int sym, int centre) {
  return MAG && centre < 0 && sym != KX_ESC ? 254 - sym : sym;
}

// bins.value_of: the value of a finite pattern, built from its fields: mant * 2**(eoff + max(ef, 1) - 1) as a
// float64 with exponent eoff + mb + max(ef, 1) - 1, less the implicit 2**(eoff + mb) when ef = 0 (exact).
// (A zero's sign may differ from the CPU's 0.0 - v: it only ever meets base + a * dev, the same either way.)
__device__ __forceinline__ double kx_value(int pat, const KxGrid& gr) {
  const int mag = pat & ~gr.sign & 0xFFFF;
  const int ef = mag >> gr.mb;
  const int mant = mag & ((1 << gr.mb) - 1);
  const int e = 1023 + gr.eoff + gr.mb - 1 + max(ef, 1);
  double v = __hiloint2double((e << 20) | (mant << (20 - gr.mb)), 0);
  if (ef == 0) v = __dsub_rn(v, kx_pow2(gr.eoff + gr.mb));
  return (pat & gr.sign) ? -v : v;
}

// A value's raw-bit field: its bits start `skip` bits after its place (a unary depth code), `nb` bits
// (<= 16; skip + nb <= 32 for every decodable value) added to `base`: pattern = base + field, with the sign
// bit of a negative bin (esc: the field is the pattern verbatim).
struct KxField {
  int skip, nb, base;
};

// The field of a value from its symbol (binned.raw_layout, decode_escape_or_bin0); unary = true for bin 0 of
// a bin wider than two binades (its field follows from its depth: kx_unary_field).
__device__ __forceinline__ KxField kx_known_field(int sym, int ep, int u, int mb, int width, bool& unary) {
  const int lg = kx_floor_log2(u);  // -1 for u = 0: that field is replaced below
  const int sh = max(lg + ep - mb, 0);
  const int nb = max(ep - sh, 0);
  KxField fd = {0, nb, (sh << mb) + (u << nb)};  // 1 <= u < 2**mb: 2**nb patterns in one binade
  if (u >= (1 << mb)) fd = {0, 0, u + (ep << mb)};           // one pattern per bin
  if (u == 0) fd = {0, ep, 0};                               // bin 0 of <= two binades: the patterns straight
  unary = u == 0 && ep > mb + 1 && sym != KX_ESC;
  if (sym == KX_ESC) fd = {0, width, 0};
  return fd;
}

// A unary value's extra bits are its depth (at most KX_UNARY), or its last depth when that is below KX_DEPTH_MAX and
// reached: min(depth, cap).
__device__ __forceinline__ kx_u32 kx_unary_cap(int ep, int mb) {
  const int last = ep - mb - 1;
  return last < KX_DEPTH_MAX ? last : KX_UNARY;
}

// The field of a unary value from d = min(its depth, cap) (kx_unary_cap): d zero bits then a one, then mb bits; at
// the last depth (d = cap < KX_DEPTH_MAX: exponent fields 0 and 1) mb + 1 bits without a one; ok = false for a
// depth past KX_DEPTH_MAX (d = cap = KX_UNARY is one: the value is refused, its field never used).
__device__ __forceinline__ KxField kx_unary_field(int d, int cap, int ep, int mb, bool& ok) {
  ok &= d < KX_DEPTH_MAX;
  return d == cap ? KxField{d, mb + 1, 0} : KxField{d + 1, mb, (ep - mb - d) << mb};
}

// One step of an inclusive warp scan: v + __shfl_up_sync(KX_FULL, v, delta) in lanes >= delta, else v; the
// shuffle's own in-range predicate guards the add (two instructions a step, not four)
__device__ __forceinline__ int kx_scan_step(int v, int delta) {
#ifdef __CUDA_ARCH__
  asm("{\n\t.reg .pred p;\n\t.reg .b32 o;\n\tshfl.sync.up.b32 o|p, %0, %1, 0, 0xffffffff;\n\t@p add.s32 %0, %0, o;\n\t}"
      : "+r"(v) : "r"(delta));
  return v;
#else
  const int o = __shfl_up_sync(KX_FULL, v, delta);
  return (int)(threadIdx.x & 31) >= delta ? v + o : v;
#endif
}

// A warp's ring of one of its chunk's word streams (n words at src) in shared memory: words [hi - R, hi)
// are in buf (those not yet passed by the reader), and each lane holds its word of the next 32 (stage),
// loaded one fill step before it is stored. Words past n read as 0. MIRROR: buf[R, R + 32) repeats
// buf[0, 32), so that the words after any ring index are at the next addresses (windows: one address).
template <typename T, int R, bool MIRROR>
struct KxRing {
  T* buf;
  const T* next;  // this lane's next word to stage: src + hi + lane
  kx_u32 n, hi;
  T stage;

  // Word q at p (streaming loads, evicted first: L1 keeps the class tables).
  __device__ __forceinline__ T load(kx_u32 q, const T* p) const { return q < n ? __ldcs(p) : (T)0; }

  __device__ __forceinline__ void init(T* ring, const T* words, kx_u32 count, int lane) {
    buf = ring;
    n = count;
#pragma unroll 4
    for (int q = lane; q < R; q += 32) buf[q] = load(q, words + q);
    if (MIRROR) buf[R + lane] = buf[lane];
    hi = R;
    next = words + R + lane;
    stage = load(hi + lane, next);
    __syncwarp();
  }

  // Store the staged words while that keeps every word from pos on (the reader's next word) in buf.
  // The barriers: every lane's reads of the words replaced are done before, the new words seen after.
  __device__ __forceinline__ void fill(kx_u32 pos, int lane) {
    if (hi + 32 - pos > R) return;  // warp-uniform
    __syncwarp();
    do {  // (unrolled by the compiler: a refill of several steps issues their loads together)
      buf[(hi + lane) & (R - 1)] = stage;
      if (MIRROR && (hi & (R - 1)) == 0) buf[R + lane] = stage;
      hi += 32;
      next += 32;
      stage = load(hi + lane, next);
    } while (hi + 32 - pos <= R);
    __syncwarp();
  }

  // Word q, for pos <= q < pos + R - 32 (pos: the reader's position at the last fill; a batch reads at most
  // 32 * NR rANS words and 32 * NR * 32 + 96 raw bits past it, well inside).
  __device__ __forceinline__ T get(kx_u32 q) const { return buf[q & (R - 1)]; }

  // The ring word holding bit pos (32-bit words): its byte offset straight from pos (pos / 8 & ~3), one add.
  __device__ __forceinline__ const T* word_at(kx_u32 pos) const {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(buf) + ((pos >> 3) & ((R - 1) * 4)));
  }

  // 32 stream bits from bit pos (32-bit words; MIRROR).
  __device__ __forceinline__ kx_u32 window(kx_u32 pos) const {
    const T* at = word_at(pos);
    return __funnelshift_r(at[0], at[1], pos);  // (the shift is pos & 31)
  }

  // 64 stream bits from bit pos, as (lo, hi) (32-bit words; MIRROR).
  __device__ __forceinline__ void window64(kx_u32 pos, kx_u32& lo, kx_u32& hi64) const {
    const T* at = word_at(pos);
    const kx_u32 a1 = at[1];
    lo = __funnelshift_r(at[0], a1, pos);
    hi64 = __funnelshift_r(a1, at[2], pos);
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
template <int OUT, int WARPS, int NR, int LAYOUT, bool BF16, bool MAG>
__global__ void __launch_bounds__(32 * WARPS, 16 / WARPS)  // 16 warps per SM: 2048 chunks in one wave on an H100/H200
    kx_decode(const kx_u16* __restrict__ words, const kx_u32* __restrict__ bits, const long long* __restrict__ chunks,
              int n_chunks, const float* __restrict__ pred, long long pred_g0, long long pred_t,
              const kx_u8* __restrict__ raw, const long long* __restrict__ layout, int shared,
              const kx_u32* __restrict__ tabs, int width, int sign, int mb, int maxmag, int eoff, int D, long long T,
              void* __restrict__ out, const kx_u16* __restrict__ lo16, double* __restrict__ scratch,
              int* __restrict__ status) {
  extern __shared__ double kx_smem[];
  constexpr bool ALIGNED = LAYOUT != KX_GENERAL;
  if (BF16) {  // bins.bin_grid(torch.bfloat16), as constants
    width = 16;
    sign = 0x8000;
    mb = 7;
    maxmag = 0x7F7F;
    eoff = -133;
  }
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
                   warp * (KX_RING_BITS + 32);
  double* const dev = scratch ? scratch + (long long)ci * 5 * D
                              : reinterpret_cast<double*>(ring_b + (WARPS - warp) * (KX_RING_BITS + 32)) + warp * 5 * D;
  const double* const chan = dev + D;  // m, c, a, then es | level << 10 as ints
  if (wlen < LR_HEAD_WORDS) {
    if (lane == 0) status[ci] = 1;
    return;
  }
  kx_u32 x = lr_state(w[2 * lane], w[2 * lane + 1]);
  if (__any_sync(KX_FULL, x < LR_L)) {
    if (lane == 0) status[ci] = 2;
    return;
  }
  if (wlen >= (1ll << 30) || nbw >= (1ll << 26) || nt >= (1ll << 31)) {  // more than any chunk can use: the end checks would fail
    if (lane == 0) status[ci] = 4;
    return;
  }
  KxRing<kx_u16, KX_RING_WORDS, false> rw;
  KxRing<kx_u32, KX_RING_BITS, true> rb;
  rw.init(ring_w, w, (kx_u32)wlen, lane);
  rb.init(ring_b, bits + cd[2], (kx_u32)nbw, lane);
  kx_u32 ptr = LR_HEAD_WORDS;  // next rANS word
  kx_u32 bpos = 0;   // next raw bit
  long long i = 0;   // values decoded in this chunk
  int bad = 0;  // a malformed value (this lane; an int: a bool costs byte masks and sign extensions a token)
  const int ubits = mb + 1;  // the raw bits of a unary value of depth 0
  // D = 32 * NR: every token is one batch starting at lane 0, so thread j always has channels j + 32 r:
  // their parameters (but c: only with a prediction) and deviations stay in registers (no shared-memory
  // round trip per token)
  constexpr bool in_regs = LAYOUT == KX_REGS;
  const int DT = in_regs ? 32 * NR : D;  // D, a constant for REGS (one batch a token: no batch loop)
  const int pre_end = pred || OUT == 4 ? (int)nt - 1 : 0;  // tokens tc < pre_end prefetch for tc + 1 (uniform)
  double rm[NR], rc[NR], ra[NR], rdev[NR];
  int rep[NR], rlev[NR];  // ep, level
  kx_u32 rcap[NR];  // kx_unary_cap
  // The prediction and the float32 low halves a batch reads are loaded one batch ahead (a DRAM round trip
  // is shorter than a batch): the thread's channels of batch (token tt, first channel rr0, place kk).
  float pnext[NR];
  kx_u16 lnext[NR];
  long long g = g0;
  const kx_u32 lane_before = kx_lanemask_lt();  // ALIGNED: the places before this thread's (k = lane)
  const float* pq = pred;  // REGS: this thread's next prefetch addresses (its channel lane of the next token)
  const kx_u16* lq = lo16;
  auto prefetch_regs = [&]() {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (pred) pnext[r] = __ldcs(pq + 32 * r);
      if (OUT == 4) lnext[r] = __ldcs(lq + 32 * r);
    }
    if (pred) pq += 32 * NR;
    if (OUT == 4) lq += 32 * NR;
  };
  auto prefetch = [&](long long tt, int rr0, int kk) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int dn = ALIGNED ? rr0 + 32 * r + kk : min(rr0 + 32 * r + kk, D - 1);
      if (pred) pnext[r] = __ldcs(pred + ((g - pred_g0) * pred_t + tt) * D + dn);
      if (OUT == 4) lnext[r] = __ldcs(lo16 + (g * T + tt) * D + dn);
    }
  };
  for (; g < g0 + ng; ++g) {
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
        rc[r] = chan[D + lane + 32 * r];
        ra[r] = chan[2 * D + lane + 32 * r];
        const int el = reinterpret_cast<const int*>(chan + 3 * D)[lane + 32 * r];
        rep[r] = kx_opaque(el & 1023);  // (opaque: kept in a register, not rebuilt from el at every use)
        rlev[r] = el >> 10;
        rcap[r] = (kx_u32)kx_opaque((int)kx_unary_cap(el & 1023, gr.mb));
        rdev[r] = 0.0;
      }
    }
    if (in_regs) {
      if (pred) pq = pred + ((g - pred_g0) * pred_t + t0) * D + lane;
      if (OUT == 4) lq = lo16 + (g * T + t0) * D + lane;
      if (nt > 0) prefetch_regs();
    } else if (nt > 0) {
      prefetch(t0, 0, (lane - (ALIGNED ? 0 : (int)(i & 31))) & 31);
    }
    char* orow = reinterpret_cast<char*>(out) + (g * T + t0) * D * OUT;  // the token's output row
    for (int tc = 0; tc < (int)nt; ++tc, orow += DT * OUT) {  // token t = t0 + tc
      const long long t = t0 + tc;
      const int s = ALIGNED ? 0 : (int)(i & 31);
      const int k = (lane - s) & 31;  // this thread's place in a round
      const kx_u32 before = ALIGNED ? lane_before : (1u << k) - 1u;
      for (int r0 = 0; r0 < DT; r0 += 32 * NR) {
        float pf[NR];
        kx_u16 lo[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          pf[r] = pnext[r];
          lo[r] = lnext[r];
        }
        if (in_regs) {
          if (tc < pre_end) prefetch_regs();
        } else if (r0 + 32 * NR < D)  // warp-uniform: the next batch of this token, or the next token's first
          prefetch(t, r0 + 32 * NR, k);
        else if (tc < pre_end)
          prefetch(t + 1, 0, (lane - (ALIGNED ? 0 : (int)((i + D) & 31))) & 31);
        double base[NR];
        int ep[NR], centre[NR], cls[NR], sym[NR], neg[NR], cnt[NR];
        kx_u32 place[NR];
        KxField fd[NR];
        bool act[NR], unary[NR];
        // 1. model: straight-line code for every lane (a lane past D computes channel D - 1 and is
        // masked later), so the rounds' dependent float64 chains interleave
        int dd[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          act[r] = ALIGNED || r0 + 32 * r + k < D;
          dd[r] = ALIGNED ? r0 + 32 * r + k : min(r0 + 32 * r + k, D - 1);
          base[r] = in_regs ? rm[r] : chan[dd[r]];  // m + c * 0 is m exactly (m is never -0.0)
        }
        if (pred) {  // warp-uniform; m + c p in one fma: c p is exact (c = cq / 64, |cq| <= 128; p a float32)
#pragma unroll
          for (int r = 0; r < NR; ++r)
            base[r] = __fma_rn(in_regs ? rc[r] : chan[D + dd[r]], (double)(isfinite(pf[r]) ? pf[r] : 0.0f), base[r]);
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const double mu = __dadd_rn(base[r], in_regs ? __dmul_rn(ra[r], rdev[r]) : __dmul_rn(chan[2 * D + dd[r]], dev[dd[r]]));
          double mv = __dmul_rn(mu, gr.inv_unit);
          if (!(fabs(mv) < kx_pow2(400))) mv = 0.0;  // bins.MU_MAX
          const int el = in_regs ? 0 : reinterpret_cast<const int*>(chan + 3 * D)[dd[r]];
          ep[r] = in_regs ? rep[r] : el & 1023;  // es <= KX_EP_MAX
          kx_locate_ep<MAG>(mv, ep[r], in_regs ? rlev[r] : el >> 10, gr.mb, centre[r], cls[r]);
        }
        // 2. rANS, round after round (every value of a round present: ALIGNED, or r0 + 32 r < D)
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          sym[r] = 0;
          if (!ALIGNED && r0 + 32 * r >= D) continue;  // warp-uniform
          const kx_u32 e = act[r] ? __ldg(tabs + ((kx_u32)cls[r] << LR_PREC | (x & (LR_M - 1u)))) : 0u;
          kx_u32 xn = lr_decode_entry(x, e, LR_PREC);
          const bool need = act[r] && lr_needs_word(xn);
          const kx_u32 bal = __ballot_sync(KX_FULL, need);
          const kx_u32 vo = ALIGNED ? bal : __funnelshift_r(bal, bal, s);  // value order
          if (need) xn = lr_refill(xn, (kx_u32)rw.get(ptr + lr_rank(vo, before)));
          if (act[r]) x = xn;
          ptr += __popc(bal);
          sym[r] = (int)lr_entry_symbol(e);
        }
        // 3. raw bits: every value's field from its symbol (unary values: depth 0 for now) and its bit count
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          sym[r] = kx_magnitude_symbol<MAG>(sym[r], centre[r]);
          const int j = centre[r] + sym[r] - KX_CENTRE;
          neg[r] = j >> 31;
          fd[r] = kx_known_field(sym[r], ep[r], j ^ neg[r], gr.mb, gr.width, unary[r]);
          unary[r] &= act[r];
          cnt[r] = !act[r] ? 0 : unary[r] ? ubits : fd[r].nb;  // unary values: as if of depth 0 for now
        }
        // places: an exclusive scan of the bit counts in value order (two rounds a word: < 2**16 each; a unary
        // value's extra bits are added below)
        int incl[(NR + 1) / 2], known[(NR + 1) / 2];
#pragma unroll
        for (int q = 0; q < (NR + 1) / 2; ++q) {
          known[q] = cnt[2 * q] | (2 * q + 1 < NR ? cnt[2 * q + 1] << 16 : 0);
          incl[q] = known[q];
        }
#pragma unroll
        for (int delta = 1; delta < 32; delta <<= 1) {
#pragma unroll
          for (int q = 0; q < (NR + 1) / 2; ++q) {
            if (ALIGNED) {
              incl[q] = kx_scan_step(incl[q], delta);
            } else {
              const int o = __shfl_sync(KX_FULL, incl[q], (lane - delta) & 31);
              if (k >= delta) incl[q] += o;
            }
          }
        }
        kx_u32 uv[NR];  // unary values, in value order
        kx_u32 end = bpos;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const kx_u32 ub = __ballot_sync(KX_FULL, unary[r]);
          uv[r] = ALIGNED ? ub : __funnelshift_r(ub, ub, s);
          const int sh = 16 * (r & 1);
          const int ex = ((incl[r / 2] - known[r / 2]) >> sh) & 0xFFFF;
          place[r] = end + ex;
          const int total = (__shfl_sync(KX_FULL, incl[r / 2], (31 + s) & 31) >> sh) & 0xFFFF;  // the round's total
          end += total;
        }
        // unary values in value order: each one's depth from its own window at its place (read beforehand, bit
        // reversed: the place moves only by the depths before it, which the warp adds up in delta; the value's
        // thread counts its zeros and the warp takes the new sum from it: one shuffle a unary value)
        bool any_unary = false;
#pragma unroll
        for (int r = 0; r < NR; ++r) any_unary |= uv[r] != 0u;
        if (any_unary) {  // warp-uniform
          kx_u64 wrev[NR];  // the 64 bits at the place, the first in the top bit
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            wrev[r] = 0;
            if (unary[r]) {
              kx_u32 wlo, whi;
              rb.window64(place[r], wlo, whi);
              wrev[r] = (kx_u64)__brev(wlo) << 32 | __brev(whi);
            }
          }
          int delta = 0;  // extra bits (over ubits) of the unary values passed so far
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            const kx_u32 cap = in_regs ? rcap[r] : kx_unary_cap(ep[r], gr.mb);
            int mine = delta;  // extra bits of the unary values before this thread's value
            int myx = 0;       // this thread's value's extra bits (its depth, but at the last depth)
            kx_u32 rp = __brev(uv[r]);  // the unary values not yet passed, the first in the top bit
            // the next one, its stream bits from place + delta in `top` (first bit at the top; thread src's)
            auto pass = [&](kx_u32 top) {
              const int jv = (int)kx_bfind<true>(rp);
              const kx_u32 bit = 0x80000000u >> jv;
              const int extra = (int)min(kx_bfind<true>(top), cap);  // (0xffffffff for no one bit)
              if (jv == k) myx = extra;
              delta = __shfl_sync(KX_FULL, delta + extra, ALIGNED ? jv : (jv + s) & 31);
              if (jv < k) mine = delta;
              rp ^= bit;
            };
            while (rp && delta <= 64 - KX_UNARY) pass((kx_u32)((wrev[r] << delta) >> 32));
            while (rp) pass(__brev(rb.window(place[r] + delta)));  // warp-uniform, rare: past the window, the ring
            bool ok = true;
            const KxField uf = kx_unary_field(myx, (int)cap, ep[r], gr.mb, ok);  // myx: the depth where it matters
            if (unary[r]) {
              fd[r] = uf;
              bad |= (int)!ok;
              place[r] += uf.skip;  // the field's first bit
            }
            place[r] += mine;
          }
          end += delta;
        }
        // 4. patterns, every value at its place
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          if (!act[r]) continue;
          const kx_u32 field = rb.window(place[r]) & ~(0xFFFFFFFFu << fd[r].nb);  // (place: past the skip)
          const int mag = fd[r].base + (int)field;
          const bool esc = sym[r] == KX_ESC;
          const bool over = !esc && mag > gr.maxmag;
          bad |= (int)over;
          const int pat = esc ? (int)field : (over ? 0 : mag | (gr.sign & neg[r]));
          const int d = r0 + 32 * r + k;
          if (OUT == 1) {
            reinterpret_cast<kx_u8*>(orow)[d] = (kx_u8)pat;
          } else if (OUT == 2) {
            reinterpret_cast<kx_u16*>(orow)[d] = (kx_u16)pat;
          } else {
            reinterpret_cast<kx_u32*>(orow)[d] = ((kx_u32)pat << 16) | (kx_u32)lo[r];
          }
          const double v = BF16 ? (double)__int_as_float(pat << 16) : kx_value(pat, gr);
          const double dv = esc ? 0.0 : __dsub_rn(v, base[r]);  // ESC: no residual
          if (in_regs) {
            rdev[r] = dv;
          } else {
            dev[d] = dv;
          }
        }
        bpos = end;
        rw.fill(ptr, lane);
        rb.fill(bpos >> 5, lane);
      }
      i += DT;
      if (!in_regs) __syncwarp();  // dev[] written, read by other threads next token
    }
  }
  if (__any_sync(KX_FULL, bad != 0)) {  // a malformed chunk decodes on (every read is bounded) to its end
    if (lane == 0) status[ci] = 5;
    return;
  }
  const bool end_bad = x != LR_L || ptr != wlen || (bpos + 31) / 32 != nbw;
  if (__any_sync(KX_FULL, end_bad) && lane == 0) status[ci] = 4;
}
