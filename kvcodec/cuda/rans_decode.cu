// Batched GPU decoder for kvcodec's 32-state interleaved rANS payloads (launcher: rans.py).
//
// Format (the spec is kvcodec/entropy/rans.py): a payload is 32 uint32 states (state 0 first)
// then 16-bit words in the order the decoder reads them. Symbol i uses state i % 32, so one warp
// decodes a group of 32 symbols per step: lane k holds state k. In a group, the lanes whose state
// drops below L = 2^16 read consecutive words in lane order: ballot + popcount.
//
// One warp per payload; a block's warps all use one frequency table (the launcher groups payloads
// by table), which the block first copies into shared memory (modes 0 and 1) or reads from global
// memory through the read-only cache (mode 2). Table layouts (built by rans.build_table):
//   mode 0 (precision <= 12, <= 256 used symbols lo..lo+255): u32 e[M],
//          e = (sym - lo) << 24 | (freq - 1) << 12 | (slot - cum)          one lookup
//   mode 1 (M * sizeof(SymT) + 4 * span <= 48 KiB): SymT idx[M] (sym - lo), then at byte
//          offset aux u32 fc[span] = (freq - 1) << 16 | cum                   two dependent lookups
//   mode 2 (global memory): u32 e[M] = (freq - 1) << 16 | (slot - cum), then at byte offset aux
//          SymT sym[M]                                                        two independent loads
//
// Word reads: the warp keeps the payload's words in a register ring of 4 blocks of 64 words
// (lane k holds words 64b + 2k and 64b + 2k + 1 of block b as one u32); a step reads at most 32
// words at positions [rel, rel + 32) with rel < 64, so only the first two blocks are ever shuffled
// from and the loads of the other two (issued 2-3 blocks ahead) are in flight. Every load is
// bounds-checked against the payload's length: words past the end read as 0 and never touch
// memory, so a corrupt stream decodes garbage for exactly n symbols (no hang, no stray read) and is
// caught by the final check (all words consumed, every state back at L).
//
// Status per payload: 0 ok, 1 bad payload length, 2 initial state < L, 3 ran past the last word,
// 4 words left over or a state != L at the end.

typedef unsigned char rd_u8;
typedef unsigned short rd_u16;
typedef unsigned int rd_u32;

#define RD_L 65536u
#define RD_FULL 0xffffffffu
#define RD_OK 0
#define RD_ERR_LENGTH 1
#define RD_ERR_STATE 2
#define RD_ERR_SHORT 3
#define RD_ERR_END 4

// Two words (block blk, lane's pair) or what of them lies inside the payload (0 past its end). A
// payload at an address of 2 mod 4 (a chunk stream inside a planes section) reads 16-bit halves.
__device__ __forceinline__ rd_u32 rd_load_pair(const rd_u16* __restrict__ wp, long long nw, long long blk, int lane,
                                               bool odd) {
  const long long w = 64 * blk + 2 * lane;
  if (w + 2 <= nw) {
    if (!odd) return __ldg(reinterpret_cast<const rd_u32*>(wp) + (w >> 1));
    return (rd_u32)__ldg(wp + w) | ((rd_u32)__ldg(wp + w + 1) << 16);
  }
  if (w + 1 == nw) return (rd_u32)__ldg(wp + w);
  return 0u;
}

