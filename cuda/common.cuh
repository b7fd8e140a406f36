// Device helpers shared by the kernels: element conversion, 16-byte vector loads, warp reductions, and
// the page-table lookup. Plain CUDA C++: no PyTorch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"

namespace astrai {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;  // softmax runs in base 2: exp(x) = exp2(x * log2(e))

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N consecutive elements at src as floats, read as 16-byte vectors (src 16-byte aligned).
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float (&dst)[N]) {
  constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));
  static_assert(N % kPerVector == 0, "load_floats reads whole 16-byte vectors");
  const uint4* vectors = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int c = 0; c < N / kPerVector; ++c) {
    const uint4 raw = vectors[c];
    const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) dst[c * kPerVector + i] = to_float(values[i]);
  }
}

// Sum and max over aligned groups of `Width` lanes (a power of two dividing 32); every lane of the warp
// must take part, and every lane of a group gets the group's result.
template <int Width>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

template <int Width>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// Request b's context as the kernels read it: where its slots start in the index array and how many
// there are, both kept inside the arrays the binding described (a row outside req_to_token is an empty
// context, a context longer than a table row or past the end of kv_indices is cut there).
struct Context {
  int64_t base;
  int length;
};

__device__ __forceinline__ Context context_of(const PageTable& t, int b) {
  const int64_t start = t.kv_indptr[b];
  int64_t length = static_cast<int64_t>(t.kv_indptr[b + 1]) - start;
  int64_t base = start, limit = t.width;
  if (t.rows != nullptr) {
    const int64_t row = t.rows[b];
    base = row * t.row_stride;
    if (row < 0 || row >= t.num_rows) length = 0;
  } else {
    limit = start < 0 ? 0 : t.width - start;
  }
  length = length < 0 ? 0 : (length > limit ? limit : length);
  return Context{base, static_cast<int>(length)};
}

// Slot of the token at index i of the index array, or -1 when it lies outside the pool (never read).
__device__ __forceinline__ int64_t slot_at(const PageTable& t, int64_t i) {
  const int64_t slot = t.indices_int64 ? static_cast<const int64_t*>(t.indices)[i]
                                       : static_cast<int64_t>(static_cast<const int32_t*>(t.indices)[i]);
  return slot >= 0 && slot < t.num_slots ? slot : -1;
}

}  // namespace astrai
