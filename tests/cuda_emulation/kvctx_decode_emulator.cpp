// Runs kvcodec/lossless/cuda/kvctx_decode.cu on the CPU: the kernel source compiled by g++ with the CUDA names it
// uses defined in warp_emulation.h (32 std::threads per warp, meeting at every warp collective). Used by
// tests/test_kvctx_device.py to check the kernel on machines without a GPU.
#include "warp_emulation.h"

double kx_smem[1 << 16];  // the dynamic shared memory of the one warp run at a time (rings, dev)

#include "../../kvcodec/lossless/cuda/kvctx_decode.cu"

#define KX_ARGS                                                                                             \
  const kx_u16 *words, const kx_u32 *bits, const long long *chunks, int n, const float *pred, long long pred_g0, \
      long long pred_t, const kx_u8 *raw, const long long *layout, int shared, const kx_u32 *tabs, int width,  \
      int sign, int mb, int maxmag, int eoff, int D, long long T, void *out, const kx_u16 *lo16,                \
      double *scratch, int *status
#define KX_PASS \
  words, bits, chunks, n, pred, pred_g0, pred_t, raw, layout, shared, tabs, width, sign, mb, maxmag, eoff, D, T, \
      out, lo16, scratch, status

// The launch: blocks of 4 warps, run one warp at a time.
template <int OUT, int NR, int LAYOUT, bool BF16, bool MAG>
static void run(KX_ARGS) {
  emu_run((n + 3) / 4, 128, [&] { kx_decode<OUT, 4, NR, LAYOUT, BF16, MAG>(KX_PASS); });
}

// The instance kvctx_decode.launch picks for rounds NR (kvctx_decode.variant: its layout from D, the bf16
// one for the bf16 grid; 8-bit outputs never bf16, float32 ones always).
template <int OUT, int NR, bool BF16, bool MAG>
static void pick_layout(KX_ARGS) {
  if (D == 32 * NR)
    run<OUT, NR, KX_REGS, BF16, MAG>(KX_PASS);
  else if (D % (32 * NR) == 0)
    run<OUT, NR, KX_ALIGNED, BF16, MAG>(KX_PASS);
  else
    run<OUT, NR, KX_GENERAL, BF16, MAG>(KX_PASS);
}

template <int OUT, int NR, bool MAG>
static void pick(KX_ARGS) {
  const bool bf16 = width == 16 && sign == 0x8000 && mb == 7 && maxmag == 0x7F7F && eoff == -133;
  if (OUT == 1)
    pick_layout<OUT, NR, false, MAG>(KX_PASS);
  else if (OUT == 4 || bf16)
    pick_layout<OUT, NR, true, MAG>(KX_PASS);
  else
    pick_layout<OUT, NR, false, MAG>(KX_PASS);
}

// kvctx_decode.launch's kernel call (WARPS = 4) with NR = nr and the stream's "mag" flag (flagged streams: 8- and
// 16-bit outputs, rounds 2); 1 when the shared memory it needs is too big or the instance is not built here.
extern "C" int kx_emulate(int out_kind, int nr, int mag, KX_ARGS) {
  if (!scratch && 4 * (5 * D + 272) > (int)(sizeof(kx_smem) / sizeof(double))) return 1;
  if (nr != 2 && nr != 4) return 1;
  if (mag) {
    if (nr != 2 || out_kind == 4) return 1;
    out_kind == 1 ? pick<1, 2, true>(KX_PASS) : pick<2, 2, true>(KX_PASS);
  } else if (out_kind == 1) {
    nr == 2 ? pick<1, 2, false>(KX_PASS) : pick<1, 4, false>(KX_PASS);
  } else if (out_kind == 2) {
    nr == 2 ? pick<2, 2, false>(KX_PASS) : pick<2, 4, false>(KX_PASS);
  } else {
    nr == 2 ? pick<4, 2, false>(KX_PASS) : pick<4, 4, false>(KX_PASS);
  }
  return 0;
}
