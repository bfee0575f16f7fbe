// GPU kernels of the "planes" codec (launchers: kvcodec/lossless/cuda/planes_codec.py): byte-plane split with
// histograms, 32-lane rANS encode of chunk streams, stream compaction and the plane merge of decoding.
// The format is kvcodec/entropy/rans_lanes.py's (the CPU encoder there is the reference, byte for byte):
// 12-bit probabilities, 32-bit states in [2^16, 2^32), 16-bit renormalisation words; element i of a
// chunk uses lane i % 32; a stream is the 32 final states (low, high 16 bits each), then the words in
// the order the decoder reads them. The coder's constants, table entries and steps: lane_rans.cuh.
//
// Encoding runs backwards through a chunk, one warp per chunk (lane k owns state k). In a group of 32
// elements the CPU encoder handles lane 31 first and pushes each emitted word to the FRONT of the
// stream, so the emitting lanes' words land in ascending lane order: lane k writes at
// wp - count + popcount(emit & lanes_below_k), then wp -= count (a ballot, as in the decoder).

#include "kvcodec/entropy/cuda/lane_rans.cuh"

typedef unsigned char pc_u8;
typedef unsigned short pc_u16;
typedef unsigned int pc_u32;
typedef unsigned long long pc_u64;

#define PC_FULL 0xffffffffu

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

// Byte k of a 16-byte vector (k < 16, a run-time index: selects, no local memory).
__device__ __forceinline__ pc_u32 pc_vec_byte(const uint4& v, int k) {
  const int w = k >> 2;
  const pc_u32 word = w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
  return (word >> (8 * (k & 3))) & 0xFFu;
}

// Plane k's byte of element e of a 16-byte vector of elements of ITEM bytes (e compile-time).
template <int LAYOUT, int ITEM>
__device__ __forceinline__ pc_u32 pc_vec_symbol(const uint4& v, int e, int k) {
  if (LAYOUT == 0) {
    const pc_u32 word = (e >> 1) == 0 ? v.x : (e >> 1) == 1 ? v.y : (e >> 1) == 2 ? v.z : v.w;
    const pc_u32 u = (e & 1) ? word >> 16 : word & 0xFFFFu;
    return k == 0 ? (u >> 7) & 0xFFu : ((u >> 8) & 0x80u) | (u & 0x7Fu);
  } else if (LAYOUT == 1) {
    const pc_u32 u = e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
    if (k == 0) return (u >> 23) & 0xFFu;
    if (k == 1) return ((u >> 24) & 0x80u) | ((u >> 16) & 0x7Fu);
    return k == 2 ? (u >> 8) & 0xFFu : u & 0xFFu;
  } else {
    return pc_vec_byte(v, e * ITEM + k);
  }
}

// The histogram's counters: per warp and plane, 256 one-byte counters per lane, kept as words
// [plane][bin / 4][lane] (byte bin % 4 of the word): a lane only touches its own column (bank =
// lane: no conflicts, no atomics, whatever the data), and counts <= 255 between flushes. A flush
// adds the warp's 32 columns into registers: lane L owns bins 8L..8L+7 (words 2L, 2L + 1 of every
// lane; lane L starts at column L so the 32 lanes read 32 banks), then zeroes its own column.
template <int PP>
__device__ __forceinline__ void pc_hist_flush(pc_u32 (*cnt)[64][32], int lane, pc_u32 (&tot)[PP][8]) {
  __syncwarp();
#pragma unroll
  for (int q = 0; q < PP; ++q) {
    pc_u32 e0 = 0u, o0 = 0u, e1 = 0u, o1 = 0u;  // two 16-bit sums each: bins (0, 2), (1, 3), (4, 6), (5, 7)
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
      const int j = (i + lane) & 31;
      const pc_u32 a = cnt[q][2 * lane][j], b = cnt[q][2 * lane + 1][j];
      e0 += a & 0x00FF00FFu;
      o0 += (a >> 8) & 0x00FF00FFu;
      e1 += b & 0x00FF00FFu;
      o1 += (b >> 8) & 0x00FF00FFu;
    }
    tot[q][0] += e0 & 0xFFFFu;
    tot[q][1] += o0 & 0xFFFFu;
    tot[q][2] += e0 >> 16;
    tot[q][3] += o0 >> 16;
    tot[q][4] += e1 & 0xFFFFu;
    tot[q][5] += o1 & 0xFFFFu;
    tot[q][6] += e1 >> 16;
    tot[q][7] += o1 >> 16;
  }
  __syncwarp();
