// Launchers of the fused kernels: raw device pointers, sizes and a CUDA stream; no PyTorch here.
//
// Every launcher returns a cudaError_t as an int (0 on success) after queueing its kernels on `stream`;
// error_string() turns a nonzero code into text. Layouts, all row-major and contiguous unless noted:
//   q, out         (tokens, num_q_heads, head_dim)
//   k_pool, v_pool (num_slots, num_kv_heads, head_dim): one layer of the flat token pool
//   kv_indptr      (batch + 1,) int32 prefix sums of each request's context length
//   slots          either kv_indices, (kv_indptr[batch],) the slots of all contexts concatenated, or the
//                  req_to_token table (rows, max_context) with `rows` (batch,) naming each request's row.
// Query head h reads key/value head h / (num_q_heads / num_kv_heads) (grouped-query attention).
#pragma once

#include <cstdint>

// The CUDA runtime's own definition, repeated so that a C++ file can call the launchers without the toolkit.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace astrai {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Text of a CUDA runtime error code returned by a launcher.
const char* error_string(int code);

// Where request b's context lives: slot of its j-th token = indices[base(b) + j], 0 <= j < kv_len(b), with
// base(b) = rows[b] * row_stride (req_to_token) or kv_indptr[b] (kv_indices when rows is null).
// The sizes bound every device-side read: num_slots the pool's rows; width the table's row length
// (req_to_token) or the length of kv_indices; num_rows the table's rows. A slot outside [0, num_slots) is
// skipped, a row outside [0, num_rows) is an empty context, and a context is cut at the table's width.
struct PageTable {
  const int32_t* kv_indptr;
  const void* indices;
  bool indices_int64;
  const int32_t* rows;
  int64_t row_stride;
  int64_t num_slots;
  int64_t num_rows;
  int64_t width;
};

// In-place rotary embedding in the rotate-half layout: for i < D/2, with x1 = x[i], x2 = x[i + D/2],
//   x[i]       = x1 * cos[i]       - x2 * sin[i]
//   x[i + D/2] = x2 * cos[i + D/2] + x1 * sin[i + D/2]
// q (tokens, num_q_heads, D) and k (tokens, num_k_heads, D) may be strided views (last dim contiguous).
// cos/sin row of token t is positions[t] when positions is non-null, else t; arithmetic in float32.
struct RotaryArgs {
  void* q;
  void* k;
  const void* cos;
  const void* sin;
  const int64_t* positions;
  int64_t num_tokens;
  int num_q_heads, num_k_heads, head_dim;
  int64_t q_stride_token, q_stride_head, k_stride_token, k_stride_head;
  int64_t cos_stride, sin_stride;
  DType dtype;        // of q and k
  DType table_dtype;  // of cos and sin: the same as dtype, or float32
};
int rotary_emb(const RotaryArgs& a, cudaStream_t stream);

// One query per request (q and out are (batch, num_q_heads, head_dim)) against its context: the last
// `window` tokens of it when window > 0, else all of it. Scores are s = scale * q.k, or
// softcap * tanh(s / softcap) when softcap > 0. The attended span is cut into num_splits chunks of
// split_size tokens (num_splits * split_size must cover the longest span); with more than one, partial
// results go to the float32 workspaces partial_out (batch, num_q_heads, num_splits, head_dim) and
// partial_lse (batch, num_q_heads, num_splits) and a second kernel merges them. head_dim 64, 128 or 256.
// A request with an empty context gets zeros.
struct DecodeArgs {
  const void* q;
  void* out;
  const void* k_pool;
  const void* v_pool;
  PageTable table;
  float* partial_out;
  float* partial_lse;
  int batch, num_q_heads, num_kv_heads, head_dim;
  int num_splits, split_size;
  float scale;
  int window;
  float softcap;
  DType dtype;
};
int paged_decode(const DecodeArgs& a, cudaStream_t stream);

// Blocks of the decode kernel for this dtype, head_dim and group size that fit on one SM at once
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor); the split count is chosen to fill the GPU with them.
// Negative on an unsupported shape.
int paged_decode_blocks_per_sm(DType dtype, int head_dim, int group_size);

// k_pool[slots[t]] = k[t] and v_pool[slots[t]] = v[t] for every token t, in one kernel. A row is
// row_bytes long (num_kv_heads * head_dim * element size, a multiple of 16); k and v rows are
// k_stride / v_stride bytes apart. A slot outside [0, num_slots) stops the kernel with an error.
struct StoreKVArgs {
  void* k_pool;
  void* v_pool;
  const void* k;
  const void* v;
  const void* slots;
  bool slots_int64;
  int64_t num_tokens, num_slots, row_bytes, k_stride, v_stride;
};
int store_kv(const StoreKVArgs& a, cudaStream_t stream);

// RWKV-4's WKV recurrence (astrai_pl/model/rwkv.py), float32, every tensor contiguous: k, v, y, gy, gk, gv
// (batch, steps, channels); w, u (channels,); state (3, batch, channels) = aa, bb, pp (forward: read as
// the start, overwritten with the end; backward: the start, read only); resets (batch, steps) bytes or
// null (the state restarts before those tokens); gw, gu (batch, channels) per row; scratch (3, batch,
// steps, channels). The forward writes y and state; the backward gk, gv, gw, gu from gy.
struct WkvArgs {
  const float* w;
  const float* u;
  const float* k;
  const float* v;
  const uint8_t* resets;
  float* state;
  float* y;
  const float* gy;
  float* gk;
  float* gv;
  float* gw;
  float* gu;
  float* scratch;
  int64_t batch, steps, channels;
};
int wkv_forward(const WkvArgs& a, cudaStream_t stream);
int wkv_backward(const WkvArgs& a, cudaStream_t stream);

}  // namespace astrai
