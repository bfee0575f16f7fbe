// The 32-bit lane rANS of kvcodec's GPU kernels: its constants, table entries and coding steps, shared by every
// kernel that codes it (rans_decode.cu; kvcodec/lossless/cuda: planes_codec.cu, kvctx_decode.cu, kvctx_encode.cu,
// kvctx_plan.cu). The spec is kvcodec/entropy/rans.py; the 12-bit form with 256-symbol tables is
// kvcodec/entropy/rans_lanes.py. Its facts, first:
//   - state: 32 bits, kept in [LR_L, 2^32), LR_L = 2^16. Encoders start every lane at LR_L; a decoder checks
//     that every lane ends at LR_L and that it read exactly the stream's words.
//   - probabilities: M = 2^prec slots, prec <= 16; the lane tables use LR_PREC = 12 (LR_M = 4096 slots).
//   - renormalisation: at most one 16-bit word per symbol. Encode a symbol of frequency f, start cum: if
//     x >= f << (32 - prec), emit x & 0xFFFF and x >>= 16; then x = ((x / f) << prec) + x % f + cum.
//     Decode: slot = x & (M - 1) picks the symbol (cum <= slot < cum + f); x = f * (x >> prec) + slot - cum;
//     if x < LR_L, x = x << 16 | next word.
//   - lanes: symbol i of a stream uses lane i % 32, one warp (lane k owns state k). The encoder walks the
//     symbols backwards, the decoder forwards, so in a group of 32 symbols the lanes that move a word take
//     consecutive words in lane order: a ballot of those lanes, and lane k's word is the group's first plus
//     popcount(ballot & lanes below k) (lr_rank).
//   - stream: little-endian 16-bit words; first the 32 final encoder states (LR_HEAD_WORDS words: lane k's
//     state as words 2k, low half, and 2k + 1, high half; i.e. 32 uint32, state 0 first), then the
//     renormalisation words in the order the decoder reads them.
//   - decode table entry, one u32 per slot: packed (prec <= 12, symbols in a byte):
//     symbol << 24 | (f - 1) << 12 | (slot - cum); wide (prec <= 16, the symbol stored apart):
//     (f - 1) << 16 | low, low = slot - cum or cum. lr_entry_freq / lr_entry_low take the field width
//     (LR_PREC or LR_WIDE_BITS).
#pragma once

typedef unsigned short lr_u16;
typedef unsigned int lr_u32;

#define LR_L 65536u                      // state lower bound (rans.RANS_L)
#define LR_WORD_BITS 16                  // renormalisation word (rans.WORD_BITS)
#define LR_LANES 32                      // interleaved states: one warp (rans.MAX_STREAMS)
#define LR_PREC 12                       // probability bits of the lane tables (rans_lanes.PRECISION)
#define LR_M (1 << LR_PREC)              // slots of a lane table (rans_lanes.M)
#define LR_HEAD_WORDS (2 * LR_LANES)     // the stream's 16-bit words before its renormalisation words
#define LR_HEAD_BYTES (4 * LR_LANES)     // the same in bytes (kvcodec.entropy.cuda.rans.HEAD)
#define LR_ENTRY_SYM_SHIFT (2 * LR_PREC) // packed entry: the symbol's place
#define LR_WIDE_BITS 16                  // wide entry: width of its low field
#define LR_FULL 0xffffffffu              // every lane of the warp

// ---------------------------------------------------------------------------------------------- table entries
// The packed entry of a slot: symbol, its frequency (1 .. LR_M) and the slot's offset in the symbol's range.
__device__ __forceinline__ lr_u32 lr_entry(lr_u32 sym, lr_u32 freq, lr_u32 bias) {
  return sym << LR_ENTRY_SYM_SHIFT | (freq - 1u) << LR_PREC | bias;
}

// The packed entry's symbol.
__device__ __forceinline__ lr_u32 lr_entry_symbol(lr_u32 e) { return e >> LR_ENTRY_SYM_SHIFT; }

// An entry's frequency: f - 1 in the BITS bits above its low field of BITS bits (LR_PREC: packed entry,
// LR_WIDE_BITS: wide entry).
template <int BITS>
__device__ __forceinline__ lr_u32 lr_entry_freq(lr_u32 e) {
  return ((e >> BITS) & ((1u << BITS) - 1u)) + 1u;
}

// An entry's low field: slot - cum (packed; wide by slot) or cum (wide by symbol).
template <int BITS>
__device__ __forceinline__ lr_u32 lr_entry_low(lr_u32 e) {
  return e & ((1u << BITS) - 1u);
}

