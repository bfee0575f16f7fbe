// Runs kvcodec/cuda/kvctx_decode.cu on the CPU: the kernel source compiled by g++ with the CUDA names it
// uses defined here. Each warp is 32 std::threads; the warp collectives (__shfl_sync, __ballot_sync,
// __any_sync, __syncwarp) exchange values through a barrier, so the lanes run the kernel's own code in
// lockstep at every collective. Float64 arithmetic: compiled with -ffp-contract=off (no FMA), as the
// kernel's __dmul_rn / __dadd_rn. Used by tests/test_kvctx_device.py to check the kernel on machines
// without a GPU.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct KxDim { unsigned x; };
thread_local KxDim threadIdx, blockIdx;

struct KxWarp {
  std::barrier<> bar{32};
  unsigned long long slot[32];
};
thread_local KxWarp* kx_warp;

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
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  return (unsigned)(((((unsigned long long)hi) << 32) | lo) >> (sh & 31));
}
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
static inline void __syncwarp() { kx_warp->bar.arrive_and_wait(); }

template <class T> static T __shfl_sync(unsigned, T v, int src) {
  const unsigned lane = threadIdx.x & 31;
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  kx_warp->slot[lane] = b;
  kx_warp->bar.arrive_and_wait();
  b = kx_warp->slot[src & 31];
  kx_warp->bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &b, sizeof(T));
  return r;
}

static unsigned __ballot_sync(unsigned, bool p) {
  const unsigned lane = threadIdx.x & 31;
  kx_warp->slot[lane] = p ? 1 : 0;
  kx_warp->bar.arrive_and_wait();
  unsigned m = 0;
  for (int j = 0; j < 32; ++j) m |= (unsigned)kx_warp->slot[j] << j;
  kx_warp->bar.arrive_and_wait();
  return m;
}

static bool __any_sync(unsigned mask, bool p) { return __ballot_sync(mask, p) != 0u; }

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

// The blocks one after the other, each block's warps one after the other (32 threads each).
template <int OUT, int NR>
static void run(KX_ARGS) {
  const int blocks = (n + 3) / 4;
  for (int b = 0; b < blocks; ++b) {
    for (int wi = 0; wi < 4; ++wi) {
      KxWarp warp;
      std::vector<std::thread> lanes;
      for (int lane = 0; lane < 32; ++lane) {
        lanes.emplace_back([&, lane] {
          threadIdx.x = (unsigned)(32 * wi + lane);
          blockIdx.x = (unsigned)b;
          kx_warp = &warp;
          kx_decode<OUT, 4, NR>(KX_PASS);
        });
      }
      for (auto& t : lanes) t.join();
    }
  }
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
