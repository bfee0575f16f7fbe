// GPU kernels of the "planes" codec (launchers: kvcodec/cuda/planes_codec.py): byte-plane split with
// histograms, 32-lane rANS encode of chunk streams, stream compaction and the plane merge of decoding.
// The format is kvcodec/entropy/rans_lanes.py's (the CPU encoder there is the reference, byte for byte):
// 12-bit probabilities, 32-bit states in [2^16, 2^32), 16-bit renormalisation words; element i of a
// chunk uses lane i % 32; a stream is the 32 final states (low, high 16 bits each), then the words in
// the order the decoder reads them.
//
// Encoding runs backwards through a chunk, one warp per chunk (lane k owns state k). In a group of 32
// elements the CPU encoder handles lane 31 first and pushes each emitted word to the FRONT of the
// stream, so the emitting lanes' words land in ascending lane order: lane k writes at
// wp - count + popcount(emit & lanes_below_k), then wp -= count (a ballot, as in the decoder).

typedef unsigned char pc_u8;
typedef unsigned short pc_u16;
typedef unsigned int pc_u32;
typedef unsigned long long pc_u64;

#define PC_FULL 0xffffffffu
#define PC_L 65536u
#define PC_PREC 12

// ---------------------------------------------------------------------------------------------- split
// Layout 0 (f16: bf16/fp16 words u): plane 0 = (u >> 7) & 0xFF, plane 1 = (u >> 15) << 7 | (u & 0x7F).
// Layout 1 (f32): planes 0-1 as f16 on the upper 16 bits, plane 2 = byte 1, plane 3 = byte 0.
// Layout 2 (bytes): plane k = byte k of each element (itemsize planes).
template <int LAYOUT>
__device__ __forceinline__ pc_u8 pc_plane_byte(const pc_u8* __restrict__ raw, long long i, int itemsize, int k) {
  if (LAYOUT == 0) {
    const pc_u32 u = reinterpret_cast<const pc_u16*>(raw)[i];
    return k == 0 ? (pc_u8)((u >> 7) & 0xFF) : (pc_u8)(((u >> 8) & 0x80) | (u & 0x7F));
  } else if (LAYOUT == 1) {
    const pc_u32 u = reinterpret_cast<const pc_u32*>(raw)[i];
    if (k == 0) return (pc_u8)((u >> 23) & 0xFF);
    if (k == 1) return (pc_u8)(((u >> 24) & 0x80) | ((u >> 16) & 0x7F));
    return k == 2 ? (pc_u8)((u >> 8) & 0xFF) : (pc_u8)(u & 0xFF);
  } else {
    return raw[i * itemsize + k];
  }
}

