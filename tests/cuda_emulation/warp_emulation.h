// The CUDA names kvcodec's kvctx kernels use, defined for g++ so the kernel sources run on the CPU.
// Each warp is 32 std::threads; the warp collectives (__shfl*_sync, __ballot_sync, __any_sync,
// __match_any_sync, __syncwarp) exchange values through a barrier, so the lanes run the kernel's own code
// in lockstep at every collective. A block's warps run one after the other (emu_run). Float64
// arithmetic: compile with -ffp-contract=off (no FMA), as the kernels' __dmul_rn / __dadd_rn.
// Included by kvctx_decode_emulator.cpp, kvctx_encode_emulator.cpp, kvctx_locate_check.cpp and lane_rans_check.cpp.
#pragma once
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

struct EmuDim { unsigned x; };
thread_local EmuDim threadIdx, blockIdx, blockDim;

struct EmuWarp {
  std::barrier<> bar{32};
  unsigned long long slot[32];
};
thread_local EmuWarp* emu_warp;

template <class T> static inline T min(T a, T b) { return a < b ? a : b; }
template <class T> static inline T max(T a, T b) { return a > b ? a : b; }
using std::fabs;
using std::isfinite;

static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }  // one rounding
static inline long long __double_as_longlong(double x) { long long r; std::memcpy(&r, &x, 8); return r; }
static inline double __longlong_as_double(long long x) { double r; std::memcpy(&r, &x, 8); return r; }
static inline int __double2hiint(double x) { return (int)(__double_as_longlong(x) >> 32); }
static inline double __hiloint2double(int hi, int lo) {
  return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}
static inline float __int_as_float(int x) { float r; std::memcpy(&r, &x, 4); return r; }
static inline unsigned __brev(unsigned x) {  // bit reversal
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  return __builtin_bswap32(x);
}
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  return (unsigned)(((((unsigned long long)hi) << 32) | lo) >> (sh & 31));
}
// plain and cache-hinted loads
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
static inline void __syncwarp() { emu_warp->bar.arrive_and_wait(); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }

// Every lane publishes v, then reads lane src(lane)'s value.
template <class T, class F> static T emu_exchange(T v, F src) {
  const unsigned lane = threadIdx.x & 31;
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  emu_warp->slot[lane] = b;
  emu_warp->bar.arrive_and_wait();
  b = emu_warp->slot[src(lane) & 31];
  emu_warp->bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &b, sizeof(T));
  return r;
}

template <class T> static T __shfl_sync(unsigned, T v, int src) {
  return emu_exchange(v, [src](unsigned) { return (unsigned)src; });
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int m) {
  return emu_exchange(v, [m](unsigned lane) { return lane ^ (unsigned)m; });
}
template <class T> static T __shfl_up_sync(unsigned, T v, int delta) {
  return emu_exchange(v, [delta](unsigned lane) { return lane >= (unsigned)delta ? lane - delta : lane; });
}

// Every lane publishes mine; bit j of the result: same(lane j's value, mine).
static unsigned emu_gather_mask(unsigned long long mine, bool (*same)(unsigned long long, unsigned long long)) {
  const unsigned lane = threadIdx.x & 31;
  emu_warp->slot[lane] = mine;
  emu_warp->bar.arrive_and_wait();
  unsigned m = 0;
  for (int j = 0; j < 32; ++j) m |= (unsigned)same(emu_warp->slot[j], mine) << j;
  emu_warp->bar.arrive_and_wait();
  return m;
}

static unsigned __ballot_sync(unsigned, bool p) {
  return emu_gather_mask(p ? 1 : 0, [](unsigned long long other, unsigned long long) { return other != 0; });
}
static bool __any_sync(unsigned mask, bool p) { return __ballot_sync(mask, p) != 0u; }
static unsigned __match_any_sync(unsigned, unsigned key) {
  return emu_gather_mask(key, [](unsigned long long other, unsigned long long mine) { return other == mine; });
}

// grid x block threads, block after block, a block's warps one after the other (32 threads each).
template <class K>
static void emu_run(int grid, int block, K kernel) {
  for (int b = 0; b < grid; ++b) {
    for (int w = 0; w < block / 32; ++w) {
      EmuWarp warp;
      std::vector<std::thread> lanes;
      for (int lane = 0; lane < 32; ++lane) {
        lanes.emplace_back([&, lane] {
          threadIdx.x = (unsigned)(32 * w + lane);
          blockIdx.x = (unsigned)b;
          blockDim.x = (unsigned)block;
          emu_warp = &warp;
          kernel();
        });
      }
      for (auto& t : lanes) t.join();
    }
  }
}
