// Fused write of a step's new K and V rows into one layer of the token pool: one kernel instead of two
// indexed copies. One block per token copies its K row and its V row as 16-byte vectors.
#include "common.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) store_kv_kernel(const StoreKVArgs a) {
  const int64_t t = blockIdx.x;
  const int64_t slot = a.slots_int64 ? static_cast<const int64_t*>(a.slots)[t]
                                     : static_cast<int64_t>(static_cast<const int32_t*>(a.slots)[t]);
  if (slot < 0 || slot >= a.num_slots) asm volatile("trap;");  // an out-of-range slot would overwrite another tensor
  const uint4* k = reinterpret_cast<const uint4*>(static_cast<const char*>(a.k) + t * a.k_stride);
  const uint4* v = reinterpret_cast<const uint4*>(static_cast<const char*>(a.v) + t * a.v_stride);
  uint4* k_dst = reinterpret_cast<uint4*>(static_cast<char*>(a.k_pool) + slot * a.row_bytes);
  uint4* v_dst = reinterpret_cast<uint4*>(static_cast<char*>(a.v_pool) + slot * a.row_bytes);
  const int vectors = static_cast<int>(a.row_bytes / 16);
  for (int i = threadIdx.x; i < vectors; i += kThreads) {
    k_dst[i] = k[i];
    v_dst[i] = v[i];
  }
}

}  // namespace

int store_kv(const StoreKVArgs& a, cudaStream_t stream) {
  if (a.row_bytes % 16 != 0 || a.k_stride % 16 != 0 || a.v_stride % 16 != 0 || a.num_tokens > 0x7fffffff ||
      a.row_bytes / 16 > 0x7fffffff) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (a.num_tokens > 0) store_kv_kernel<<<static_cast<unsigned>(a.num_tokens), kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace astrai
