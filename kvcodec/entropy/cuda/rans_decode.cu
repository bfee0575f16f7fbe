// Batched GPU decoder for kvcodec's 32-state interleaved rANS payloads (launcher: rans.py).
//
// Format (the spec is kvcodec/entropy/rans.py; constants, entries and steps: lane_rans.cuh): a payload is
// 32 uint32 states (state 0 first) then 16-bit words in the order the decoder reads them. Symbol i uses
// state i % 32, so one warp decodes a group of 32 symbols per step: lane k holds state k. In a group, the
// lanes whose state drops below L = 2^16 read consecutive words in lane order: ballot + popcount.
//
// One warp per payload; a block's warps all use one frequency table (the launcher groups payloads
// by table), which the block first copies into shared memory (modes 0 and 1) or reads from global
// memory through the read-only cache (mode 2). Table layouts (built by rans.build_table; the entries are
// lane_rans.cuh's, packed or wide):
//   mode 0 (precision <= 12, <= 256 used symbols lo..lo+255): u32 e[M], packed:
//          e = (sym - lo) << 24 | (freq - 1) << 12 | (slot - cum)          one lookup
//   mode 1 (M * sizeof(SymT) + 4 * span <= rans.SMEM_MAX): SymT idx[M] (sym - lo), then at byte
//          offset aux u32 fc[span] = (freq - 1) << 16 | cum (wide)            two dependent lookups
//   mode 2 (global memory): u32 e[M] = (freq - 1) << 16 | (slot - cum) (wide), then at byte offset aux
//          SymT sym[M]                                                        two independent loads
//
// Word reads: each warp streams its payload's words through a shared-memory ring of RD_RING_SEGS
// segments of 256 words (512 bytes: one 16-byte load per lane). The ring mirrors memory from the
// 16-byte aligned address at or below word 0 (``skew`` words before it), so word w sits at ring index
// (skew + w) mod RD_RING_WORDS and a lane reads the word it needs with one shared load. When the
// read position enters segment c, the registers holding segment c + 2 (loaded when it entered c - 1,
// a whole segment of decoding earlier: the load has landed) are stored to the ring and segment
// c + 3 is loaded into them: the load latency hides behind 256 words of decoding whatever the
// entropy (the register ring this replaces stalled on a load issued 64 words earlier: high-entropy
// 1-byte streams such as fp8 decoded at ~60% of the speed of bf16 exponents per warp). Loads touch
// only 16-byte aligned pieces that overlap the payload (its first and last piece may hold up to 14
// bytes of what lies around it, in the same 16 bytes); the bytes past its end read as 0 (so a
// corrupt stream decodes garbage for exactly n symbols, never a stray read or a hang) and the
// final check catches it (all words consumed, every state back at L).
//
// Status per payload: 0 ok, 1 bad payload length, 2 initial state < L, 3 ran past the last word,
// 4 words left over or a state != L at the end.

#include "kvcodec/entropy/cuda/lane_rans.cuh"

typedef unsigned char rd_u8;
typedef unsigned short rd_u16;
typedef unsigned int rd_u32;
typedef unsigned long long rd_u64;

#define RD_FULL 0xffffffffu
#define RD_OK 0
#define RD_ERR_LENGTH 1
#define RD_ERR_STATE 2
#define RD_ERR_SHORT 3
#define RD_ERR_END 4
#define RD_SEG_WORDS 256
#define RD_RING_SEGS 4
#define RD_RING_WORDS (RD_SEG_WORDS * RD_RING_SEGS)  // per warp: 2 KiB of shared memory (rans.RING_BYTES)

// Lane's 16 bytes of segment s: the aligned piece a0 + 16 (32 s + lane) (a0: the 16-byte aligned
// address at or below word 0). Always one plain load, into registers nothing reads until the store
// (so no instruction waits on it): a piece at or past the payload's end (a0 + end) loads the piece
// before a0 instead (inside the payload's states), which rd_store_seg zeroes.
__device__ __forceinline__ uint4 rd_load_seg(const rd_u8* a0, rd_u64 end, long long s, int lane) {
  const long long idx = 32 * s + lane;
  return __ldg(reinterpret_cast<const uint4*>(a0) + ((rd_u64)(16 * idx) < end ? idx : -1ll));
}

// Store segment s's piece of this lane to the ring, its bytes at or past the payload's end zeroed
// (2-byte granularity): words past the end read as 0.
__device__ __forceinline__ void rd_store_seg(rd_u16* ring, rd_u64 end, long long s, int lane, uint4 v) {
  const rd_u64 r = 16ull * (rd_u64)(32 * s + lane);
  if (r + 16ull > end) {
    const int keep = r >= end ? 0 : (int)(end - r);  // bytes to keep, 0..14
    rd_u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (4 * k >= keep) w[k] = 0u;
      else if (4 * k + 4 > keep) w[k] &= 0xffffffffu >> (8 * (4 * k + 4 - keep));
    }
    v = make_uint4(w[0], w[1], w[2], w[3]);
  }
  reinterpret_cast<uint4*>(ring + RD_SEG_WORDS * (int)(s & (RD_RING_SEGS - 1)))[lane] = v;
}

