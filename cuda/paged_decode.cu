// Paged decode attention: one query token per request against its context in the flat token pool,
// addressed token by token through the page table (page size 1), with grouped-query attention, an
// optional sliding window and optional soft-capped scores.
//
// Grid (split, kv head × head chunk, request). A block reads each key/value row of its kv head once and
// scores it against GC query heads of the group, so K/V traffic does not grow with the group size.
// Inside a block, threads form groups of kLanes that each hold one key: every thread loads 16-byte
// vectors of the row and the group sums the partial dot products with shuffles. K/V stay packed in
// registers (uint4) until used, so a group keeps kUnroll keys' loads in flight; the slots of the next
// keys are read while the current ones are scored, so the page-table lookup is off the critical path.
// Each group keeps a running softmax (max m, sum l, weighted V sum acc) in base 2; the block merges the
// groups through shared memory. Long contexts are cut into splits that run as separate blocks (the
// split count comes from the occupancy of this kernel, see paged_decode_blocks_per_sm); each writes its
// normalised output and log-sum-exp, and merge_splits_kernel combines them.
#include "common.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;

template <typename T, int D, int GC>
struct DecodeShape {
  static constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLanes = D / kVector < 32 ? D / kVector : 32;  // threads sharing one key row
  static constexpr int kElems = D / kLanes;                            // elements each of them holds
  static constexpr int kVecs = kElems / kVector;                       // 16-byte vectors each of them loads
  static constexpr int kGroups = kThreads / kLanes;                    // keys in flight per block step
  static constexpr int kUnroll = GC >= 8 || kVecs > 1 ? 2 : 4;        // keys per group per step
  static constexpr int kStep = kGroups * kUnroll;
  static_assert(kLanes * kElems == D && kGroups * kLanes == kThreads && kVecs * kVector == kElems,
                "head_dim must split evenly");
};

template <typename T, int N>
__device__ __forceinline__ void unpack(const uint4 (&raw)[N], float (&dst)[N * 16 / sizeof(T)]) {
  constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int c = 0; c < N; ++c) {
    const T* values = reinterpret_cast<const T*>(&raw[c]);
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) dst[c * kPerVector + i] = to_float(values[i]);
  }
}

// Slots of the kUnroll keys this group takes at step t0 (-1: past the span or outside the pool).
template <int U, int kGroups>
__device__ __forceinline__ void next_slots(const PageTable& table, int64_t base, int t0, int end, int group,
                                           int64_t (&slot)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = t0 + u * kGroups + group;
    slot[u] = t < end ? slot_at(table, base + t) : -1;
  }
}

template <typename T, int D, int GC>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeArgs a) {
  using S = DecodeShape<T, D, GC>;
  constexpr int U = S::kUnroll;
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

  const Context ctx = context_of(a.table, b);
  const int span_begin = a.window > 0 ? max(0, ctx.length - a.window) : 0;
  const int begin = span_begin + split * a.split_size;
  const int end = min(ctx.length, begin + a.split_size);
  const int64_t slot_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const uint4* k_rows = reinterpret_cast<const uint4*>(static_cast<const T*>(a.k_pool) + int64_t{kv_head} * D + e0);
  const uint4* v_rows = reinterpret_cast<const uint4*>(static_cast<const T*>(a.v_pool) + int64_t{kv_head} * D + e0);
  const int64_t row_vectors = slot_stride / S::kVector;  // 16-byte vectors from one slot to the next

  const bool capped = a.softcap > 0.f;
  const float q_scale = capped ? a.scale : a.scale * kLog2e;  // capped scores take log2(e) after tanh
  float q[GC][S::kElems];
  float m[GC], l[GC], acc[GC][S::kElems];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
#pragma unroll
    for (int i = 0; i < S::kElems; ++i) q[g][i] = acc[g][i] = 0.f;
    if (first + g < group_size) {  // heads past the group's end stay zero and are never written
      const int64_t head = int64_t{b} * a.num_q_heads + kv_head * group_size + first + g;
      load_floats(static_cast<const T*>(a.q) + head * D + e0, q[g]);
#pragma unroll
      for (int i = 0; i < S::kElems; ++i) q[g][i] *= q_scale;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }

  int64_t slot[U];
  next_slots<U, S::kGroups>(a.table, ctx.base, begin, end, group, slot);
  // The loop bounds are the same for the whole block, so every lane reaches the shuffles.
  for (int t0 = begin; t0 < end; t0 += S::kStep) {
    uint4 k_raw[U][S::kVecs], v_raw[U][S::kVecs];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      valid[u] = slot[u] >= 0;
      const int64_t at = (valid[u] ? slot[u] : 0) * row_vectors;
#pragma unroll
      for (int c = 0; c < S::kVecs; ++c) {
        k_raw[u][c] = valid[u] ? k_rows[at + c] : make_uint4(0, 0, 0, 0);
        v_raw[u][c] = valid[u] ? v_rows[at + c] : make_uint4(0, 0, 0, 0);
      }
    }
    next_slots<U, S::kGroups>(a.table, ctx.base, t0 + S::kStep, end, group, slot);

    float s[GC][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[S::kElems];
      unpack<T>(k_raw[u], k);
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < S::kElems; ++i) dot += q[g][i] * k[i];
        dot = group_sum<S::kLanes>(dot);
        if (capped) dot = a.softcap * tanhf(dot / a.softcap) * kLog2e;
        s[g][u] = valid[u] ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, s[g][u]);
      if (m_new == -INFINITY) continue;  // no key seen yet by this group
      const float alpha = exp2f(m[g] - m_new);
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < S::kElems; ++i) acc[g][i] *= alpha;
      m[g] = m_new;