#pragma unroll
  for (int q = 0; q < PP; ++q)
#pragma unroll 8
    for (int r = 0; r < 64; ++r) cnt[q][r][lane] = 0u;
  __syncwarp();
}

// Split + histograms. raw: n elements of ITEM bytes, 16-byte aligned. A block handles planes
// PP * blockIdx.y .. + PP - 1 (PP divides nplanes) and writes them (unless planes is null: a single
// plane that is the input itself) at planes + k * stride (stride a multiple of 16); partial:
// [gridDim.x, nplanes, 256] u64, each block's counts of its planes (summed by the caller: no global
// atomics, which contend on the few hot bins of a skewed plane). Each lane takes 16-byte vectors (a
// warp 512 contiguous bytes per step), the next one loaded before the current one is counted; the
// < 16 bytes past the last whole vector are counted by block 0's first warp.
#define PC_HIST_WARPS_TIMES_PLANES 4
template <int LAYOUT, int ITEM, int PP>
__global__ void __launch_bounds__(32 * PC_HIST_WARPS_TIMES_PLANES / PP)
    pc_split_hist(const pc_u8* __restrict__ raw, long long n, long long stride, pc_u8* __restrict__ planes,
                  unsigned long long* __restrict__ partial) {
  constexpr int WARPS = PC_HIST_WARPS_TIMES_PLANES / PP;
  constexpr int E = 16 / ITEM;                                        // elements per vector
  constexpr int FLUSH = 255 / E;                                      // vectors per lane between flushes
  constexpr int NPLANES = LAYOUT == 0 ? 2 : LAYOUT == 1 ? 4 : ITEM;
  __shared__ pc_u32 cnt_all[WARPS][PP][64][32];  // 32 KiB
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  pc_u32(*cnt)[64][32] = cnt_all[warp];
  const int k0 = NPLANES == PP ? 0 : PP * blockIdx.y;  // compile-time 0 when one block row covers every plane
#pragma unroll
  for (int q = 0; q < PP; ++q)
    for (int r = 0; r < 64; ++r) cnt[q][r][lane] = 0u;
  __syncwarp();
  pc_u32 tot[PP][8];
#pragma unroll
  for (int q = 0; q < PP; ++q)
#pragma unroll
    for (int b = 0; b < 8; ++b) tot[q][b] = 0u;
  const long long nvec = (n * ITEM) >> 4;
  const long long wstride = 32ll * WARPS * gridDim.x;
  const uint4* src = reinterpret_cast<const uint4*>(raw);
  long long v = 32ll * (WARPS * (long long)blockIdx.x + warp) + lane;
  uint4 cur = v < nvec ? __ldg(src + v) : make_uint4(0u, 0u, 0u, 0u);
  int since = 0;
  // the loop runs warp-uniformly (the flush needs every lane): v - lane is the warp's first vector
  for (; v - lane < nvec; v += wstride) {
    const long long vn = v + wstride;
    const uint4 nxt = vn < nvec ? __ldg(src + vn) : make_uint4(0u, 0u, 0u, 0u);
    if (v < nvec) {
#pragma unroll
      for (int q = 0; q < PP; ++q) {
        pc_u32 packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const pc_u32 s = pc_vec_symbol<LAYOUT, ITEM>(cur, e, k0 + q);
          cnt[q][s >> 2][lane] += 1u << (8 * (s & 3u));
          packed[e >> 2] |= s << (8 * (e & 3));
        }
        if (planes) {
          pc_u8* dst = planes + (long long)(k0 + q) * stride + v * E;
          if (E == 16) *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
          else if (E == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
          else if (E == 4) *reinterpret_cast<pc_u32*>(dst) = packed[0];
          else *reinterpret_cast<pc_u16*>(dst) = (pc_u16)packed[0];
        }
      }
    }
    if (++since == FLUSH) {  // warp-uniform
      pc_hist_flush<PP>(cnt, lane, tot);
      since = 0;
    }
    cur = nxt;
  }
  pc_hist_flush<PP>(cnt, lane, tot);
  // the block's counts: the warps' registers added in shared memory (the counters' space reused)
  __syncthreads();
  pc_u32* red = &cnt_all[0][0][0][0];
  for (int j = threadIdx.x; j < PP * 256; j += blockDim.x) red[j] = 0u;
  __syncthreads();
#pragma unroll
  for (int q = 0; q < PP; ++q)
#pragma unroll
    for (int b = 0; b < 8; ++b)
      if (tot[q][b]) atomicAdd(red + q * 256 + 8 * lane + b, tot[q][b]);
  if (blockIdx.x == 0 && warp == 0) {  // the elements past the last whole vector (fewer than E)
    const long long i = nvec * E + lane;
    if (i < n) {
      for (int q = 0; q < PP; ++q) {
        const int k = k0 + q;
        const pc_u32 s = pc_plane_byte<LAYOUT>(raw, i, ITEM, k);
        if (planes) planes[(long long)k * stride + i] = (pc_u8)s;
        atomicAdd(red + q * 256 + s, 1u);
      }
    }
  }
  __syncthreads();
  unsigned long long* out = partial + ((long long)blockIdx.x * NPLANES + k0) * 256;
  for (int j = threadIdx.x; j < PP * 256; j += blockDim.x) out[j] = red[j];
}