template <int MODE, typename SymT, bool TAIL>
__device__ __forceinline__ void rd_step(rd_u32& x, int& inseg, long long& seg, uint4& pending, rd_u16* ring,
                                        const rd_u8* a0, rd_u64 end, int lane, rd_u32 below, bool active,
                                        rd_u32 mask, int prec, rd_u32 lo, const rd_u32* __restrict__ stab,
                                        const rd_u8* __restrict__ gtab, int aux, SymT* __restrict__ op) {
  const rd_u32 slot = x & mask;
  rd_u32 sym, f, bias;
  if (MODE == 0) {
    const rd_u32 e = stab[slot];
    sym = lo + lr_entry_symbol(e);
    f = lr_entry_freq<LR_PREC>(e);
    bias = lr_entry_low<LR_PREC>(e);
  } else if (MODE == 1) {
    const rd_u32 idx = reinterpret_cast<const SymT*>(stab)[slot];
    const rd_u32 e = stab[(aux >> 2) + idx];
    sym = lo + idx;
    f = lr_entry_freq<LR_WIDE_BITS>(e);
    bias = slot - lr_entry_low<LR_WIDE_BITS>(e);
  } else {
    const rd_u32 e = __ldg(reinterpret_cast<const rd_u32*>(gtab) + slot);
    sym = __ldg(reinterpret_cast<const SymT*>(gtab + aux) + slot);
    f = lr_entry_freq<LR_WIDE_BITS>(e);
    bias = lr_entry_low<LR_WIDE_BITS>(e);
  }
  const rd_u32 xn = lr_decode_advance(x, f, bias, prec);
  if (!TAIL || active) x = xn;
  const bool need = (!TAIL || active) && lr_needs_word(x);
  const unsigned m = __ballot_sync(RD_FULL, need);
  // ring index of this lane's word: segment seg's slot, offset inseg + the needing lanes below
  const int r = ((((int)seg & (RD_RING_SEGS - 1)) * RD_SEG_WORDS) + inseg + lr_rank(m, below)) & (RD_RING_WORDS - 1);
  // every lane reads a word and `need` selects: no divergent branch around the shared load (volatile keeps
  // the compiler from sinking the load into one; H200: fp8 kernel 0.378 -> 0.307 ms, bf16 0.265 -> 0.249)
  const rd_u32 word = *reinterpret_cast<volatile const rd_u16*>(ring + r);
  x = need ? lr_refill(x, word) : x;
  if (!TAIL || active) *op = (SymT)sym;
  inseg += __popc(m);
  if (inseg >= RD_SEG_WORDS) {  // warp-uniform: entered segment seg + 1
    inseg -= RD_SEG_WORDS;
    ++seg;
    __syncwarp();  // every lane's reads of the slot about to be overwritten are done
    rd_store_seg(ring, end, seg + 2, lane, pending);
    pending = rd_load_seg(a0, end, seg + 3, lane);
    __syncwarp();  // the stored segment is visible to the whole warp
  }
}

