// zlib's CRC-32 of many device buffers (launcher and the math: kvcodec/device/crc32.py).
//
// R(c, M) is the CRC register after bytes M starting from register c (no pre/post inversion); it is
// affine: R(c, M) = S_|M|(c) ^ R(0, M), where S_n ("n zero bytes") is linear, and
// R(0, A || B) = S_|B|(R(0, A)) ^ R(0, B). zlib's crc32(M) = ~(S_|M|(~0) ^ R(0, M)). Zero bytes in
// front of M do not change R(0, M), so a buffer is read as 16-byte aligned pieces with the bytes
// before its start masked to zero, grouped right-aligned into blocks of CRC_BLOCK bytes.
//
// crc_blocks: one warp per block; lane k takes pieces k, k + 32, ... (coalesced 512-byte rows):
// R(0, piece) one 4-byte word at a time (c = S_4(c ^ w)), acc = S_512(acc) ^ R(0, piece), then a butterfly
// combines lanes (S_16g between halves of g lanes). S_4 and S_512 go by the register's 5-bit slices through
// 32-entry tables held one entry per lane and read with shuffles (crc32.lane_tables): no shared-memory
// bank conflicts (byte tables in shared memory: random banks) and no address arithmetic.
// crc_finish: one thread block per buffer combines its blocks the same way (Horner over a run of
// blocks per thread, then a shared-memory butterfly), adds the < 16 tail bytes and the inversion.
// Tables: the byte-at-a-time CRC table T[0][256] (of slicing-by-4 T[4][256]); shift tables SH[i][4][256] of
// S_{2^i} on each byte of the register (S(c) = SH[0][c & 255] ^ SH[1][(c >> 8) & 255] ^ ...).

typedef unsigned int cr_u32;
typedef unsigned char cr_u8;

#define CRC_ITERS 32
#define CRC_BLOCK (512 * CRC_ITERS)
#define CRC_BLOCK_LOG2 14
#define CRC_FINISH_THREADS 256
#define CRC_SLICES 7  // 5-bit slices of a register (the last one 2 bits)

__device__ __forceinline__ cr_u32 cr_shift(const cr_u32* __restrict__ sh, int log2n, cr_u32 c) {
  const cr_u32* t = sh + 1024 * log2n;
  return __ldg(t + (c & 255u)) ^ __ldg(t + 256 + ((c >> 8) & 255u)) ^ __ldg(t + 512 + ((c >> 16) & 255u)) ^
         __ldg(t + 768 + (c >> 24));
}

// A linear map of the register as the XOR of its 5-bit slices' images: lane v of tab[j] holds the image of
// v << 5j (crc32.lane_tables), the warp's shuffles read them (every lane takes part). A shuffle's source
// lane is the index's low 5 bits (PTX shfl.sync: b[4:0]), so the slice needs no mask.
__device__ __forceinline__ cr_u32 cr_lane_map(const cr_u32 (&tab)[CRC_SLICES], cr_u32 c) {
  cr_u32 r = 0u;
#pragma unroll
  for (int j = 0; j < CRC_SLICES; ++j) r ^= __shfl_sync(0xffffffffu, tab[j], (int)(c >> (5 * j)));
  return r;
}

// bufdesc [NBUF, 4] int64: address of the first byte, length, address where block 0 starts (16-byte
// aligned, may lie before the buffer: those bytes count as zero), blocks. block_buf [TB] int32:
// buffer of each global block; block_first [NBUF] int64 is bufdesc-derived on the host: first
// global block of each buffer. lanes: crc32.lane_tables (S_4, then S_512). out [TB] u32: R(0, block).
__global__ void __launch_bounds__(256) crc_blocks(const long long* __restrict__ bufdesc,
                                                  const int* __restrict__ block_buf,
                                                  const long long* __restrict__ block_first, long long total_blocks,
                                                  const cr_u32* __restrict__ lanes, const cr_u32* __restrict__ sh,
                                                  cr_u32* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const long long gb = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (gb >= total_blocks) return;  // warp-uniform
  cr_u32 s4[CRC_SLICES], s512[CRC_SLICES];
#pragma unroll
  for (int j = 0; j < CRC_SLICES; ++j) {
    s4[j] = __ldg(lanes + 32 * j + lane);
    s512[j] = __ldg(lanes + 32 * (CRC_SLICES + j) + lane);
  }
  const int q = block_buf[gb];
  const long long* bd = bufdesc + 4 * q;
  const long long p = bd[0], len = bd[1], vs = bd[2];
  const long long end = (p + len) & ~15ll;
  const long long start = vs + (gb - block_first[q]) * (long long)CRC_BLOCK;
  cr_u32 acc = 0u;
#pragma unroll 2  // two pieces' loads in flight
  for (int i = 0; i < CRC_ITERS; ++i) {
    const long long a = start + 16ll * (lane + 32 * i);
    cr_u32 w[4] = {0u, 0u, 0u, 0u};
    if (a + 16 > p && a < end) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(a));
      w[0] = v.x;
      w[1] = v.y;
      w[2] = v.z;
      w[3] = v.w;
      if (a < p) {  // the buffer starts inside this piece: bytes before it are zero
        const int low = (int)(p - a);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (4 * k + 4 <= low) w[k] = 0u;
          else if (4 * k < low) w[k] &= 0xffffffffu << (8 * (low - 4 * k));
        }
      }
    }
    cr_u32 c = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) c = cr_lane_map(s4, c ^ w[k]);
    acc = cr_lane_map(s512, acc) ^ c;  // S_512: the lane's previous piece is 512 bytes earlier
  }
