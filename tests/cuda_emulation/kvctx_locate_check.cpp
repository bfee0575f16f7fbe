// kvctx_decode.cu's kx_locate_ep (the decoder's) and kx_locate (the encoder's) against bins.locate written out
// here line by line (float64, no FMA contraction: -ffp-contract=off) on many locations built near every boundary the bin coordinate has: binades around 2**(ep + mb) (eu against ep), low
// mantissa bits all ones / all zeros (quarter boundaries of the fraction, rounding of the steps sum), zeros,
// subnormals, both signs. Used by tests/test_kvctx_kernel.py.
#include "warp_emulation.h"

double kx_smem[1];

#include "../../kvcodec/lossless/cuda/kvctx_decode.cu"

static unsigned long long kx_rng = 88172645463325252ull;
static unsigned long long next_u64() {  // xorshift64
  kx_rng ^= kx_rng << 13;
  kx_rng ^= kx_rng >> 7;
  kx_rng ^= kx_rng << 17;
  return kx_rng;
}

// A location of binary exponent ex (-1074 .. 399) with a random or boundary-shaped mantissa and a random sign.
static double location(int ex) {
  unsigned long long m = next_u64() & ((1ull << 52) - 1);
  const int low = (int)(next_u64() % 60);  // low mantissa bits forced to ones or zeros (quarter / rounding edges)
  if (next_u64() & 1) m |= (1ull << low) - 1;
  else m &= ~((1ull << low) - 1);
  const unsigned long long near = next_u64() % 4;  // mantissas next to a power of two or a half binade
  switch (next_u64() % 16) {
    case 0: m = near; break;
    case 1: m = (1ull << 52) - 1 - near; break;
    case 2: m = (1ull << 51) + near; break;
    case 3: m = (1ull << 51) - 1 - near; break;
  }
  double v;
  if (ex < -1022) {
    v = __longlong_as_double((long long)(m >> (-1022 - ex)));  // subnormal
  } else {
    v = __longlong_as_double((long long)(((unsigned long long)(ex + 1023) << 52) | m));
  }
  if ((next_u64() % 64) == 0) v = 0.0;
  return (next_u64() & 1) ? -v : v;
}

// bins.locate, as the CPU computes it: (ep, centre, class); mag: the stream's "mag" flag.
static void cpu_locate(double mu_v, int es, int level, int mb, int mag, int& ep, int& centre, int& cls) {
  const long long bits = __double_as_longlong(mu_v);
  const int ex = (int)((bits >> 52) & 0x7FF) - 1023;
  ep = min(es, KX_EP_MAX);
  const double av = std::fabs(mu_v);
  const int eu = max(ex - mb, 0);
  double y = av * std::ldexp(1.0, -ep);
  if (eu > ep) y = (double)((long long)(eu - ep) * (1ll << mb)) + av * std::ldexp(1.0, -eu);
  const long long u = (long long)y;
  const long long neg = bits >> 63;
  centre = (int)(u ^ neg);
  double f = y - (double)u;
  if (neg & (mag - 1)) f = f + (1.0 - 2.0 * f);
  const int lvl = level - 4 * max(ep, eu);
  const int fine = min(lvl, 15) - 12;
  const int coarse = KX_N_FINE + (11 - max(lvl, KX_LVL_LO)) * KX_N_FRAC + min((int)(long long)(f * KX_N_FRAC), KX_N_FRAC - 1);
  cls = lvl >= 12 ? fine : coarse;
}

// n random cases for grid mantissa bits mb and "mag" flag mag; the number of cases where a kernel function's (ep,
// centre, class) differ.
extern "C" long long kx_locate_mismatches(long long n, int mb, unsigned long long seed, int mag) {
  kx_rng = seed | 1;
  long long bad = 0;
  for (long long i = 0; i < n; ++i) {
    const int es = (int)(next_u64() % 601);
    const int level = 4 * es + (int)(next_u64() % 24) - 8;  // fine and coarse classes (lvl from -8 + 4 (ep - e))
    int ex;
    const int pick = (int)(next_u64() % 4);
    if (pick == 0) ex = -1074 + (int)(next_u64() % (1074 + 400));
    else ex = es + mb - 24 + (int)(next_u64() % 48);  // around 2**(ep + mb)
    if (ex > 399) ex = 399;
    if (ex < -1074) ex = -1074;
    const double mv = location(ex);
    int ep, c0, k0, e1, c1, k1, c2, k2;
    cpu_locate(mv, es, level, mb, mag, ep, c0, k0);
    if (mag) {
      kx_locate<true>(mv, es, level, mb, e1, c1, k1);
      kx_locate_ep<true>(mv, ep, level, mb, c2, k2);
    } else {
      kx_locate<false>(mv, es, level, mb, e1, c1, k1);
      kx_locate_ep<false>(mv, ep, level, mb, c2, k2);
    }
    bad += e1 != ep || c0 != c1 || k0 != k1 || c0 != c2 || k0 != k2;
  }
  return bad;
}
