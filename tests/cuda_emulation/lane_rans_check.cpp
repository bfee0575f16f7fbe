// kvcodec/entropy/cuda/lane_rans.cuh on the CPU: a 32-lane encoder and decoder written with the header's
// constants and steps alone (one warp: 32 std::threads of warp_emulation.h), so that tests/test_lane_rans.py
// checks them against the Python reference (kvcodec/entropy/rans_lanes.py, rans.py) byte for byte.
#include "warp_emulation.h"

#include "kvcodec/entropy/cuda/lane_rans.cuh"

// The packed decode table of 256 frequencies summing to 2^prec (prec <= LR_PREC), slot by slot.
extern "C" void lr_check_table(const unsigned* freq, unsigned* tab) {
  unsigned cum = 0;
  for (unsigned s = 0; s < 256; ++s) {
    for (unsigned r = 0; r < freq[s]; ++r) tab[cum + r] = lr_entry(s, freq[s], r);
    cum += freq[s];
  }
}

// Encode n byte symbols (frequencies freq[256] summing to LR_M) into words[first, cap), filled from the end as
// the kernels do; returns first. A symbol of frequency 0 returns -1.
extern "C" long long lr_check_encode(const unsigned char* sym, long long n, const unsigned* freq,
                                     unsigned short* words, long long cap) {
  unsigned cum[256], rcp[256];
  for (unsigned s = 0, c = 0; s < 256; c += freq[s], ++s) {
    cum[s] = c;
    rcp[s] = lr_reciprocal(freq[s]);
  }
  long long first = 0;
  emu_run(1, 32, [&] {
    const int lane = threadIdx.x & 31;
    const lr_u32 below = (1u << lane) - 1u;
    lr_u32 x = LR_L;
    long long wp = cap;
    bool bad = false;
    for (long long g = (n + LR_LANES - 1) / LR_LANES - 1; g >= 0; --g) {
      const long long i = LR_LANES * g + lane;
      const bool active = i < n;
      const unsigned s = active ? sym[i] : 0u;
      const lr_u32 f = active ? freq[s] : 0u;
      bad |= active && f == 0u;
      lr_encode_step<LR_PREC>(x, active, f, rcp[s], cum[s], below, words, wp);
    }
    lr_encode_head(x, lane, words, wp);
    const bool any_bad = __any_sync(LR_FULL, bad);
    if (lane == 0) first = any_bad ? -1 : wp;
  });
  return first;
}

// Decode n symbols from the nw words of a stream with a decode table of 2^prec slots: packed entries (WIDE 0,
// byte symbols) or wide ones by slot with the symbols in sym (WIDE 1, 16-bit symbols). 0: good; 1: too short;
// 2: an initial state below LR_L; 3: the words or the final states do not match the symbols.
template <bool WIDE, typename SymT>
static int decode(const unsigned short* words, long long nw, const unsigned* tab, const SymT* sym, int prec,
                  SymT* out, long long n) {
  if (nw < LR_HEAD_WORDS) return 1;
  int status = 0;
  emu_run(1, 32, [&] {
    const int lane = threadIdx.x & 31;
    const lr_u32 below = (1u << lane) - 1u;
    lr_u32 x = lr_state(words[2 * lane], words[2 * lane + 1]);
    if (__any_sync(LR_FULL, x < LR_L)) {
      if (lane == 0) status = 2;
      return;
    }
    long long pos = LR_HEAD_WORDS;
    for (long long g = 0; g < (n + LR_LANES - 1) / LR_LANES; ++g) {
      const long long i = LR_LANES * g + lane;
      const bool active = i < n;
      const lr_u32 slot = x & ((1u << prec) - 1u);
      const lr_u32 e = tab[slot];
      const lr_u32 xn = WIDE ? lr_decode_advance(x, lr_entry_freq<LR_WIDE_BITS>(e), lr_entry_low<LR_WIDE_BITS>(e), prec)
                             : lr_decode_entry(x, e, prec);
      if (active) x = xn;
      const bool need = active && lr_needs_word(x);
      const unsigned m = __ballot_sync(LR_FULL, need);
      const long long at = pos + lr_rank(m, below);
      if (need) x = lr_refill(x, at < nw ? words[at] : 0u);
      pos += __popc(m);
      if (active) out[i] = (SymT)(WIDE ? sym[slot] : lr_entry_symbol(e));
    }
    const bool end_bad = __any_sync(LR_FULL, x != LR_L);
    if (lane == 0 && (end_bad || pos != nw)) status = 3;
  });
  return status;
}

extern "C" int lr_check_decode(const unsigned short* words, long long nw, const unsigned* tab, int prec,
                               unsigned char* out, long long n) {
  return decode<false, unsigned char>(words, nw, tab, nullptr, prec, out, n);
}

extern "C" int lr_check_decode_wide(const unsigned short* words, long long nw, const unsigned* tab,
                                    const unsigned short* sym, int prec, unsigned short* out, long long n) {
  return decode<true, unsigned short>(words, nw, tab, sym, prec, out, n);
}