template <int MODE, typename SymT, bool TAIL>
__device__ __forceinline__ void rd_step(rd_u32& x, int& rel, long long& blk, rd_u32& r0, rd_u32& r1, rd_u32& r2,
                                        rd_u32& r3, const rd_u16* __restrict__ wp, long long nw, bool odd, int lane,
                                        rd_u32 below,
                                        bool active, rd_u32 mask, int prec, rd_u32 lo,
                                        const rd_u32* __restrict__ stab, const rd_u8* __restrict__ gtab, int aux,
                                        SymT* __restrict__ op) {
  const rd_u32 slot = x & mask;
  rd_u32 sym, f, bias;
  if (MODE == 0) {
    const rd_u32 e = stab[slot];
    sym = lo + (e >> 24);
    f = ((e >> 12) & 0xFFFu) + 1u;
    bias = e & 0xFFFu;
  } else if (MODE == 1) {
    const rd_u32 idx = reinterpret_cast<const SymT*>(stab)[slot];
    const rd_u32 e = stab[(aux >> 2) + idx];
    sym = lo + idx;
    f = (e >> 16) + 1u;
    bias = slot - (e & 0xFFFFu);
  } else {
    const rd_u32 e = __ldg(reinterpret_cast<const rd_u32*>(gtab) + slot);
    sym = __ldg(reinterpret_cast<const SymT*>(gtab + aux) + slot);
    f = (e >> 16) + 1u;
    bias = e & 0xFFFFu;
  }
  const rd_u32 xn = f * (x >> prec) + bias;  // < 2^32 for any x: bias < f <= M
  if (!TAIL || active) x = xn;
  const bool need = (!TAIL || active) && x < RD_L;
  const unsigned m = __ballot_sync(RD_FULL, need);
  const int cnt = __popc(m);
  const int w = rel + __popc(m & below);  // < 96: inside r0 (w < 64) or r1
  rd_u32 v = __shfl_sync(RD_FULL, r0, (w >> 1) & 31);
  if (rel + cnt > 64) {  // warp-uniform: r1 is needed (its load has had a block of time)
    const rd_u32 v1 = __shfl_sync(RD_FULL, r1, (w >> 1) & 31);
    v = w >= 64 ? v1 : v;
  }
  const rd_u32 word = (w & 1) ? (v >> 16) : (v & 0xFFFFu);
  if (need) x = (x << 16) | word;
  if (!TAIL || active) *op = (SymT)sym;
  rel += cnt;
  if (rel >= 64) {  // warp-uniform
    rel -= 64;
    r0 = r1;
    r1 = r2;
    r2 = r3;
    ++blk;
    r3 = rd_load_pair(wp, nw, blk + 3, lane, odd);
  }
}

template <int MODE, typename SymT>
__device__ __forceinline__ void rd_decode_warp(const rd_u8* __restrict__ data, const long long* __restrict__ pd,
                                               const rd_u32* __restrict__ stab, const rd_u8* __restrict__ gtab,
                                               int prec, rd_u32 lo, int aux, rd_u8* __restrict__ out,
                                               int* __restrict__ status_p) {
  const int lane = threadIdx.x & 31;
  const long long in_off = pd[0], in_len = pd[1], out_off = pd[2], n = pd[3];
  if (in_len < 128 || ((in_len - 128) & 1)) {
    if (lane == 0) *status_p = RD_ERR_LENGTH;
    return;
  }
  const rd_u8* base = data + in_off;  // 2-byte aligned (the launcher checks)
  const bool odd = (reinterpret_cast<unsigned long long>(base) & 3ull) != 0ull;
  const rd_u16* b16 = reinterpret_cast<const rd_u16*>(base);
  rd_u32 x = odd ? ((rd_u32)__ldg(b16 + 2 * lane) | ((rd_u32)__ldg(b16 + 2 * lane + 1) << 16))
                 : __ldg(reinterpret_cast<const rd_u32*>(base) + lane);
  if (__any_sync(RD_FULL, x < RD_L)) {
    if (lane == 0) *status_p = RD_ERR_STATE;
    return;
  }
  const long long nw = (in_len - 128) >> 1;
  const rd_u16* wp = b16 + 64;
  rd_u32 r0 = rd_load_pair(wp, nw, 0, lane, odd);
  rd_u32 r1 = rd_load_pair(wp, nw, 1, lane, odd);
  rd_u32 r2 = rd_load_pair(wp, nw, 2, lane, odd);
  rd_u32 r3 = rd_load_pair(wp, nw, 3, lane, odd);
  long long blk = 0;
  int rel = 0;
  const rd_u32 mask = (1u << prec) - 1u;
  const rd_u32 below = (1u << lane) - 1u;
  SymT* op = reinterpret_cast<SymT*>(out + out_off) + lane;
  const long long groups = n >> 5;
  for (long long g = 0; g < groups; ++g) {
    rd_step<MODE, SymT, false>(x, rel, blk, r0, r1, r2, r3, wp, nw, odd, lane, below, true, mask, prec, lo, stab,
                               gtab, aux, op);
    op += 32;
  }
  const int tail = (int)(n & 31);
  if (tail)
    rd_step<MODE, SymT, true>(x, rel, blk, r0, r1, r2, r3, wp, nw, odd, lane, below, lane < tail, mask, prec, lo,
                              stab, gtab, aux, op);
  const long long pos = 64 * blk + rel;
  const bool states_ok = __all_sync(RD_FULL, x == RD_L);
  if (lane == 0) *status_p = pos > nw ? RD_ERR_SHORT : (pos != nw || !states_ok) ? RD_ERR_END : RD_OK;
}