// ---------------------------------------------------------------------------------------------- encode
// Symbols of a chunk are read 128 at a time: lane k holds bytes [128 b + 4 k, +4) of block b; the
// symbol of element 32 g + k is byte k & 3 of lane 8 (g & 3) + (k >> 2)'s word of block g >> 2.
// Chunks hold < 2^24 symbols, so positions are 32-bit.
__device__ __forceinline__ pc_u32 pc_load_block(const pc_u8* __restrict__ sp, int n, int b, int lane, bool aligned) {
  if (b < 0) return 0u;
  const int off = 128 * b + 4 * lane;
  if (aligned && off + 4 <= n) return __ldg(reinterpret_cast<const pc_u32*>(sp + off));
  pc_u32 v = 0u;
  for (int t = 0; t < 4; ++t)
    if (off + t < n) v |= (pc_u32)__ldg(sp + off + t) << (8 * t);
  return v;
}

// jobs [J, 4] int64: byte offset of the chunk's first symbol in src, symbol count (< 2^24), table id,
// unused. tables [T, 256] u32 frequencies (summing to LR_M). scratch: J x cap u16 (cap >= count + 64);
// the stream of job j is written to the END of its slot: words [cap - len, cap); lens[j] = len, or -1
// if a symbol has frequency 0 (a wrong table: the caller raises).
//
// The warp is issue-bound (one chunk per warp, every chunk in flight at once), so a step is kept
// short: the four groups of a block unrolled (compile-time shuffle sources), 32-bit positions, the
// symbol's frequency, reciprocal and start loaded together before the state is touched.
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
  const long long a = jd[0];
  const int n = (int)jd[1];
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
    s_rcp[warp][base + lane] = lr_reciprocal(f);
    run += __shfl_sync(PC_FULL, incl, 31);
  }
  __syncwarp();
  const pc_u32* fr = s_freq[warp];
  const pc_u32* cm = s_cum[warp];
  const pc_u32* rc = s_rcp[warp];
  const pc_u8* sp = src + a;
  const bool aligned = (reinterpret_cast<unsigned long long>(sp) & 3ull) == 0ull;
  pc_u16* wb = scratch + (long long)job * cap;
  int wp = (int)cap;
  pc_u32 x = LR_L;
  pc_u32 bad = 0u;
  const pc_u32 below = (1u << lane) - 1u;
  const int G = (n + 31) >> 5;
  int blk = (G - 1) >> 2;
  pc_u32 cur = pc_load_block(sp, n, blk, lane, aligned);
  pc_u32 nx1 = pc_load_block(sp, n, blk - 1, lane, aligned);
  pc_u32 nx2 = pc_load_block(sp, n, blk - 2, lane, aligned);
  for (; blk >= 0; --blk) {
#pragma unroll
    for (int gi = 3; gi >= 0; --gi) {
      const int g = 4 * blk + gi;
      if (g >= G) continue;  // warp-uniform (the top block only)
      const pc_u32 word = __shfl_sync(PC_FULL, cur, 8 * gi + (lane >> 2));
      const pc_u32 s = (word >> (8 * (lane & 3))) & 0xFFu;
      const bool active = 32 * g + lane < n;
      const pc_u32 f = fr[s], r_inv = rc[s], c = cm[s];
      bad |= (pc_u32)(active && f == 0u);
      lr_encode_step<LR_PREC>(x, active, f, r_inv, c, below, wb, wp);
    }
    cur = nx1;
    nx1 = nx2;
    nx2 = pc_load_block(sp, n, blk - 3, lane, aligned);
  }
  lr_encode_head(x, lane, wb, wp);
  const bool any_bad = __any_sync(PC_FULL, bad != 0u);
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
// Inverse of pc_split_hist. d0..d15: per plane (up to 8) the device address of its n bytes (0: a constant
// plane) and the constant byte, passed by value (no upload). out: n elements of the layout. A thread rebuilds 16 bytes of
// out (E elements) from E bytes of each plane when out is 16-byte and every plane E-byte aligned
// (the decoder's rows and the blob's sections are); the rest, or everything otherwise, by elements.
template <int LAYOUT>
__device__ __forceinline__ pc_u32 pc_get(const long long* __restrict__ pd, int k, long long i) {
  const long long p = pd[2 * k];
  return p ? (pc_u32)reinterpret_cast<const pc_u8*>(p)[i] : (pc_u32)pd[2 * k + 1];
}

