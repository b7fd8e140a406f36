// Paged prefill attention over a ragged batch: request b's queries are rows qo_indptr[b] .. qo_indptr[b+1]-1
// of q, the last q_len positions of a kv_len-token context read from the flat pool through the page table.
// Causal with the query block at the end of the context; grouped-query attention.
//
// Grid (query tile, query head, request); a block of kWarps warps takes kBlockQ = kWarps × kRows queries
// of one head. Key/value rows go through shared memory kBlockK at a time (K transposed, so that lane j
// reads key j without bank conflicts); lane j scores key j against the warp's kRows queries, the warp
// keeps one running softmax (base 2) per query, and lane j accumulates output elements j, j+32, ….
// Arithmetic is float32 on CUDA cores.
#include "common.cuh"

namespace astrai {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 8;                   // queries per warp
constexpr int kBlockQ = kWarps * kRows;    // queries per block
constexpr int kBlockK = 32;                // keys per shared-memory tile, one per lane
constexpr int kKtStride = kBlockK + 1;     // padded row of the transposed K tile

template <int D>
constexpr int shared_floats() {
  return kBlockQ * D + D * kKtStride + kBlockK * D;  // Q tile, Kᵀ tile, V tile
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) paged_prefill_kernel(const PrefillArgs a) {
  constexpr int kCols = D / 32;  // output elements per lane
  extern __shared__ float4 shared_raw[];
  float* s_q = reinterpret_cast<float*>(shared_raw);  // [kBlockQ][D], scaled by scale·log2(e)
  float* s_kt = s_q + kBlockQ * D;                     // [D][kKtStride]
  float* s_v = s_kt + D * kKtStride;                   // [kBlockK][D]
  __shared__ int64_t s_slot[kBlockK];

  const int b = blockIdx.z;
  const int head = blockIdx.y;
  const int q_begin = a.qo_indptr[b];
  const int q_len = a.qo_indptr[b + 1] - q_begin;
  const int i0 = blockIdx.x * kBlockQ;  // first query of this tile, counted within the request
  if (i0 >= q_len) return;              // the whole block leaves together
  const int rows_here = min(kBlockQ, q_len - i0);
  const int kv_len = a.table.kv_indptr[b + 1] - a.table.kv_indptr[b];
  const int offset = kv_len - q_len;  // context position of the request's first query
  const int kv_end = a.causal ? max(0, min(kv_len, offset + i0 + rows_here)) : kv_len;
  const int kv_head = head / (a.num_q_heads / a.num_kv_heads);
  const int64_t base = table_base(a.table, b);
  const int64_t slot_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* k_rows = static_cast<const T*>(a.k_pool) + static_cast<int64_t>(kv_head) * D;
  const T* v_rows = static_cast<const T*>(a.v_pool) + static_cast<int64_t>(kv_head) * D;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // Tiles move as 16-byte pieces, every thread's pieces loaded before any is stored (loads in flight).
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPiecesPerRow = D / kVec;
  static_assert((kBlockQ * kPiecesPerRow) % kThreads == 0 && (kBlockK * kPiecesPerRow) % kThreads == 0,
                "tiles must split evenly over the threads");
  const float q_scale = a.scale * kLog2e;
  const T* q = static_cast<const T*>(a.q);
#pragma unroll
  for (int it = 0; it < kBlockQ * kPiecesPerRow / kThreads; ++it) {
    const int piece = threadIdx.x + it * kThreads;
    const int r = piece / kPiecesPerRow;
    const int e = (piece % kPiecesPerRow) * kVec;
    float values[kVec];
    if (r < rows_here) {
      load_floats(q + ((q_begin + i0 + r) * static_cast<int64_t>(a.num_q_heads) + head) * D + e, values);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) s_q[r * D + e + i] = r < rows_here ? values[i] * q_scale : 0.f;
  }

  float m[kRows], l[kRows], acc[kRows][kCols];
  int limit[kRows];  // keys [0, limit) are visible to the row
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = warp * kRows + r;
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
    limit[r] = row >= rows_here ? 0 : (a.causal ? min(kv_len, offset + i0 + row + 1) : kv_len);
  }

