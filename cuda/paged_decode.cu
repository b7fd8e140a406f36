// Paged decode attention: one query token per request against its context in the flat token pool,
// addressed token by token through the page table (page size 1), with grouped-query attention.
//
// Grid (split, kv head × head chunk, request). A block reads each key/value row of its kv head once and
// scores it against GC query heads of the group at a time, so K/V traffic does not grow with the group
// size. Inside a block, threads form groups of kLanes that each hold one key: every thread loads 16 bytes
// of the row and the group sums the partial dot products with shuffles. Each group keeps a running
// softmax (max m, sum l, weighted V sum acc) in base 2 over the keys it visited; the block merges the
// groups through shared memory. Long contexts are cut into splits that run as separate blocks; each
// writes its normalised output and log-sum-exp, and merge_splits_kernel combines them.
#include "common.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;
constexpr int kUnroll = 2;  // keys each group loads before it computes, to keep more loads in flight

template <typename T, int D>
struct DecodeShape {
  static constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLanes = D / kVector < 32 ? D / kVector : 32;  // threads sharing one key row
  static constexpr int kElems = D / kLanes;                            // elements each of them holds
  static constexpr int kGroups = kThreads / kLanes;                    // keys in flight per block step
  static_assert(kLanes * kElems == D && kGroups * kLanes == kThreads, "head_dim must split evenly");
};

template <typename T, int D, int GC>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeArgs a) {
  using S = DecodeShape<T, D>;
  __shared__ float s_max[S::kGroups][GC];
  __shared__ float s_sum[S::kGroups][GC];
  __shared__ float s_acc[S::kGroups][GC][D];

  const int group_size = a.num_q_heads / a.num_kv_heads;
  const int chunks = (group_size + GC - 1) / GC;
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / chunks;
  const int first = (blockIdx.y % chunks) * GC;  // first query head of this block, within the group
  const int b = blockIdx.z;
  const int group = threadIdx.x / S::kLanes;
  const int e0 = (threadIdx.x % S::kLanes) * S::kElems;

  const int kv_len = a.table.kv_indptr[b + 1] - a.table.kv_indptr[b];
  const int begin = split * a.split_size;
  const int end = min(kv_len, begin + a.split_size);
  const int64_t base = table_base(a.table, b);
  const int64_t slot_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* k_rows = static_cast<const T*>(a.k_pool) + static_cast<int64_t>(kv_head) * D + e0;
  const T* v_rows = static_cast<const T*>(a.v_pool) + static_cast<int64_t>(kv_head) * D + e0;

  float q[GC][S::kElems];
  float m[GC], l[GC], acc[GC][S::kElems];
  const float q_scale = a.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GC; ++g) {
#pragma unroll
    for (int i = 0; i < S::kElems; ++i) q[g][i] = acc[g][i] = 0.f;
    if (first + g < group_size) {  // heads past the group's end stay zero and are never written
      const int64_t head = static_cast<int64_t>(b) * a.num_q_heads + kv_head * group_size + first + g;
      load_floats(static_cast<const T*>(a.q) + head * D + e0, q[g]);
#pragma unroll
      for (int i = 0; i < S::kElems; ++i) q[g][i] *= q_scale;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }

  // The loop bounds are the same for the whole block, so every lane reaches the shuffles.
  for (int t0 = begin; t0 < end; t0 += S::kGroups * kUnroll) {
    float k[kUnroll][S::kElems], v[kUnroll][S::kElems];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * S::kGroups + group;
      valid[u] = t < end;
      if (valid[u]) {
        const int64_t slot = slot_at(a.table, base + t);
        load_floats(k_rows + slot * slot_stride, k[u]);
        load_floats(v_rows + slot * slot_stride, v[u]);
      } else {
#pragma unroll
        for (int i = 0; i < S::kElems; ++i) k[u][i] = v[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float s[kUnroll];
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < S::kElems; ++i) dot += q[g][i] * k[u][i];
        dot = group_sum<S::kLanes>(dot);
        s[u] = valid[u] ? dot : -INFINITY;
        m_new = fmaxf(m_new, s[u]);
      }
      if (m_new == -INFINITY) continue;  // no key seen yet by this group
      const float alpha = exp2f(m[g] - m_new);
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < S::kElems; ++i) acc[g][i] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float p = exp2f(s[u] - m_new);
        l[g] += p;
#pragma unroll
        for (int i = 0; i < S::kElems; ++i) acc[g][i] += p * v[u][i];
      }
      m[g] = m_new;
    }
  }