// E bytes of plane k from element g * E on, as words (byte e of the run: word e / 4, byte e % 4).
template <int E>
__device__ __forceinline__ void pc_load_run(const long long* __restrict__ pd, int k, long long g, pc_u32 (&w)[4]) {
  const long long p = pd[2 * k];
  if (!p) {
    const pc_u32 c = 0x01010101u * (pc_u32)(pd[2 * k + 1] & 0xFF);
    w[0] = w[1] = w[2] = w[3] = c;
    return;
  }
  const pc_u8* src = reinterpret_cast<const pc_u8*>(p) + g * E;
  w[0] = w[1] = w[2] = w[3] = 0u;
  if (E == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if (E == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  } else if (E == 4) {
    w[0] = *reinterpret_cast<const pc_u32*>(src);
  } else {
    w[0] = *reinterpret_cast<const pc_u16*>(src);
  }
}

template <int LAYOUT, int ITEM>
__global__ void __launch_bounds__(256) pc_merge(long long d0, long long d1, long long d2, long long d3, long long d4,
                                                long long d5, long long d6, long long d7, long long d8, long long d9,
                                                long long d10, long long d11, long long d12, long long d13,
                                                long long d14, long long d15, long long n, pc_u8* __restrict__ out) {
  constexpr int NP = LAYOUT == 0 ? 2 : LAYOUT == 1 ? 4 : ITEM;
  constexpr int E = 16 / ITEM;
  __shared__ long long pd[16];
  if (threadIdx.x == 0) {
    pd[0] = d0, pd[1] = d1, pd[2] = d2, pd[3] = d3, pd[4] = d4, pd[5] = d5, pd[6] = d6, pd[7] = d7;
    pd[8] = d8, pd[9] = d9, pd[10] = d10, pd[11] = d11, pd[12] = d12, pd[13] = d13, pd[14] = d14, pd[15] = d15;
  }
  __syncthreads();
  bool vec = (reinterpret_cast<unsigned long long>(out) & 15ull) == 0ull;
#pragma unroll
  for (int k = 0; k < NP; ++k) vec = vec && (pd[2 * k] % E) == 0;
  const long long nv = vec ? n / E : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long g = t0; g < nv; g += stride) {
    pc_u32 w[NP][4];
#pragma unroll
    for (int k = 0; k < NP; ++k) pc_load_run<E>(pd, k, g, w[k]);
    pc_u32 ow[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < E; ++e) {
#define PC_B(k) ((w[k][e >> 2] >> (8 * (e & 3))) & 0xFFu)
      if (LAYOUT == 0) {
        const pc_u32 x = PC_B(0), s = PC_B(1);
        ow[e >> 1] |= (((s & 0x80u) << 8) | (x << 7) | (s & 0x7Fu)) << (16 * (e & 1));
      } else if (LAYOUT == 1) {
        const pc_u32 x = PC_B(0), s = PC_B(1);
        ow[e] = ((s & 0x80u) << 24) | (x << 23) | ((s & 0x7Fu) << 16) | (PC_B(2) << 8) | PC_B(3);
      } else {
#pragma unroll
        for (int k = 0; k < NP; ++k) ow[(e * ITEM + k) >> 2] |= PC_B(k) << (8 * ((e * ITEM + k) & 3));
      }
#undef PC_B
    }
    *reinterpret_cast<uint4*>(out + 16 * g) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
  }
  for (long long i = nv * E + t0; i < n; i += stride) {
    if (LAYOUT == 0) {
      const pc_u32 e = pc_get<LAYOUT>(pd, 0, i), s = pc_get<LAYOUT>(pd, 1, i);
      reinterpret_cast<pc_u16*>(out)[i] = (pc_u16)(((s & 0x80u) << 8) | (e << 7) | (s & 0x7Fu));
    } else if (LAYOUT == 1) {
      const pc_u32 e = pc_get<LAYOUT>(pd, 0, i), s = pc_get<LAYOUT>(pd, 1, i);
      const pc_u32 b1 = pc_get<LAYOUT>(pd, 2, i), b0 = pc_get<LAYOUT>(pd, 3, i);
      reinterpret_cast<pc_u32*>(out)[i] = ((s & 0x80u) << 24) | (e << 23) | ((s & 0x7Fu) << 16) | (b1 << 8) | b0;
    } else {
      for (int k = 0; k < ITEM; ++k) out[i * ITEM + k] = (pc_u8)pc_get<LAYOUT>(pd, k, i);
    }
  }
}