#pragma unroll
      for (int u = 0; u < U; ++u) s[g][u] = exp2f(s[g][u] - m_new);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float v[S::kElems];
      unpack<T>(v_raw[u], v);
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        if (m[g] == -INFINITY) continue;
        l[g] += s[g][u];
#pragma unroll
        for (int i = 0; i < S::kElems; ++i) acc[g][i] += s[g][u] * v[i];
      }
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
    const int64_t row = int64_t{b} * a.num_q_heads + kv_head * group_size + first + g;
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
  const int64_t row = int64_t{blockIdx.y} * a.num_q_heads + blockIdx.x;
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

template <typename T, int D, int GC>
int occupancy() {
  int blocks = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, paged_decode_kernel<T, D, GC>,
                                                                        kThreads, 0);
  return err == cudaSuccess ? blocks : -static_cast<int>(err);
}

// Query heads scored per block: the group size rounded up to a power of two, at most 8.
template <typename T, int D>
int for_group(const DecodeArgs* a, int group_size, cudaStream_t stream) {
  if (group_size >= 5) return a ? launch<T, D, 8>(*a, stream) : occupancy<T, D, 8>();
  if (group_size >= 3) return a ? launch<T, D, 4>(*a, stream) : occupancy<T, D, 4>();
  if (group_size == 2) return a ? launch<T, D, 2>(*a, stream) : occupancy<T, D, 2>();
  return a ? launch<T, D, 1>(*a, stream) : occupancy<T, D, 1>();
}

// The launch (a non-null) or the occupancy query (a null) for the instantiation of (T, head_dim, group).
// An unsupported head_dim is an error here too: nothing is launched for it.
template <typename T>
int for_dim(const DecodeArgs* a, int head_dim, int group_size, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return for_group<T, 64>(a, group_size, stream);
    case 128:
      return for_group<T, 128>(a, group_size, stream);
    case 256:
      return for_group<T, 256>(a, group_size, stream);
    default:
      return a ? static_cast<int>(cudaErrorInvalidValue) : -static_cast<int>(cudaErrorInvalidValue);
  }
}

int for_dtype(const DecodeArgs* a, DType dtype, int head_dim, int group_size, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return for_dim<float>(a, head_dim, group_size, stream);
    case DType::kFloat16:
      return for_dim<__half>(a, head_dim, group_size, stream);
    case DType::kBFloat16:
      return for_dim<__nv_bfloat16>(a, head_dim, group_size, stream);
  }
  return a ? static_cast<int>(cudaErrorInvalidValue) : -static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int paged_decode(const DecodeArgs& a, cudaStream_t stream) {
  const bool shape_ok = a.batch >= 0 && a.batch <= 65535 && a.num_kv_heads > 0 &&
                        a.num_q_heads % a.num_kv_heads == 0 && a.num_splits >= 1 && a.split_size >= 1 &&
                        a.window >= 0 && a.softcap >= 0.f && a.table.num_slots >= 0 && a.table.width >= 0;
  if (!shape_ok || (a.num_splits > 1 && (a.partial_out == nullptr || a.partial_lse == nullptr))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (a.batch == 0 || a.num_q_heads == 0) return static_cast<int>(cudaSuccess);
  return for_dtype(&a, a.dtype, a.head_dim, a.num_q_heads / a.num_kv_heads, stream);
}

int paged_decode_blocks_per_sm(DType dtype, int head_dim, int group_size) {
  if (group_size < 1) return -static_cast<int>(cudaErrorInvalidValue);
  return for_dtype(nullptr, dtype, head_dim, group_size, nullptr);
}

}  // namespace astrai