#pragma unroll
  for (int g = 0; g < GC; ++g) {
    if (e0 == 0) {
      s_max[group][g] = m[g];
      s_sum[group][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < S::kElems; ++i) s_acc[group][g][e0 + i] = acc[g][i];
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < GC * D; idx += kThreads) {
    const int g = idx / D;
    const int e = idx % D;
    if (first + g >= group_size) continue;
    float max_all = -INFINITY;
    for (int j = 0; j < S::kGroups; ++j) max_all = fmaxf(max_all, s_max[j][g]);
    float sum = 0.f, o = 0.f;
    if (max_all != -INFINITY) {
      for (int j = 0; j < S::kGroups; ++j) {
        const float w = exp2f(s_max[j][g] - max_all);
        sum += w * s_sum[j][g];
        o += w * s_acc[j][g][e];
      }
    }
    const float value = sum > 0.f ? o / sum : 0.f;
    const int64_t row = static_cast<int64_t>(b) * a.num_q_heads + kv_head * group_size + first + g;
    if (a.num_splits == 1) {
      static_cast<T*>(a.out)[row * D + e] = from_float<T>(value);
    } else {
      const int64_t part = row * a.num_splits + split;
      a.partial_out[part * D + e] = value;
      if (e == 0) a.partial_lse[part] = sum > 0.f ? max_all + log2f(sum) : -INFINITY;
    }
  }
}

// out[b, h] = Σ_s 2^(lse_s − M) · o_s / Σ_s 2^(lse_s − M), M = max_s lse_s; zeros when no split saw a key.
template <typename T, int D>
__global__ void __launch_bounds__(D) merge_splits_kernel(const DecodeArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.y) * a.num_q_heads + blockIdx.x;
  const int e = threadIdx.x;
  const float* lse = a.partial_lse + row * a.num_splits;
  float max_all = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) max_all = fmaxf(max_all, lse[s]);
  float sum = 0.f, o = 0.f;
  if (max_all != -INFINITY) {
    for (int s = 0; s < a.num_splits; ++s) {
      const float w = exp2f(lse[s] - max_all);
      sum += w;
      o += w * a.partial_out[(row * a.num_splits + s) * D + e];
    }
  }
  static_cast<T*>(a.out)[row * D + e] = from_float<T>(sum > 0.f ? o / sum : 0.f);
}

template <typename T, int D, int GC>
int launch(const DecodeArgs& a, cudaStream_t stream) {
  const int group_size = a.num_q_heads / a.num_kv_heads;
  const dim3 grid(a.num_splits, a.num_kv_heads * ((group_size + GC - 1) / GC), a.batch);
  paged_decode_kernel<T, D, GC><<<grid, kThreads, 0, stream>>>(a);
  if (a.num_splits > 1) merge_splits_kernel<T, D><<<dim3(a.num_q_heads, a.batch), D, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// Query heads scored per block: the group size rounded up to a power of two, at most 8.
template <typename T, int D>
int launch_for_group(const DecodeArgs& a, cudaStream_t stream) {
  const int group_size = a.num_q_heads / a.num_kv_heads;
  if (group_size >= 5) return launch<T, D, 8>(a, stream);
  if (group_size >= 3) return launch<T, D, 4>(a, stream);
  if (group_size == 2) return launch<T, D, 2>(a, stream);
  return launch<T, D, 1>(a, stream);
}

template <typename T>
int launch_for_dim(const DecodeArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64:
      return launch_for_group<T, 64>(a, stream);
    case 128:
      return launch_for_group<T, 128>(a, stream);
    case 256:
      return launch_for_group<T, 256>(a, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int paged_decode(const DecodeArgs& a, cudaStream_t stream) {
  const bool shape_ok = a.batch >= 0 && a.batch <= 65535 && a.num_kv_heads > 0 &&
                        a.num_q_heads % a.num_kv_heads == 0 && a.num_splits >= 1 && a.split_size >= 1;
  if (!shape_ok || (a.num_splits > 1 && (a.partial_out == nullptr || a.partial_lse == nullptr))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (a.batch == 0 || a.num_q_heads == 0) return static_cast<int>(cudaSuccess);
  switch (a.dtype) {
    case DType::kFloat32:
      return launch_for_dim<float>(a, stream);
    case DType::kFloat16:
      return launch_for_dim<__half>(a, stream);
    case DType::kBFloat16:
      return launch_for_dim<__nv_bfloat16>(a, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace astrai
