// Runs kvcodec/lossless/cuda/kvctx_encode.cu on the CPU: the kernel source compiled by g++ with the CUDA names it
// uses defined in warp_emulation.h (32 std::threads per warp, meeting at every warp collective). A block's
// warps run one after the other, so the kernels' per-warp shared memory is a static array here (KE_SHARED).
// Used by tests/test_kvctx_encode_device.py to check the encoder on machines without a GPU.
#include "warp_emulation.h"
#define KE_SHARED static
#define KE_HIST_IN_GLOBAL  // ke_symbolise's histogram without a block barrier (the warps run one after the other)

static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
double kx_smem[1];  // the decoder's dynamic shared memory (its kernel is included, not run)

#include "../../kvcodec/lossless/cuda/kvctx_encode.cu"

typedef const void* P;
typedef long long LL;

extern "C" void ke_fit_moments_emu(int grid, int block, int w, P pats, P pred, P val, P lw, LL G, LL T, int D,
                                   LL tb, LL nblk, void* out) {
  auto k = [&] {
    if (w == 1) ke_fit_moments<1>(pats, (const float*)pred, (const double*)val, (const double*)lw, G, T, D, tb, nblk, (double*)out);
    else ke_fit_moments<2>(pats, (const float*)pred, (const double*)val, (const double*)lw, G, T, D, tb, nblk, (double*)out);
  };
  emu_run(grid, block, k);
}

template <int W, int SETS>
static void fit_residuals(P pats, P pred, P val, P m0, P c0, P a0, int shared0, P m1, P c1, P a1, int shared1, LL G,
                          LL T, int D, LL tb, LL nblk, void* out) {
  ke_fit_residuals<W, SETS>(pats, (const float*)pred, (const double*)val, (const double*)m0, (const double*)c0,
                            (const double*)a0, shared0, (const double*)m1, (const double*)c1, (const double*)a1,
                            shared1, G, T, D, tb, nblk, (double*)out);
}

extern "C" void ke_fit_residuals_emu(int grid, int block, int w, int sets, P pats, P pred, P val, P m0, P c0, P a0,
                                     int shared0, P m1, P c1, P a1, int shared1, LL G, LL T, int D, LL tb, LL nblk,
                                     void* out) {
  auto f = w == 1 ? (sets == 1 ? fit_residuals<1, 1> : fit_residuals<1, 2>)
                  : (sets == 1 ? fit_residuals<2, 1> : fit_residuals<2, 2>);
  emu_run(grid, block, [&] { f(pats, pred, val, m0, c0, a0, shared0, m1, c1, a1, shared1, G, T, D, tb, nblk, out); });
}

extern "C" void ke_symbolise_emu(int grid, int block, int w, int mag, P pats, P pred, P pm, P pc, P pa, P pel,
                                 int shared, P escape, int width, int sign, int mb, int maxmag, int eoff, LL G, LL T,
                                 int D, LL tb, LL nblk, LL gb, LL unit, int n_keys, void* keys, void* raw, void* hist,
                                 void* chunk_bits) {
  auto k = [&] {
    auto f = w == 1 ? (mag ? ke_symbolise<1, true> : ke_symbolise<1, false>)
                    : (mag ? ke_symbolise<2, true> : ke_symbolise<2, false>);
    f(pats, (const float*)pred, (const double*)pm, (const double*)pc, (const double*)pa, (const int*)pel, shared,
      (const kx_u8*)escape, width, sign, mb, maxmag, eoff, G, T, D, tb, nblk, gb, unit, n_keys, (kx_u16*)keys,
      (kx_u64*)raw, (kx_u64*)hist, (kx_u64*)chunk_bits);
  };
  emu_run(grid, block, k);
}

extern "C" void ke_encode_emu(int grid, int block, P keys, P chunks, int n_chunks, P parts, int n_parts, P ftab,
                              P rcp, void* scratch, LL cap, void* lens) {
  emu_run(grid, block, [&] {
    ke_encode<4>((const kx_u16*)keys, (const long long*)chunks, n_chunks, (const long long*)parts, n_parts,
                 (const kx_u32*)ftab, (const kx_u32*)rcp, (kx_u16*)scratch, cap, (long long*)lens);
  });
}

extern "C" void ke_bits_emu(int grid, int block, P raw, P chunks, int n_chunks, P totals, P starts, void* bits,
                            void* n_bad) {
  emu_run(grid, block, [&] {
    ke_bits<4>((const kx_u64*)raw, (const long long*)chunks, n_chunks, (const long long*)totals,
               (const long long*)starts, (kx_u32*)bits, (long long*)n_bad);
  });
}

extern "C" void ke_fit_location_emu(int grid, int block, P mom, LL n, int gain, int prev_one, P consts, void* m,
                                    void* c, void* c_q, void* a, void* a_q) {
  emu_run(grid, block, [&] {
    ke_fit_location((const double*)mom, n, gain, prev_one, (const double*)consts, (double*)m, (double*)c,
                    (signed char*)c_q, (double*)a, (signed char*)a_q);
  });
}

extern "C" void ke_fit_coefficient_emu(int grid, int block, P res, LL n, P consts, void* a, void* a_q) {
  emu_run(grid, block,
          [&] { ke_fit_coefficient((const double*)res, n, (const double*)consts, (double*)a, (signed char*)a_q); });
}

extern "C" void ke_fit_scale_emu(int grid, int block, P mom, P res, LL n, P consts, void* s, void* bits) {
  emu_run(grid, block, [&] {
    ke_fit_scale((const double*)mom, (const double*)res, n, (const double*)consts, (double*)s, (double*)bits);
  });
}

extern "C" void ke_bin_params_emu(int grid, int block, P s, P m, P c_q, P a_q, P won, LL shared_row, LL n, int D,
                                  int eoff, P consts, void* pm, void* pc, void* pa, void* pel, void* values) {
  emu_run(grid, block, [&] {
    ke_bin_params((const double*)s, (const double*)m, (const signed char*)c_q, (const signed char*)a_q,
                  (const long long*)won, shared_row, n, D, eoff, (const double*)consts, (double*)pm, (double*)pc,
                  (double*)pa, (int*)pel, (int*)values);
  });
}

extern "C" void ke_plane_hist_emu(int grid, int block, P planes, int n_planes, LL n, int d, int per_plane, void* out) {
  emu_run(grid, block, [&] { ke_plane_hist((const kx_u8*)planes, n_planes, n, d, per_plane, (kx_u64*)out); });
}