// ---------------------------------------------------------------------------------------------- lanes
// A lane's place among the lanes that move a word in its group: the words go in lane order. ``before``:
// the lanes whose symbols come before this lane's in the group ((1 << lane) - 1 when the group starts at lane 0).
__device__ __forceinline__ int lr_rank(lr_u32 ballot, lr_u32 before) { return __popc(ballot & before); }

// A state from its two stream words.
__device__ __forceinline__ lr_u32 lr_state(lr_u32 lo, lr_u32 hi) { return lo | (hi << LR_WORD_BITS); }

// ---------------------------------------------------------------------------------------------- decode
// A lane's decode step before renormalisation, for the symbol of frequency f at offset bias = slot - cum
// of its range: f * (x >> prec) + bias, < 2^32 for any x (bias < f <= 2^prec).
__device__ __forceinline__ lr_u32 lr_decode_advance(lr_u32 x, lr_u32 f, lr_u32 bias, int prec) {
  return f * (x >> prec) + bias;
}

// The same from the slot's packed entry e (prec <= LR_PREC).
__device__ __forceinline__ lr_u32 lr_decode_entry(lr_u32 x, lr_u32 e, int prec) {
  return lr_entry_freq<LR_PREC>(e) * (x >> prec) + lr_entry_low<LR_PREC>(e);
}

// Whether a state after lr_decode_advance takes the next word, and the state with it.
__device__ __forceinline__ bool lr_needs_word(lr_u32 x) { return x < LR_L; }
__device__ __forceinline__ lr_u32 lr_refill(lr_u32 x, lr_u32 word) { return (x << LR_WORD_BITS) | word; }

// ---------------------------------------------------------------------------------------------- encode
// floor(2^32 / f), 0xffffffff for f <= 1: lr_encode_put's divisor as a multiplier.
__device__ __forceinline__ lr_u32 lr_reciprocal(lr_u32 f) {
  return f >= 2u ? (lr_u32)(0x100000000ull / f) : 0xffffffffu;
}

// Whether state x emits a word before it codes a symbol of frequency f: x >= f << (32 - PREC), compared
// shifted down so that it holds in 32 bits for f = 2^PREC.
template <int PREC>
__device__ __forceinline__ bool lr_encode_needs_word(lr_u32 x, lr_u32 f) {
  return (x >> (32 - PREC)) >= f;
}

// The state after coding a symbol (frequency f >= 1, reciprocal rcp = lr_reciprocal(f), start cum):
// ((x / f) << PREC) + x % f + cum, the quotient from the high half of x * rcp (at most one short).
template <int PREC>
__device__ __forceinline__ lr_u32 lr_encode_put(lr_u32 x, lr_u32 f, lr_u32 rcp, lr_u32 cum) {
  lr_u32 q = __umulhi(x, rcp);
  lr_u32 r = x - q * f;
  if (r >= f) {
    ++q;
    r -= f;
  }
  return (q << PREC) + r + cum;
}

// One encoder step of a warp, each active lane one symbol of the group: the lanes that must emit write their
// low words in lane order just below wp (lr_rank) in wb, which fills from the end, and wp moves below them;
// then each active lane codes its symbol. A symbol of frequency 0 (the caller reports it) emits a word but
// codes nothing. ``below``: (1 << lane) - 1.
template <int PREC, typename I>
__device__ __forceinline__ void lr_encode_step(lr_u32& x, bool active, lr_u32 f, lr_u32 rcp, lr_u32 cum, lr_u32 below,
                                               lr_u16* __restrict__ wb, I& wp) {
  const bool need = active && lr_encode_needs_word<PREC>(x, f);
  const lr_u32 m = __ballot_sync(LR_FULL, need);
  const int cnt = __popc(m);
  if (need) {
    wb[wp - cnt + lr_rank(m, below)] = (lr_u16)(x & 0xFFFFu);
    x >>= LR_WORD_BITS;
  }
  wp -= cnt;
  if (active && f) x = lr_encode_put<PREC>(x, f, rcp, cum);
}

// The stream's head, written after the last step: the final states (lane k's as words 2k, 2k + 1) just
// below wp, which moves below them to the stream's first word.
template <typename I>
__device__ __forceinline__ void lr_encode_head(lr_u32 x, int lane, lr_u16* __restrict__ wb, I& wp) {
  wb[wp - LR_HEAD_WORDS + 2 * lane] = (lr_u16)(x & 0xFFFFu);
  wb[wp - LR_HEAD_WORDS + 2 * lane + 1] = (lr_u16)(x >> LR_WORD_BITS);
  wp -= LR_HEAD_WORDS;
}
