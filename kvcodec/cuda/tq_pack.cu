// TurboQuant-MSE quantize + pack (tq layout v1), one warp per row of D values.
//
// norm = ||x||; u = x / norm; y = H_D (s * u) / sqrt(D) (randomized Hadamard, Sylvester order,
// butterflies in registers and warp shuffles; ROUNDS = 2: y = H (s2 * H (s1 * u)) / D, the
// "hadamard2" rotation of kvcodec.quant); code_j = #{thresholds < y_j} (the codebook is sorted,
// so the nearest centroid is found by an unrolled binary search over the midpoints; exact ties go to
// the lower centroid, like argmin); codes are written as the little-endian bit stream of the layout
// and the norm as fp16/bf16. Lane l owns coordinates [l*E, (l+1)*E), E = D / 32.
#include "tq_common.cuh"

namespace tq {
template <int IN> TQ_DEVI float load_in(const void* __restrict__ p, long long i) {
  if constexpr (IN == 0) return __ldg(reinterpret_cast<const float*>(p) + i);
  else if constexpr (IN == 1) return tq_h2f(__ldg(reinterpret_cast<const tq_u16*>(p) + i));
  else return tq_bf2f(__ldg(reinterpret_cast<const tq_u16*>(p) + i));
}
// In-place y = H_D v (unnormalized Sylvester Hadamard) over a warp; lane l holds coords [l*E, (l+1)*E).
template <int E>
TQ_DEVI void fwht_warp(float (&v)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((e & h) == 0) {
        const float a = v[e], c = v[e + h];
        v[e] = a + c;
        v[e + h] = a - c;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, v[e], m);
      v[e] = upper ? other - v[e] : v[e] + other;
    }
  }
}
}  // namespace tq

// x: [N, D] (IN: 0 fp32, 1 fp16, 2 bf16), row stride `x_stride` elements; signs: [ROUNDS, D] fp32 (+-1);
// thresholds: [2^B - 1] fp32 ascending; codebook: [2^B] fp32; codes: [N, D*B/8] uint8;
// norms: [N] fp16 (NBF: bf16). NC (norm correction, kvcodec.quant's default): store ||x|| / <y, c>
// (c = the chosen centroids) when that dot product is positive, so <x, x_hat> = ||x||^2.
template <int D, int B, int IN, bool NBF, int ROUNDS, bool NC>
__global__ void __launch_bounds__(256) tq_quant_pack(
    const void* __restrict__ x, long long x_stride, const float* __restrict__ signs,
    const float* __restrict__ thresholds, const float* __restrict__ codebook, int N, tq_u8* __restrict__ codes,
    tq_u16* __restrict__ norms) {
  static_assert(D % 32 == 0 && D >= 32 && D <= 1024, "head_dim must be a multiple of 32");
  static_assert(B >= 1 && B <= 8, "bits in 1..8");
  constexpr int E = D / 32;
  constexpr int NTH = (1 << B) - 1;
  constexpr int ROW_WORDS = D * B / 32;
  constexpr int WARPS = 8;
  __shared__ float thr[NTH > 0 ? NTH : 1];
  __shared__ float cbs[1 << B];
  for (int i = threadIdx.x; i < (1 << B); i += blockDim.x) cbs[i] = codebook[i];
  __shared__ tq_u32 packed[WARPS][ROW_WORDS];
  for (int i = threadIdx.x; i < NTH; i += blockDim.x) thr[i] = thresholds[i];
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = blockIdx.x * WARPS + warp;
  if (row >= N) return;

  float v[E];
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    v[e] = tq::load_in<IN>(x, (long long)row * x_stride + lane * E + e);
    ss += v[e] * v[e];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float nrm = sqrtf(ss);
  const float inv = nrm > 0.f ? 1.f / nrm : 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = v[e] * inv * __ldg(signs + lane * E + e);

  tq::fwht_warp<E>(v, lane);
  float rs = rsqrtf((float)D);
  if constexpr (ROUNDS == 2) {
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = v[e] * rs * __ldg(signs + D + lane * E + e);
    tq::fwht_warp<E>(v, lane);
  }

  for (int i = lane; i < ROW_WORDS; i += 32) packed[warp][i] = 0u;
  __syncwarp();
  float dot = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float y = v[e] * rs;
    int idx = 0;
#pragma unroll
    for (int step = B - 1; step >= 0; --step) {
      const int probe = idx + (1 << step) - 1;
      if (y > thr[probe]) idx += 1 << step;
    }
    if constexpr (NC) dot += y * cbs[idx];
    const int bit = (lane * E + e) * B;
    const unsigned long long f = (unsigned long long)idx << (bit & 31);
    atomicOr(&packed[warp][bit >> 5], (tq_u32)f);
    if ((bit & 31) + B > 32) atomicOr(&packed[warp][(bit >> 5) + 1], (tq_u32)(f >> 32));
  }
  __syncwarp();
  tq_u32* out = reinterpret_cast<tq_u32*>(codes) + (long long)row * ROW_WORDS;
  for (int i = lane; i < ROW_WORDS; i += 32) out[i] = packed[warp][i];
  float stored = nrm;
  if constexpr (NC) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    stored = dot > 0.f ? nrm / dot : nrm;
  }
  if (lane == 0) norms[row] = tq_f_to_16<NBF>(stored);
}
