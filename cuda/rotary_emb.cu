// Fused rotary position embedding on q and k, in place, in the rotate-half layout the model uses
// (astrai_pl/model/layers.py: x·cos + rotate_half(x)·sin). One block per token rotates every head of q
// and k; each thread owns pairs (i, i + D/2). Arithmetic in float32, one rounding per element.
#include "common.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) rotary_emb_kernel(const RotaryArgs a) {
  const int64_t t = blockIdx.x;
  const int half = a.head_dim / 2;
  const int64_t row = a.positions != nullptr ? a.positions[t] : t;
  const C* cos = static_cast<const C*>(a.cos) + row * a.cos_stride;
  const C* sin = static_cast<const C*>(a.sin) + row * a.sin_stride;
  T* q = static_cast<T*>(a.q) + t * a.q_stride_token;
  T* k = static_cast<T*>(a.k) + t * a.k_stride_token;
  const int pairs = (a.num_q_heads + a.num_k_heads) * half;
  for (int idx = threadIdx.x; idx < pairs; idx += kThreads) {
    const int h = idx / half;
    const int i = idx % half;
    T* x = h < a.num_q_heads ? q + h * a.q_stride_head : k + (h - a.num_q_heads) * a.k_stride_head;
    const float x1 = to_float(x[i]);
    const float x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * to_float(cos[i]) - x2 * to_float(sin[i]));
    x[i + half] = from_float<T>(x2 * to_float(cos[i + half]) + x1 * to_float(sin[i + half]));
  }
}

template <typename T, typename C>
int launch(const RotaryArgs& a, cudaStream_t stream) {
  if (a.num_tokens > 0) rotary_emb_kernel<T, C><<<static_cast<unsigned>(a.num_tokens), kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_for(const RotaryArgs& a, cudaStream_t stream) {
  return a.table_dtype == DType::kFloat32 ? launch<T, float>(a, stream) : launch<T, T>(a, stream);
}

}  // namespace

int rotary_emb(const RotaryArgs& a, cudaStream_t stream) {
  if (a.head_dim % 2 != 0 || a.num_tokens > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  if (a.table_dtype != a.dtype && a.table_dtype != DType::kFloat32) return static_cast<int>(cudaErrorInvalidValue);
  switch (a.dtype) {
    case DType::kFloat32:
      return launch<float, float>(a, stream);
    case DType::kFloat16:
      return launch_for<__half>(a, stream);
    case DType::kBFloat16:
      return launch_for<__nv_bfloat16>(a, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace astrai
