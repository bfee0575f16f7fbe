// Runs kvcodec/cuda/kvctx_decode.cu on the CPU: the kernel source compiled by g++ with the CUDA names it
// uses defined in warp_emulation.h (32 std::threads per warp, meeting at every warp collective). Used by
// tests/test_kvctx_device.py to check the kernel on machines without a GPU.
#include "warp_emulation.h"

double kx_smem[1 << 16];  // the dynamic shared memory of the one warp run at a time (rings, dev)

#include "../../kvcodec/cuda/kvctx_decode.cu"

#define KX_ARGS                                                                                             \
  const kx_u16 *words, const kx_u32 *bits, const long long *chunks, int n, const float *pred, long long pred_g0, \
      long long pred_t, const kx_u8 *raw, const long long *layout, int shared, const kx_u32 *tabs, int width,  \
      int sign, int mb, int maxmag, int eoff, int D, long long T, void *out, const kx_u16 *lo16,                \
      double *scratch, int *status
#define KX_PASS \
  words, bits, chunks, n, pred, pred_g0, pred_t, raw, layout, shared, tabs, width, sign, mb, maxmag, eoff, D, T, \
      out, lo16, scratch, status

// The launch: blocks of 4 warps, run one warp at a time.
template <int OUT, int NR>
static void run(KX_ARGS) {
  emu_run((n + 3) / 4, 128, [&] { kx_decode<OUT, 4, NR>(KX_PASS); });
}

// kvctx_decode.launch's kernel call (WARPS = 4) with NR = nr; 1 when the shared memory it needs is too big.
extern "C" int kx_emulate(int out_kind, int nr, KX_ARGS) {
  if (!scratch && 4 * (5 * D + 256) > (int)(sizeof(kx_smem) / sizeof(double))) return 1;
  if (nr != 2 && nr != 4) return 1;
  if (out_kind == 1)
    nr == 2 ? run<1, 2>(KX_PASS) : run<1, 4>(KX_PASS);
  else if (out_kind == 2)
    nr == 2 ? run<2, 2>(KX_PASS) : run<2, 4>(KX_PASS);
  else
    nr == 2 ? run<4, 2>(KX_PASS) : run<4, 4>(KX_PASS);
  return 0;
}