template <int MODE, typename SymT>
__device__ __forceinline__ void rd_decode_warp(const rd_u8* __restrict__ data, const long long* __restrict__ pd,
                                               const rd_u32* __restrict__ stab, const rd_u8* __restrict__ gtab,
                                               int prec, rd_u32 lo, int aux, rd_u8* __restrict__ out,
                                               int* __restrict__ status_p, rd_u16* ring) {
  const int lane = threadIdx.x & 31;
  const long long in_off = pd[0], in_len = pd[1], out_off = pd[2], n = pd[3];
  if (in_len < LR_HEAD_BYTES || ((in_len - LR_HEAD_BYTES) & 1)) {
    if (lane == 0) *status_p = RD_ERR_LENGTH;
    return;
  }
  const rd_u8* base = data + in_off;  // 2-byte aligned (the launcher checks)
  const rd_u16* b16 = reinterpret_cast<const rd_u16*>(base);
  const bool odd = (reinterpret_cast<rd_u64>(base) & 3ull) != 0ull;
  rd_u32 x = odd ? lr_state(__ldg(b16 + 2 * lane), __ldg(b16 + 2 * lane + 1))
                 : __ldg(reinterpret_cast<const rd_u32*>(base) + lane);
  if (__any_sync(RD_FULL, x < LR_L)) {
    if (lane == 0) *status_p = RD_ERR_STATE;
    return;
  }
  const long long nw = (in_len - LR_HEAD_BYTES) >> 1;
  const int lead = (int)((reinterpret_cast<rd_u64>(base) + (rd_u64)LR_HEAD_BYTES) & 15ull);  // word 0's bytes past a0
  const rd_u8* a0 = base + LR_HEAD_BYTES - lead;
  const rd_u64 end = (rd_u64)lead + 2ull * (rd_u64)nw;  // the payload's end, from a0
  const int skew = lead >> 1;  // ring index of word 0
  const uint4 s0 = rd_load_seg(a0, end, 0, lane), s1 = rd_load_seg(a0, end, 1, lane);
  const uint4 s2 = rd_load_seg(a0, end, 2, lane);
  uint4 pending = rd_load_seg(a0, end, 3, lane);
  rd_store_seg(ring, end, 0, lane, s0);
  rd_store_seg(ring, end, 1, lane, s1);
  rd_store_seg(ring, end, 2, lane, s2);
  __syncwarp();
  long long seg = 0;
  int inseg = skew;
  const rd_u32 mask = (1u << prec) - 1u;
  const rd_u32 below = (1u << lane) - 1u;
  SymT* op = reinterpret_cast<SymT*>(out + out_off) + lane;
  const long long groups = n >> 5;
  for (long long g = 0; g < groups; ++g) {
    rd_step<MODE, SymT, false>(x, inseg, seg, pending, ring, a0, end, lane, below, true, mask, prec, lo, stab,
                               gtab, aux, op);
    op += 32;
  }
  const int tail = (int)(n & 31);
  if (tail)
    rd_step<MODE, SymT, true>(x, inseg, seg, pending, ring, a0, end, lane, below, lane < tail, mask, prec, lo,
                              stab, gtab, aux, op);
  const long long pos = (long long)RD_SEG_WORDS * seg + inseg - skew;  // words consumed
  const bool states_ok = __all_sync(RD_FULL, x == LR_L);
  if (lane == 0) *status_p = pos > nw ? RD_ERR_SHORT : (pos != nw || !states_ok) ? RD_ERR_END : RD_OK;
}

// data: payload bytes (each payload 2-byte aligned); pdesc [P, 4] int64: byte offset in data, payload
// length, byte offset in out, symbol count; order [P]: payload ids grouped by table; blocks [B, 4]
// int32: table id, first index into order, payload count (<= WARPS), unused; tdesc [T, 8] int64:
// byte offset in tables (16-aligned), mode, precision, lo, u32 words to copy to shared memory,
// aux byte offset, symbol bytes (1 or 2), unused; status [P] int32. Dynamic shared memory: the
// warps' word rings (WARPS * RD_RING_WORDS u16), then the largest table of the launch.
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 1024 / (32 * WARPS))  // <= 64 registers: no spills on sm_100
rans32_decode(const rd_u8* __restrict__ data, const long long* __restrict__ pdesc, const int* __restrict__ order,
              const int* __restrict__ blocks, const long long* __restrict__ tdesc, const rd_u8* __restrict__ tables,
              rd_u8* __restrict__ out, int* __restrict__ status) {
  extern __shared__ uint4 rd_smem_v[];  // 16-byte aligned
  rd_u16* rings = reinterpret_cast<rd_u16*>(rd_smem_v);
  rd_u32* stab = reinterpret_cast<rd_u32*>(rings + WARPS * RD_RING_WORDS);
  const int* bk = blocks + 4 * blockIdx.x;
  const int t = bk[0], first = bk[1], count = bk[2];
  const long long* td = tdesc + 8 * t;
  const rd_u8* tab = tables + td[0];
  const int mode = (int)td[1], prec = (int)td[2];
  const rd_u32 lo = (rd_u32)td[3];
  const int nwords = (int)td[4], aux = (int)td[5], symbytes = (int)td[6];
  if (mode != 2) {  // block-uniform
    const rd_u32* src = reinterpret_cast<const rd_u32*>(tab);
    for (int j = threadIdx.x; j < nwords; j += 32 * WARPS) stab[j] = __ldg(src + j);
    __syncthreads();
  }
  const int warp = threadIdx.x >> 5;
  if (warp >= count) return;
  const int p = order[first + warp];
  const long long* pd = pdesc + 4 * (long long)p;
  int* sp = status + p;
  rd_u16* ring = rings + warp * RD_RING_WORDS;
  if (symbytes == 1) {
    if (mode == 0) rd_decode_warp<0, rd_u8>(data, pd, stab, tab, prec, lo, aux, out, sp, ring);
    else if (mode == 1) rd_decode_warp<1, rd_u8>(data, pd, stab, tab, prec, lo, aux, out, sp, ring);
    else rd_decode_warp<2, rd_u8>(data, pd, stab, tab, prec, lo, aux, out, sp, ring);
  } else {
    if (mode == 0) rd_decode_warp<0, rd_u16>(data, pd, stab, tab, prec, lo, aux, out, sp, ring);
    else if (mode == 1) rd_decode_warp<1, rd_u16>(data, pd, stab, tab, prec, lo, aux, out, sp, ring);
    else rd_decode_warp<2, rd_u16>(data, pd, stab, tab, prec, lo, aux, out, sp, ring);
  }
}