// ---------------------------------------------------------------------------------------------- stream descriptors
// Inclusive scan of v over the block (blockDim.x a multiple of 32, at most 1024); *total = the block's sum.
// warp_sum: 32 shared words; the caller syncs before warp_sum is written again.
__device__ __forceinline__ long long pc_block_scan(long long v, long long* warp_sum, long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const long long o = __shfl_up_sync(PC_FULL, v, d);
    if (lane >= d) v += o;
  }
  if (lane == 31) warp_sum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < nwarps ? warp_sum[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long o = __shfl_up_sync(PC_FULL, w, d);
      if (lane >= d) w += o;
    }
    warp_sum[lane] = w;  // inclusive over the warps
  }
  __syncthreads();
  *total = warp_sum[nwarps - 1];
  return (warp ? warp_sum[warp - 1] : 0) + v;
}

// Format 3 keeps each coded plane's chunk stream lengths (uint32 words, one per chunk) in a section of the blob;
// this kernel turns them into the rANS decoder's payload rows (kvcodec/entropy/cuda/rans_decode.cu: byte offset in data,
// byte length, output byte offset, symbols) and checks them as the CPU decoder does: chunk c's stream is the
// words [sum of the lengths before it, + its length) of the plane's stream section. A length under LR_HEAD_WORDS,
// a stream reaching past the section, or a last stream not ending exactly at the section's end gets byte length
// 0, which the decoder reports as a bad length (status 1): the error arrives with the stream statuses, and no
// row ever points outside the section. One block per coded plane, a block-wide scan per 512 chunks.
// It also writes the plane's decode table (rans_decode.cu mode 0, byte symbols: slot s of symbol lo + i holds
// lane_rans.cuh's packed entry lr_entry(i, f, s - cum) = (i << 24) | ((f - 1) << 12) | (s - cum)), the words
// kvcodec.entropy.cuda.rans.build_table makes on the host, from the plane's frequencies (checked on the host:
// >= 1 where used, summing to slots): no table built or uploaded per decode. n_chunks 0: the table only
// (format 2: the rows come from the host).
// jobs [J, 6] int64: byte offset of plane j's lengths in data, of its stream section, the section's words, the
// byte offset of its decoded row in the output, the byte offset of its table in tables, its lowest used symbol;
// freqs [J, 256] int32; pdesc [J * n_chunks, 4] int64; tables: the launch's table bytes.
__global__ void __launch_bounds__(512) pc_stream_desc(const pc_u8* __restrict__ data, const long long* __restrict__ jobs,
                                                       long long n_chunks, long long chunk, long long n,
                                                       long long* __restrict__ pdesc, const int* __restrict__ freqs,
                                                       long long slots, pc_u8* __restrict__ tables) {
  __shared__ long long warp_sum[32];
  __shared__ int cum[257];
  const long long* jb = jobs + 6 * blockIdx.x;
  const pc_u8* lens = data + jb[0];  // 4-byte values at any byte alignment (read bytewise: a few KB)
  const long long soff = jb[1], words = jb[2], ooff = jb[3];
  long long carry = 0;  // words of the chunks of earlier rounds
  for (long long base = 0; base < n_chunks; base += blockDim.x) {
    const long long c = base + threadIdx.x;
    long long len = 0;
    if (c < n_chunks) {
      const pc_u8* q = lens + 4 * c;
      len = (long long)((pc_u32)q[0] | ((pc_u32)q[1] << 8) | ((pc_u32)q[2] << 16) | ((pc_u32)q[3] << 24));
    }
    long long round_total;
    const long long before = carry + pc_block_scan(len, warp_sum, &round_total) - len;
    if (c < n_chunks) {
      const bool ok = len >= LR_HEAD_WORDS && before + len <= words && (c != n_chunks - 1 || before + len == words);
      long long* pd = pdesc + 4 * ((long long)blockIdx.x * n_chunks + c);
      const long long a = c * chunk;
      pd[0] = soff + 2 * (ok ? before : 0);
      pd[1] = ok ? 2 * len : 0;
      pd[2] = ooff + a;
      pd[3] = n - a < chunk ? n - a : chunk;
    }
    carry += round_total;
    __syncthreads();  // warp_sum is rewritten by the next round
  }
  // the decode table: the frequencies' exclusive sums, then each slot finds its symbol (the last with cum <= s)
  const long long f = threadIdx.x < 256 ? freqs[256 * blockIdx.x + threadIdx.x] : 0;
  long long total;
  const long long incl = pc_block_scan(f, warp_sum, &total);
  if (threadIdx.x < 256) cum[threadIdx.x] = (int)(incl - f);
  if (threadIdx.x == 0) cum[256] = (int)slots;
  __syncthreads();
  pc_u32* tab = reinterpret_cast<pc_u32*>(tables + jb[4]);
  const int lo = (int)jb[5];
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    int a = 0, b = 256;  // cum[a] <= s < cum[b]
    while (b - a > 1) {
      const int mid = (a + b) >> 1;
      if (cum[mid] <= s) a = mid; else b = mid;
    }
    tab[s] = lr_entry((pc_u32)(a - lo), (pc_u32)(cum[a + 1] - cum[a]), (pc_u32)(s - cum[a]));
  }
}
