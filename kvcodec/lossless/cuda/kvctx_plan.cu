// Device side of the kvctx / predictive format 2 GPU decode's plan (launcher: kvctx_plan.py): the rANS
// decode tables built from their frequencies, and the value checks of the stored parameter fields
// (decoded on the device by rans_decode.cu), so neither the tables (1.1 MB) nor the fields (megabytes)
// cross PCIe or wait for the host. What the host did before: predictive/tables.py decode_tables and
// predictive/format2.py check_field_values. One launch does both (kp_plan): a first decode's host time
// is counted in launches, not in device work.

#include "kvcodec/entropy/cuda/lane_rans.cuh"

typedef unsigned int kp_u32;
typedef unsigned char kp_u8;

#define KP_SYMS 256   // symbols per table, and threads per block (one each)
#define KP_ESC 255u   // bins.ESC

// tables.decode_tables of one class (one block of KP_SYMS threads): the packed entry (lane_rans.cuh)
// lr_entry(sym, freq, slot - cum) = sym << 24 | (freq - 1) << 12 | (slot - cum) for every slot of the class's
// table (LR_M slots); a class without frequencies decodes every slot as ESC.
// ``freq``: the class's 256 u16 frequencies, summing to 4096 or all 0 (checked by the host).
__device__ __forceinline__ void kp_table(const unsigned short* __restrict__ freq, kp_u32* __restrict__ row) {
  __shared__ kp_u32 cum[KP_SYMS];  // inclusive prefix sums of the row
  const int s = threadIdx.x;
  cum[s] = freq[s];
  __syncthreads();
  for (int off = 1; off < KP_SYMS; off <<= 1) {  // Hillis-Steele scan
    const kp_u32 v = s >= off ? cum[s - off] : 0u;
    __syncthreads();
    cum[s] += v;
    __syncthreads();
  }
  const bool used = cum[KP_SYMS - 1] != 0u;
  for (int slot = s; slot < LR_M; slot += KP_SYMS) {
    kp_u32 e = lr_entry(KP_ESC, LR_M, (kp_u32)slot);
    if (used) {
      int lo = 0, hi = KP_SYMS - 1;  // the first symbol whose inclusive sum exceeds the slot
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (cum[mid] > (kp_u32)slot) hi = mid;
        else lo = mid + 1;
      }
      const kp_u32 start = lo ? cum[lo - 1] : 0u;
      e = lr_entry((kp_u32)lo, cum[lo] - start, (kp_u32)slot - start);
    }
    row[slot] = e;
  }
}

// format2.check_field_values over ``n`` channels of the field byte planes ``raw``, channels first + k * step:
// *flag |= 1 when a stored level (low plane at lv_off, the high one n bytes later when lv_width == 2)
// exceeds lv_limit, or a 2-byte zigzag location (planes at mq_off) is 65535.
__device__ __forceinline__ void kp_check(const kp_u8* __restrict__ raw, long long n, long long first, long long step,
                                         long long lv_off, int lv_width, int lv_limit, long long mq_off, int mq_width,
                                         int* __restrict__ flag) {
  bool bad = false;
  for (long long i = first; i < n; i += step) {
    int lv = raw[lv_off + i];
    if (lv_width == 2) lv |= (int)raw[lv_off + n + i] << 8;
    bad |= lv > lv_limit;
    if (mq_width == 2) bad |= (raw[mq_off + i] & raw[mq_off + n + i]) == 0xFF;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

// The plan in one launch of blocks of KP_SYMS threads: blocks 0 .. classes - 1 build the decode tables
// ``tabs`` [classes, LR_M] of ``freq`` [classes, 256]; the others check the field bytes (kp_check, grid-stride
// over them; none when n = 0). The two parts share no data.
extern "C" __global__ void kp_plan(const unsigned short* __restrict__ freq, int classes, kp_u32* __restrict__ tabs,
                                   const kp_u8* __restrict__ raw, long long n, long long lv_off, int lv_width,
                                   int lv_limit, long long mq_off, int mq_width, int* __restrict__ flag) {
  const int c = blockIdx.x;
  if (c < classes) {
    kp_table(freq + (long long)c * KP_SYMS, tabs + (long long)c * LR_M);
    return;
  }
  const long long step = (long long)(gridDim.x - classes) * blockDim.x;
  kp_check(raw, n, (long long)(c - classes) * blockDim.x + threadIdx.x, step, lv_off, lv_width, lv_limit, mq_off,
           mq_width, flag);
}