#pragma unroll
  for (int g = 1; g < 32; g <<= 1) {
    const cr_u32 other = __shfl_down_sync(0xffffffffu, acc, g);
    if ((lane & (2 * g - 1)) == 0) acc = cr_shift(sh, 4 + __ffs(g) - 1, acc) ^ other;
  }
  if (lane == 0) out[gb] = acc;
}

// One thread block per buffer: crc[q] = zlib crc32 of buffer q. rblk: crc_blocks' output. check
// (null: crcs only) [NBUF, 4] int64: expected crc32 (-1: none), flag slot, 1 if every byte must be
// zero, unused; a buffer whose crc32 differs from the expected one, or with a nonzero byte where
// zeros are required, sets flags[slot] to 1 (flags hold zeros before).
__global__ void __launch_bounds__(CRC_FINISH_THREADS) crc_finish(const long long* __restrict__ bufdesc,
                                                                 const long long* __restrict__ block_first,
                                                                 const cr_u32* __restrict__ rblk,
                                                                 const cr_u32* __restrict__ tab,
                                                                 const cr_u32* __restrict__ sh,
                                                                 cr_u32* __restrict__ crc,
                                                                 const long long* __restrict__ check,
                                                                 int* __restrict__ flags) {
  __shared__ cr_u32 part[CRC_FINISH_THREADS];
  const int q = blockIdx.x, tid = threadIdx.x;
  const long long* bd = bufdesc + 4 * q;
  const long long p = bd[0], len = bd[1], nb = bd[3];
  const cr_u32* r = rblk + block_first[q];
  // per thread a run of mp blocks (a power of two), the runs right-aligned: virtual block v is real
  // block v - pad (zero before the buffer's first block)
  long long mp = 1;
  int mlog = 0;
  while (mp * CRC_FINISH_THREADS < nb) {
    mp <<= 1;
    ++mlog;
  }
  const long long pad = mp * CRC_FINISH_THREADS - nb;
  cr_u32 acc = 0u;
  for (long long v = tid * mp; v < (tid + 1) * mp; ++v) {
    const long long j = v - pad;
    acc = cr_shift(sh, CRC_BLOCK_LOG2, acc) ^ (j >= 0 ? r[j] : 0u);
  }
  part[tid] = acc;
  int nonzero = 0;  // the zero-bytes check (padding between sections: a few bytes)
  if (check != nullptr && check[4 * q + 2]) {
    const cr_u8* b = reinterpret_cast<const cr_u8*>(p);
    for (long long i = tid; i < len; i += CRC_FINISH_THREADS) nonzero |= b[i];
  }
  nonzero = __syncthreads_or(nonzero);
  for (int g = 1, lg = 0; g < CRC_FINISH_THREADS; g <<= 1, ++lg) {
    cr_u32 v = 0u;
    const bool head = (tid & (2 * g - 1)) == 0;
    if (head) v = cr_shift(sh, CRC_BLOCK_LOG2 + mlog + lg, part[tid]) ^ part[tid + g];
    __syncthreads();
    if (head) part[tid] = v;
    __syncthreads();
  }
  if (tid == 0) {
    cr_u32 c = nb ? part[0] : 0u;
    const long long end = (p + len) & ~15ll;
    const long long t0 = nb ? end : p;  // no blocks: the buffer lies in one 16-byte window
    const cr_u8* b = reinterpret_cast<const cr_u8*>(t0);
    for (long long i = 0; i < p + len - t0; ++i) c = __ldg(tab + ((c ^ b[i]) & 255u)) ^ (c >> 8);
    cr_u32 s = 0xffffffffu;
    for (int i = 0; i < 48; ++i)
      if ((len >> i) & 1) s = cr_shift(sh, i, s);
    const cr_u32 value = ~(s ^ c);
    crc[q] = value;
    if (check != nullptr) {
      const long long want = check[4 * q];
      if (nonzero || (want >= 0 && (long long)value != want)) atomicOr(flags + check[4 * q + 1], 1);
    }
  }
}