// data: payload bytes (each payload 2-byte aligned; 4-byte aligned ones load words in pairs); pdesc [P, 4] int64: byte offset in data, payload
// length, byte offset in out, symbol count; order [P]: payload ids grouped by table; blocks [B, 4]
// int32: table id, first index into order, payload count (<= WARPS), unused; tdesc [T, 8] int64:
// byte offset in tables (16-aligned), mode, precision, lo, u32 words to copy to shared memory,
// aux byte offset, symbol bytes (1 or 2), unused; status [P] int32.
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
rans32_decode(const rd_u8* __restrict__ data, const long long* __restrict__ pdesc, const int* __restrict__ order,
              const int* __restrict__ blocks, const long long* __restrict__ tdesc, const rd_u8* __restrict__ tables,
              rd_u8* __restrict__ out, int* __restrict__ status) {
  extern __shared__ rd_u32 rd_smem[];  // dynamic: the largest table of the launch
  const int* bk = blocks + 4 * blockIdx.x;
  const int t = bk[0], first = bk[1], count = bk[2];
  const long long* td = tdesc + 8 * t;
  const rd_u8* tab = tables + td[0];
  const int mode = (int)td[1], prec = (int)td[2];
  const rd_u32 lo = (rd_u32)td[3];
  const int nwords = (int)td[4], aux = (int)td[5], symbytes = (int)td[6];
  if (mode != 2) {  // block-uniform
    const rd_u32* src = reinterpret_cast<const rd_u32*>(tab);
    for (int j = threadIdx.x; j < nwords; j += 32 * WARPS) rd_smem[j] = __ldg(src + j);
    __syncthreads();
  }
  const int warp = threadIdx.x >> 5;
  if (warp >= count) return;
  const int p = order[first + warp];
  const long long* pd = pdesc + 4 * (long long)p;
  int* sp = status + p;
  if (symbytes == 1) {
    if (mode == 0) rd_decode_warp<0, rd_u8>(data, pd, rd_smem, tab, prec, lo, aux, out, sp);
    else if (mode == 1) rd_decode_warp<1, rd_u8>(data, pd, rd_smem, tab, prec, lo, aux, out, sp);
    else rd_decode_warp<2, rd_u8>(data, pd, rd_smem, tab, prec, lo, aux, out, sp);
  } else {
    if (mode == 0) rd_decode_warp<0, rd_u16>(data, pd, rd_smem, tab, prec, lo, aux, out, sp);
    else if (mode == 1) rd_decode_warp<1, rd_u16>(data, pd, rd_smem, tab, prec, lo, aux, out, sp);
    else rd_decode_warp<2, rd_u16>(data, pd, rd_smem, tab, prec, lo, aux, out, sp);
  }
}