  for (int k0 = 0; k0 < kv_end; k0 += kBlockK) {
    __syncthreads();  // the previous tile has been read (and, the first time, the Q tile written)
    if (threadIdx.x < kBlockK) {
      const int j = k0 + threadIdx.x;
      s_slot[threadIdx.x] = j < kv_end ? slot_at(a.table, base + j) : -1;
    }
    __syncthreads();
    constexpr int kPieces = kBlockK * kPiecesPerRow / kThreads;  // per thread and tile
    constexpr int kBatch = kPieces < 4 ? kPieces : 4;               // loaded before any is stored
    static_assert(kPieces % kBatch == 0, "pieces must split into batches");
#pragma unroll
    for (int first = 0; first < kPieces; first += kBatch) {
      float k[kBatch][kVec], v[kBatch][kVec];
#pragma unroll
      for (int it = 0; it < kBatch; ++it) {
        const int piece = threadIdx.x + (first + it) * kThreads;
        const int64_t slot = s_slot[piece / kPiecesPerRow];
        const int e = (piece % kPiecesPerRow) * kVec;
        if (slot >= 0) {
          load_floats(k_rows + slot * slot_stride + e, k[it]);
          load_floats(v_rows + slot * slot_stride + e, v[it]);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) k[it][i] = v[it][i] = 0.f;
        }
      }
#pragma unroll
      for (int it = 0; it < kBatch; ++it) {
        const int piece = threadIdx.x + (first + it) * kThreads;
        const int j = piece / kPiecesPerRow;
        const int e = (piece % kPiecesPerRow) * kVec;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          s_kt[(e + i) * kKtStride + j] = k[it][i];
          s_v[j * D + e + i] = v[it][i];
        }
      }
    }
    __syncthreads();

    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.f;
    const float* q_rows = s_q + warp * kRows * D;
    for (int e = 0; e < D; e += 4) {
      const float k0e = s_kt[(e + 0) * kKtStride + lane];
      const float k1e = s_kt[(e + 1) * kKtStride + lane];
      const float k2e = s_kt[(e + 2) * kKtStride + lane];
      const float k3e = s_kt[(e + 3) * kKtStride + lane];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 qv = *reinterpret_cast<const float4*>(q_rows + r * D + e);
        s[r] += qv.x * k0e + qv.y * k1e + qv.z * k2e + qv.w * k3e;
      }
    }

    const int key = k0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] = key < limit[r] ? s[r] : -INFINITY;
      const float m_new = fmaxf(m[r], group_max<32>(s[r]));
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // keeps exp2 away from (-inf) - (-inf)
      const float p = exp2f(s[r] - m_ref);
      const float alpha = exp2f(m[r] - m_ref);
      l[r] = l[r] * alpha + group_sum<32>(p);
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= alpha;
      m[r] = m_new;
      s[r] = p;
    }
    for (int j = 0; j < kBlockK; ++j) {
      float v[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) v[c] = s_v[j * D + c * 32 + lane];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float p = __shfl_sync(kFullMask, s[r], j);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] += p * v[c];
      }
    }
  }

  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = warp * kRows + r;
    if (row >= rows_here) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const int64_t token = q_begin + i0 + row;
#pragma unroll
    for (int c = 0; c < kCols; ++c) out[(token * a.num_q_heads + head) * D + c * 32 + lane] = from_float<T>(acc[r][c] * inv);
  }
}

template <typename T, int D>
int launch(const PrefillArgs& a, cudaStream_t stream) {
  constexpr size_t kShared = shared_floats<D>() * sizeof(float);
  if (kShared > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(paged_prefill_kernel<T, D>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kShared));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const dim3 grid((a.max_q_len + kBlockQ - 1) / kBlockQ, a.num_q_heads, a.batch);
  paged_prefill_kernel<T, D><<<grid, kThreads, kShared, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_for_dim(const PrefillArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64:
      return launch<T, 64>(a, stream);
    case 128:
      return launch<T, 128>(a, stream);
    case 256:
      return launch<T, 256>(a, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int paged_prefill(const PrefillArgs& a, cudaStream_t stream) {
  const bool shape_ok = a.batch >= 0 && a.batch <= 65535 && a.num_q_heads <= 65535 && a.num_kv_heads > 0 &&
                        a.num_q_heads % a.num_kv_heads == 0 && a.max_q_len >= 0;
  if (!shape_ok) return static_cast<int>(cudaErrorInvalidValue);
  if (a.batch == 0 || a.num_q_heads == 0 || a.max_q_len == 0) return static_cast<int>(cudaSuccess);
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