// planes: nplanes x n bytes (plane k at planes + k * n); hist: nplanes x 256 u64 (zeroed by the
// caller). Warp-aggregated shared-memory histograms (a plane often holds a handful of values, so
// lanes collide on one bin: __match_any_sync makes that one atomic per distinct value).
template <int LAYOUT>
__global__ void __launch_bounds__(256) pc_split_hist(const pc_u8* __restrict__ raw, long long n, int itemsize,
                                                     int nplanes, pc_u8* __restrict__ planes,
                                                     pc_u64* __restrict__ hist) {
  __shared__ pc_u32 sh[8 * 256];
  for (int j = threadIdx.x; j < nplanes * 256; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const long long stride = (long long)gridDim.x * blockDim.x;
  // i0 is the warp's first element: every lane of a warp runs the same iterations (match-safe)
  for (long long i0 = (long long)blockIdx.x * blockDim.x + (threadIdx.x & ~31); i0 < n; i0 += stride) {
    const long long i = i0 + lane;
    const bool active = i < n;
    for (int k = 0; k < nplanes; ++k) {
      const pc_u32 v = active ? pc_plane_byte<LAYOUT>(raw, i, itemsize, k) : 256u + lane;
      if (active) planes[(long long)k * n + i] = (pc_u8)v;
      const unsigned peers = __match_any_sync(PC_FULL, v);
      if (active && lane == __ffs(peers) - 1) atomicAdd(&sh[k * 256 + v], (pc_u32)__popc(peers));
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < nplanes * 256; j += blockDim.x)
    if (sh[j]) atomicAdd(hist + j, (pc_u64)sh[j]);
}

// ---------------------------------------------------------------------------------------------- encode
// Symbols of a chunk are read 128 at a time: lane k holds bytes [128 b + 4 k, +4) of block b; the
// symbol of element 32 g + k is byte k & 3 of lane 8 (g & 3) + (k >> 2)'s word of block g >> 2.
__device__ __forceinline__ pc_u32 pc_load_block(const pc_u8* __restrict__ sp, long long n, long long b, int lane,
                                                bool aligned) {
  if (b < 0) return 0u;
  const long long off = 128 * b + 4 * lane;
  if (aligned && off + 4 <= n) return __ldg(reinterpret_cast<const pc_u32*>(sp + off));
  pc_u32 v = 0u;
  for (int t = 0; t < 4; ++t)
    if (off + t < n) v |= (pc_u32)__ldg(sp + off + t) << (8 * t);
  return v;
}

// jobs [J, 4] int64: byte offset of the chunk's first symbol in src, symbol count, table id, unused.
// tables [T, 256] u32 frequencies (summing to 4096). scratch: J x cap u16 (cap >= count + 64); the
// stream of job j is written to the END of its slot: words [cap - len, cap); lens[j] = len, or -1 if
// a symbol has frequency 0 (a wrong table: the caller raises).
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS) pc_rans_encode(const pc_u8* __restrict__ src,
                                                             const long long* __restrict__ jobs, int njobs,
                                                             const pc_u32* __restrict__ tables,
                                                             pc_u16* __restrict__ scratch, long long cap,
                                                             long long* __restrict__ lens) {
  __shared__ pc_u32 s_freq[WARPS][256];
  __shared__ pc_u32 s_cum[WARPS][256];
  __shared__ pc_u32 s_rcp[WARPS][256];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int job = blockIdx.x * WARPS + warp;
  if (job >= njobs) return;  // warp-uniform; no block barrier below
  const long long* jd = jobs + 4 * (long long)job;
  const long long a = jd[0], n = jd[1];
  const pc_u32* tab = tables + 256 * jd[2];
  // table -> shared: frequencies, exclusive cumulative sums (warp scan), reciprocals for the division
  pc_u32 run = 0u;
  for (int base = 0; base < 256; base += 32) {
    const pc_u32 f = tab[base + lane];
    pc_u32 incl = f;
    for (int d = 1; d < 32; d <<= 1) {
      const pc_u32 o = __shfl_up_sync(PC_FULL, incl, d);
      if (lane >= d) incl += o;
    }
    s_freq[warp][base + lane] = f;
    s_cum[warp][base + lane] = run + incl - f;
    s_rcp[warp][base + lane] = f >= 2u ? (pc_u32)(0x100000000ull / f) : 0xffffffffu;
    run += __shfl_sync(PC_FULL, incl, 31);
  }
  __syncwarp();
  const pc_u8* sp = src + a;
  const bool aligned = (reinterpret_cast<unsigned long long>(sp) & 3ull) == 0ull;
  pc_u16* wb = scratch + (long long)job * cap;
  long long wp = cap;
  pc_u32 x = PC_L;
  bool bad = false;
  const pc_u32 below = (1u << lane) - 1u;
  const long long G = (n + 31) >> 5;
  long long blk = (G - 1) >> 2;
  pc_u32 cur = pc_load_block(sp, n, blk, lane, aligned);
  pc_u32 nx1 = pc_load_block(sp, n, blk - 1, lane, aligned);
  pc_u32 nx2 = pc_load_block(sp, n, blk - 2, lane, aligned);
  for (long long g = G - 1; g >= 0; --g) {
    if ((g >> 2) != blk) {  // warp-uniform: the next block down
      blk = g >> 2;
      cur = nx1;
      nx1 = nx2;
      nx2 = pc_load_block(sp, n, blk - 2, lane, aligned);
    }
    const int gi = (int)(g & 3);
    const pc_u32 word = __shfl_sync(PC_FULL, cur, 8 * gi + (lane >> 2));
    const pc_u32 s = (word >> (8 * (lane & 3))) & 0xFFu;
    const bool active = 32 * g + lane < n;
    const pc_u32 f = s_freq[warp][s];
    bad |= active && f == 0u;
    const bool need = active && (pc_u64)x >= ((pc_u64)f << (32 - PC_PREC));
    const pc_u32 m = __ballot_sync(PC_FULL, need);
    const int cnt = __popc(m);
    if (need) {
      wb[wp - cnt + __popc(m & below)] = (pc_u16)(x & 0xFFFFu);
      x >>= 16;
    }
    wp -= cnt;
    if (active && f) {
      pc_u32 q = __umulhi(x, s_rcp[warp][s]);
      pc_u32 r = x - q * f;
      if (r >= f) {
        ++q;
        r -= f;
      }
      x = (q << PC_PREC) + r + s_cum[warp][s];
    }
  }
  wb[wp - 64 + 2 * lane] = (pc_u16)(x & 0xFFFFu);
  wb[wp - 64 + 2 * lane + 1] = (pc_u16)(x >> 16);
  wp -= 64;
  const bool any_bad = __any_sync(PC_FULL, bad);
  if (lane == 0) lens[job] = any_bad ? -1 : cap - wp;
}

// Copy each job's stream (the last lens[j] words of its scratch slot) to dst + dst_off[j] (words).
__global__ void __launch_bounds__(256) pc_gather(const pc_u16* __restrict__ scratch, long long cap,
                                                 const long long* __restrict__ lens,
                                                 const long long* __restrict__ dst_off, pc_u16* __restrict__ dst) {
  const long long j = blockIdx.x;
  const long long len = lens[j];
  const pc_u16* s = scratch + j * cap + (cap - len);
  pc_u16* d = dst + dst_off[j];
  for (long long i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
}

// ---------------------------------------------------------------------------------------------- merge
// Inverse of pc_split_hist. pdesc [nplanes, 2] int64: device address of the plane's n bytes (0: a
// constant plane), the constant byte. out: n elements of the layout.
template <int LAYOUT>
__device__ __forceinline__ pc_u32 pc_get(const long long* __restrict__ pd, int k, long long i) {
  const long long p = pd[2 * k];
  return p ? (pc_u32)reinterpret_cast<const pc_u8*>(p)[i] : (pc_u32)pd[2 * k + 1];
}

template <int LAYOUT>
__global__ void __launch_bounds__(256) pc_merge(const long long* __restrict__ pdesc, int itemsize, long long n,
                                                pc_u8* __restrict__ out) {
  __shared__ long long pd[16];
  if (threadIdx.x < 2 * (LAYOUT == 0 ? 2 : LAYOUT == 1 ? 4 : itemsize)) pd[threadIdx.x] = pdesc[threadIdx.x];
  __syncthreads();
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (LAYOUT == 0) {
      const pc_u32 e = pc_get<LAYOUT>(pd, 0, i), s = pc_get<LAYOUT>(pd, 1, i);
      reinterpret_cast<pc_u16*>(out)[i] = (pc_u16)(((s & 0x80u) << 8) | (e << 7) | (s & 0x7Fu));
    } else if (LAYOUT == 1) {
      const pc_u32 e = pc_get<LAYOUT>(pd, 0, i), s = pc_get<LAYOUT>(pd, 1, i);
      const pc_u32 b1 = pc_get<LAYOUT>(pd, 2, i), b0 = pc_get<LAYOUT>(pd, 3, i);
      reinterpret_cast<pc_u32*>(out)[i] = ((s & 0x80u) << 24) | (e << 23) | ((s & 0x7Fu) << 16) | (b1 << 8) | b0;
    } else {
      for (int k = 0; k < itemsize; ++k) out[i * itemsize + k] = (pc_u8)pc_get<LAYOUT>(pd, k, i);
    }
  }
}
