// Runs kvcodec/cuda/kvctx_encode.cu on the CPU: the kernel source compiled by g++ with the CUDA names it
// uses defined here (as kvctx_decode_emulator.cpp does for the decoder). Each warp is 32 std::threads; the
// warp collectives (__shfl*_sync, __ballot_sync, __any_sync, __match_any_sync, __syncwarp) exchange values
// through a barrier, so the lanes run the kernel's own code in lockstep at every collective. A block's
// warps run one after the other, so the kernels' per-warp shared memory is a static array here (KE_SHARED).
// Float64 arithmetic: compiled with -ffp-contract=off (no FMA), as the kernels' __dmul_rn / __dadd_rn.
// Used by tests/test_kvctx_encode_device.py to check the encoder on machines without a GPU.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define KE_SHARED static

struct KeDim { unsigned x; };
thread_local KeDim threadIdx, blockIdx, blockDim;

struct KeWarp {
  std::barrier<> bar{32};
  unsigned long long slot[32];
};
thread_local KeWarp* ke_warp;

template <class T> static inline T min(T a, T b) { return a < b ? a : b; }
template <class T> static inline T max(T a, T b) { return a > b ? a : b; }
using std::fabs;
using std::isfinite;

static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline long long __double_as_longlong(double x) { long long r; std::memcpy(&r, &x, 8); return r; }
static inline double __longlong_as_double(long long x) { double r; std::memcpy(&r, &x, 8); return r; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  return (unsigned)(((((unsigned long long)hi) << 32) | lo) >> (sh & 31));
}
template <class T> static inline T __ldg(const T* p) { return *p; }
// the cache-hinted loads the included decoder may use
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
static inline void __syncwarp() { ke_warp->bar.arrive_and_wait(); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }

// Every lane publishes v, then reads lane src(lane)'s value.
template <class T, class F> static T ke_exchange(T v, F src) {
  const unsigned lane = threadIdx.x & 31;
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  ke_warp->slot[lane] = b;
  ke_warp->bar.arrive_and_wait();
  b = ke_warp->slot[src(lane) & 31];
  ke_warp->bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &b, sizeof(T));
  return r;
}

template <class T> static T __shfl_sync(unsigned, T v, int src) {
  return ke_exchange(v, [src](unsigned) { return (unsigned)src; });
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int m) {
  return ke_exchange(v, [m](unsigned lane) { return lane ^ (unsigned)m; });
}
template <class T> static T __shfl_up_sync(unsigned, T v, int delta) {
  return ke_exchange(v, [delta](unsigned lane) { return lane >= (unsigned)delta ? lane - delta : lane; });
}

static unsigned ke_gather_mask(unsigned long long mine, bool (*same)(unsigned long long, unsigned long long)) {
  const unsigned lane = threadIdx.x & 31;
  ke_warp->slot[lane] = mine;
  ke_warp->bar.arrive_and_wait();
  unsigned m = 0;
  for (int j = 0; j < 32; ++j) m |= (unsigned)same(ke_warp->slot[j], mine) << j;
  ke_warp->bar.arrive_and_wait();
  return m;
}

static unsigned __ballot_sync(unsigned, bool p) {
  return ke_gather_mask(p ? 1 : 0, [](unsigned long long other, unsigned long long) { return other != 0; });
}
static bool __any_sync(unsigned mask, bool p) { return __ballot_sync(mask, p) != 0u; }
static unsigned __match_any_sync(unsigned, unsigned key) {
  return ke_gather_mask(key, [](unsigned long long other, unsigned long long mine) { return other == mine; });
}

double kx_smem[1];  // the decoder's dynamic shared memory (its kernel is included, not run)

#include "../../kvcodec/cuda/kvctx_encode.cu"

// grid x block threads, block after block, a block's warps one after the other (32 threads each).
template <class K>
static void run(int grid, int block, K kernel) {
  for (int b = 0; b < grid; ++b) {
    for (int w = 0; w < block / 32; ++w) {
      KeWarp warp;
      std::vector<std::thread> lanes;
      for (int lane = 0; lane < 32; ++lane) {
        lanes.emplace_back([&, lane] {
          threadIdx.x = (unsigned)(32 * w + lane);
          blockIdx.x = (unsigned)b;
          blockDim.x = (unsigned)block;
          ke_warp = &warp;
          kernel();
        });
      }
      for (auto& t : lanes) t.join();
    }
  }
}

typedef const void* P;
typedef long long LL;

extern "C" void ke_fit_moments_emu(int grid, int block, int w, P pats, P pred, P val, P lw, LL G, LL T, int D,
                                   LL tb, LL nblk, void* out) {
  auto k = [&] {
    if (w == 1) ke_fit_moments<1>(pats, (const float*)pred, (const double*)val, (const double*)lw, G, T, D, tb, nblk, (double*)out);
    else ke_fit_moments<2>(pats, (const float*)pred, (const double*)val, (const double*)lw, G, T, D, tb, nblk, (double*)out);
  };
  run(grid, block, k);
}

extern "C" void ke_fit_residuals_emu(int grid, int block, int w, P pats, P pred, P val, P m, P c, P a, int shared,
                                     LL G, LL T, int D, LL tb, LL nblk, void* out) {
  auto k = [&] {
    if (w == 1)
      ke_fit_residuals<1>(pats, (const float*)pred, (const double*)val, (const double*)m, (const double*)c,
                          (const double*)a, shared, G, T, D, tb, nblk, (double*)out);
    else
      ke_fit_residuals<2>(pats, (const float*)pred, (const double*)val, (const double*)m, (const double*)c,
                          (const double*)a, shared, G, T, D, tb, nblk, (double*)out);
  };
  run(grid, block, k);
}

extern "C" void ke_symbolise_emu(int grid, int block, int w, P pats, P pred, P pm, P pc, P pa, P pel, int shared,
                                 P escape,
                                 int width, int sign, int mb, int maxmag, int eoff, LL G, LL T, int D, LL tb, LL nblk,
                                 LL gb, LL unit, int n_keys, void* packed, void* hist, void* chunk_bits) {
  auto k = [&] {
    auto f = w == 1 ? ke_symbolise<1> : ke_symbolise<2>;
    f(pats, (const float*)pred, (const double*)pm, (const double*)pc, (const double*)pa, (const int*)pel, shared,
      (const kx_u8*)escape, width,
      sign, mb, maxmag, eoff, G, T, D, tb, nblk, gb, unit, n_keys, (kx_u64*)packed, (kx_u64*)hist, (kx_u64*)chunk_bits);
  };
  run(grid, block, k);
}

extern "C" void ke_encode_emu(int grid, int block, P packed, P chunks, int n, LL T, int D, P ftab, P rcp,
                              void* scratch, LL cap, void* lens, void* bits) {
  auto k = [&] {
    ke_encode<4>((const kx_u64*)packed, (const long long*)chunks, n, T, D, (const kx_u32*)ftab, (const kx_u32*)rcp,
                 (kx_u16*)scratch, cap, (long long*)lens, (kx_u32*)bits);
  };
  run(grid, block, k);
}
