// PyTorch binding of the fused kernels: checks devices, dtypes, shapes, layouts and head_dim with errors
// that name the argument, all before any launch (astrai_pl/ops/arguments.py runs the same checks in Python
// first, so the ops' wrappers never reach these with a bad call), then passes data pointers and the caller's CUDA stream (an integer handle from
// torch.cuda.current_stream(device).cuda_stream) to the launchers in launchers.h. Python wrappers in
// astrai_pl/ops/fused.py pick the split count, allocate outputs and fall back to the PyTorch references.
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "launchers.h"

namespace {

using torch::Tensor;

astrai::DType dtype_of(const Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return astrai::DType::kFloat32;
    case torch::kFloat16:
      return astrai::DType::kFloat16;
    case torch::kBFloat16:
      return astrai::DType::kBFloat16;
    default:
      TORCH_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_on(const Tensor& t, const Tensor& anchor, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == anchor.device(), op, ": ", name, " is on ", t.device(), " but q is on ", anchor.device());
}

void check_dims(const Tensor& t, int64_t dims, const char* op, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == dims, op, ": ", name, " must be ", layout, ", got shape ", t.sizes());
}

void check_contiguous_aligned(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous() first)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must start on a 16-byte boundary (a fresh tensor does; a sliced view may not)");
}

void check_same_dtype(const Tensor& t, const Tensor& q, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " is ", t.scalar_type(), " but q is ",
              q.scalar_type());
}

void check_index(const Tensor& t, const Tensor& q, const char* op, const char* name, bool allow_int64) {
  check_on(t, q, op, name);
  const bool ok = t.scalar_type() == torch::kInt32 || (allow_int64 && t.scalar_type() == torch::kInt64);
  TORCH_CHECK(ok, op, ": ", name, " must be ", allow_int64 ? "int32 or int64" : "int32", ", got ", t.scalar_type());
}

void check_head_dim(int64_t d, const char* op) {
  TORCH_CHECK(d == 64 || d == 128 || d == 256, op, ": head_dim must be 64, 128 or 256, got ", d);
}

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(handle)); }

void check_launch(int code, const char* op) {
  TORCH_CHECK(code == 0, op, ": kernel launch failed: ", astrai::error_string(code));
}

// The page table of paged_decode: kv_indices (1-D, flat) or req_to_token (2-D) with rows, and the sizes that
// bound every read the kernel makes through it (see PageTable).
astrai::PageTable page_table(const Tensor& q, int64_t batch, const Tensor& kv_indptr, const Tensor& indices,
                             const std::optional<Tensor>& rows, int64_t num_slots, const char* op) {
  check_index(kv_indptr, q, op, "kv_indptr", false);
  check_dims(kv_indptr, 1, op, "kv_indptr", "(batch + 1,)");
  TORCH_CHECK(kv_indptr.size(0) == batch + 1, op, ": kv_indptr must have batch + 1 = ", batch + 1,
              " entries, got ", kv_indptr.size(0));
  TORCH_CHECK(kv_indptr.is_contiguous(), op, ": kv_indptr must be contiguous");
  astrai::PageTable table{kv_indptr.data_ptr<int32_t>(), indices.data_ptr(), false, nullptr, 0, num_slots, 0, 0};
  if (rows.has_value()) {
    check_index(indices, q, op, "req_to_token", true);
    check_dims(indices, 2, op, "req_to_token", "(rows, max_context)");
    TORCH_CHECK(indices.stride(1) == 1, op, ": req_to_token rows must be contiguous");
    check_index(*rows, q, op, "rows", false);
    check_dims(*rows, 1, op, "rows", "(batch,)");
    TORCH_CHECK(rows->size(0) == batch && rows->is_contiguous(), op, ": rows must be a contiguous (", batch,
                ",) tensor, got shape ", rows->sizes());
    table.rows = rows->data_ptr<int32_t>();
    table.row_stride = indices.stride(0);
    table.num_rows = indices.size(0);
    table.width = indices.size(1);
  } else {
    check_index(indices, q, op, "kv_indices", true);
    check_dims(indices, 1, op, "kv_indices", "(total context tokens,)");
    TORCH_CHECK(indices.is_contiguous(), op, ": kv_indices must be contiguous");
    table.width = indices.size(0);
  }
  table.indices_int64 = indices.scalar_type() == torch::kInt64;
  return table;
}

// q (tokens, Hq, D), pools (slots, Hkv, D), out like q: same device, dtype, layout checks for both ops.
void check_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, const Tensor& out,
                     const char* op) {
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got one on ", q.device());
  check_dims(q, 3, op, "q", "(tokens, num_q_heads, head_dim)");
  check_dims(k_pool, 3, op, "k_pool", "(num_slots, num_kv_heads, head_dim)");
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes(), op, ": v_pool has shape ", v_pool.sizes(), " but k_pool has ",
              k_pool.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), op, ": out has shape ", out.sizes(), " but q has ", q.sizes());
  const std::pair<const Tensor*, const char*> tensors[] = {{&q, "q"}, {&k_pool, "k_pool"}, {&v_pool, "v_pool"},
                                                           {&out, "out"}};
  for (const auto& [t, name] : tensors) {
    check_on(*t, q, op, name);
    check_same_dtype(*t, q, op, name);
    check_contiguous_aligned(*t, op, name);
  }
  dtype_of(q, op, "q");
  check_head_dim(q.size(2), op);
  TORCH_CHECK(k_pool.size(2) == q.size(2), op, ": k_pool head_dim ", k_pool.size(2), " differs from q's ",
              q.size(2));
  TORCH_CHECK(k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0, op, ": num_q_heads (", q.size(1),
              ") must be a multiple of num_kv_heads (", k_pool.size(1), ")");
}

void rotary_emb(Tensor q, Tensor k, Tensor cos, Tensor sin, std::optional<Tensor> positions, int64_t stream) {
  const char* op = "rotary_emb";
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got one on ", q.device());
  check_dims(q, 3, op, "q", "(tokens, num_q_heads, head_dim)");
  check_dims(k, 3, op, "k", "(tokens, num_k_heads, head_dim)");
  check_dims(cos, 2, op, "cos", "(rows, head_dim)");
  check_dims(sin, 2, op, "sin", "(rows, head_dim)");
  check_on(k, q, op, "k");
  check_on(cos, q, op, "cos");
  check_on(sin, q, op, "sin");
  check_same_dtype(k, q, op, "k");
  const astrai::DType dtype = dtype_of(q, op, "q");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), op, ": cos is ", cos.scalar_type(), " but sin is ",
              sin.scalar_type());
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() || cos.scalar_type() == torch::kFloat32, op,
              ": cos and sin must be float32 or q's dtype (", q.scalar_type(), "), got ", cos.scalar_type());
  const int64_t n = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even, got ", d);
  TORCH_CHECK(k.size(0) == n && k.size(2) == d, op, ": k has shape ", k.sizes(), ", q has ", q.sizes());
  TORCH_CHECK(cos.size(1) == d && sin.size(1) == d, op, ": cos and sin must have head_dim = ", d, " columns");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1, op,
              ": the last dimension of q, k, cos and sin must be contiguous");
  const int64_t* pos = nullptr;
  if (positions.has_value()) {
    check_on(*positions, q, op, "positions");
    TORCH_CHECK(positions->scalar_type() == torch::kInt64 && positions->dim() == 1 && positions->size(0) == n &&
                    positions->is_contiguous(),
                op, ": positions must be a contiguous int64 (", n, ",) tensor, got ", positions->scalar_type(),
                " of shape ", positions->sizes());
    pos = positions->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(cos.size(0) == n && sin.size(0) == n, op, ": without positions, cos and sin need one row per token (",
                n, "), got ", cos.size(0));
  }
  const c10::DeviceGuard guard(q.device());
  astrai::RotaryArgs a{q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos, n,
                       static_cast<int>(q.size(1)), static_cast<int>(k.size(1)), static_cast<int>(d),
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
                       dtype, dtype_of(cos, op, "cos")};
  check_launch(astrai::rotary_emb(a, as_stream(stream)), op);
}

Tensor paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor kv_indptr, Tensor indices,
                    std::optional<Tensor> rows, Tensor out, int64_t num_splits, int64_t split_size, double scale,
                    int64_t window, double softcap, int64_t stream) {
  const char* op = "paged_decode";
  check_attention(q, k_pool, v_pool, out, op);
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(batch <= 65535, op, ": at most 65535 requests per call, got ", batch);
  TORCH_CHECK(num_splits >= 1 && split_size >= 1, op, ": num_splits and split_size must be positive, got ",
              num_splits, " and ", split_size);
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, op, ": window must be 0 (none) or a positive int32, got ", window);
  TORCH_CHECK(softcap >= 0.0, op, ": softcap must be 0 (none) or positive, got ", softcap);
  const astrai::PageTable table = page_table(q, batch, kv_indptr, indices, rows, k_pool.size(0), op);
  const c10::DeviceGuard guard(q.device());
  Tensor partial_out, partial_lse;
  if (num_splits > 1) {
    const auto f32 = q.options().dtype(torch::kFloat32);
    partial_out = torch::empty({batch, heads, num_splits, d}, f32);
    partial_lse = torch::empty({batch, heads, num_splits}, f32);
  }
  astrai::DecodeArgs a{q.data_ptr(), out.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table,
                       num_splits > 1 ? partial_out.data_ptr<float>() : nullptr,
                       num_splits > 1 ? partial_lse.data_ptr<float>() : nullptr,
                       static_cast<int>(batch), static_cast<int>(heads), static_cast<int>(k_pool.size(1)),
                       static_cast<int>(d), static_cast<int>(num_splits), static_cast<int>(split_size),
                       static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap),
                       dtype_of(q, op, "q")};
  check_launch(astrai::paged_decode(a, as_stream(stream)), op);
  return out;
}

int64_t paged_decode_blocks_per_sm(int64_t dtype_code, int64_t head_dim, int64_t group_size) {
  const char* op = "paged_decode_blocks_per_sm";
  TORCH_CHECK(dtype_code >= 0 && dtype_code <= 2, op, ": dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  check_head_dim(head_dim, op);
  TORCH_CHECK(group_size >= 1, op, ": group_size must be positive, got ", group_size);
  const int blocks = astrai::paged_decode_blocks_per_sm(static_cast<astrai::DType>(dtype_code),
                                                         static_cast<int>(head_dim), static_cast<int>(group_size));
  TORCH_CHECK(blocks > 0, op, ": the occupancy query failed: ", astrai::error_string(blocks < 0 ? -blocks : 0));
  return blocks;
}

void store_kv(Tensor k_pool, Tensor v_pool, Tensor slots, Tensor k, Tensor v, int64_t stream) {
  const char* op = "store_kv";
  TORCH_CHECK(k_pool.is_cuda(), op, ": k_pool must be a CUDA tensor, got one on ", k_pool.device());
  check_dims(k_pool, 3, op, "k_pool", "(num_slots, num_kv_heads, head_dim)");
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes(), op, ": v_pool has shape ", v_pool.sizes(), " but k_pool has ",
              k_pool.sizes());
  const int64_t n = slots.size(0);
  const std::pair<const Tensor*, const char*> tensors[] = {{&v_pool, "v_pool"}, {&k, "k"}, {&v, "v"}};
  for (const auto& [t, name] : tensors) {
    TORCH_CHECK(t->is_cuda() && t->device() == k_pool.device(), op, ": ", name, " is on ", t->device(),
                " but k_pool is on ", k_pool.device());
    TORCH_CHECK(t->scalar_type() == k_pool.scalar_type(), op, ": ", name, " is ", t->scalar_type(),
                " but k_pool is ", k_pool.scalar_type());
  }
  TORCH_CHECK(slots.is_cuda() && slots.device() == k_pool.device(), op, ": slots must be on ", k_pool.device());
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() &&
                  (slots.scalar_type() == torch::kInt32 || slots.scalar_type() == torch::kInt64),
              op, ": slots must be a contiguous 1-D int32 or int64 tensor");
  const auto row = k_pool.sizes().slice(1);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == n && v.size(0) == n && k.sizes().slice(1) == row &&
                  v.sizes().slice(1) == row,
              op, ": k and v must be (", n, ", ", row[0], ", ", row[1], "), got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == row[1] && v.stride(2) == 1 && v.stride(1) == row[1], op,
              ": each token's k and v rows must be contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), op, ": k_pool and v_pool must be contiguous");
  const int64_t elem = k_pool.element_size();
  const int64_t row_bytes = row[0] * row[1] * elem;
  TORCH_CHECK(row_bytes % 16 == 0 && (k.stride(0) * elem) % 16 == 0 && (v.stride(0) * elem) % 16 == 0, op,
              ": a token's K/V row and the distance between rows must be multiples of 16 bytes");
  const std::pair<const Tensor*, const char*> buffers[] = {{&k_pool, "k_pool"}, {&v_pool, "v_pool"}, {&k, "k"},
                                                           {&v, "v"}};
  for (const auto& [t, name] : buffers) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, ": ", name,
                " must start on a 16-byte boundary");
  }
  const c10::DeviceGuard guard(k_pool.device());
  astrai::StoreKVArgs a{k_pool.data_ptr(), v_pool.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
                        slots.scalar_type() == torch::kInt64, n, k_pool.size(0), row_bytes,
                        k.stride(0) * elem, v.stride(0) * elem};
  check_launch(astrai::store_kv(a, as_stream(stream)), op);
}

void check_wkv_tensor(const Tensor& t, const Tensor& k, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == k.device(), op, ": ", name, " must be on ", k.device(), ", got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous() first)");
}

astrai::WkvArgs wkv_args(const Tensor& w, const Tensor& u, const Tensor& k, const Tensor& v,
                         const std::optional<Tensor>& resets, const Tensor& state, const char* op) {
  check_dims(k, 3, op, "k", "(batch, steps, channels)");
  const int64_t B = k.size(0), T = k.size(1), H = k.size(2);
  const std::pair<const Tensor*, const char*> tensors[] = {{&w, "w"}, {&u, "u"}, {&k, "k"}, {&v, "v"},
                                                           {&state, "state"}};
  for (const auto& [t, name] : tensors) check_wkv_tensor(*t, k, op, name);
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v has shape ", v.sizes(), " but k has ", k.sizes());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && u.dim() == 1 && u.size(0) == H, op, ": w and u must be (", H,
              ",), got ", w.sizes(), " and ", u.sizes());
  TORCH_CHECK(state.dim() == 3 && state.size(0) == 3 && state.size(1) == B && state.size(2) == H, op,
              ": state must be (3, ", B, ", ", H, "), got ", state.sizes());
  const uint8_t* flags = nullptr;
  if (resets.has_value()) {
    const Tensor& r = *resets;
    TORCH_CHECK(r.is_cuda() && r.device() == k.device() && r.scalar_type() == torch::kBool && r.is_contiguous() &&
                    r.dim() == 2 && r.size(0) == B && r.size(1) == T,
                op, ": resets must be a contiguous bool (", B, ", ", T, ") tensor on ", k.device());
    flags = reinterpret_cast<const uint8_t*>(r.data_ptr<bool>());
  }
  return astrai::WkvArgs{w.data_ptr<float>(), u.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                         flags, state.data_ptr<float>(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                         nullptr, B, T, H};
}

Tensor wkv_forward(Tensor w, Tensor u, Tensor k, Tensor v, std::optional<Tensor> resets, Tensor state,
                   int64_t stream) {
  const char* op = "wkv_forward";
  astrai::WkvArgs a = wkv_args(w, u, k, v, resets, state, op);
  Tensor y = torch::empty_like(k);
  a.y = y.data_ptr<float>();
  const c10::DeviceGuard guard(k.device());
  check_launch(astrai::wkv_forward(a, as_stream(stream)), op);
  return y;
}

std::vector<Tensor> wkv_backward(Tensor w, Tensor u, Tensor k, Tensor v, std::optional<Tensor> resets,
                                 Tensor state, Tensor gy, int64_t stream) {
  const char* op = "wkv_backward";
  astrai::WkvArgs a = wkv_args(w, u, k, v, resets, state, op);
  check_wkv_tensor(gy, k, op, "gy");
  TORCH_CHECK(gy.sizes() == k.sizes(), op, ": gy has shape ", gy.sizes(), " but k has ", k.sizes());
  Tensor gk = torch::empty_like(k), gv = torch::empty_like(v), scratch = k.new_empty({3, k.size(0), k.size(1), k.size(2)});
  Tensor gw = k.new_empty({k.size(0), k.size(2)}), gu = k.new_empty({k.size(0), k.size(2)});
  a.gy = gy.data_ptr<float>();
  a.gk = gk.data_ptr<float>();
  a.gv = gv.data_ptr<float>();
  a.gw = gw.data_ptr<float>();
  a.gu = gu.data_ptr<float>();
  a.scratch = scratch.data_ptr<float>();
  const c10::DeviceGuard guard(k.device());
  check_launch(astrai::wkv_backward(a, as_stream(stream)), op);
  return {gk, gv, gw.sum(0), gu.sum(0)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Fused CUDA kernels of astrai_pl: rotary embedding, paged decode attention, K/V pool write, WKV";
  m.def("rotary_emb", &rotary_emb, "Rotate q and k in place (rotate-half layout)", py::arg("q"), py::arg("k"),
        py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("stream"));
  m.def("paged_decode", &paged_decode, "One query per request against the paged K/V pool", py::arg("q"),
        py::arg("k_pool"), py::arg("v_pool"), py::arg("kv_indptr"), py::arg("indices"), py::arg("rows"),
        py::arg("out"), py::arg("num_splits"), py::arg("split_size"), py::arg("scale"), py::arg("window"),
        py::arg("softcap"), py::arg("stream"));
  m.def("paged_decode_blocks_per_sm", &paged_decode_blocks_per_sm,
        "Decode blocks per SM at full occupancy, for choosing the split count", py::arg("dtype_code"),
        py::arg("head_dim"), py::arg("group_size"));
  m.def("store_kv", &store_kv, "Write K/V rows into one layer of the pool at the given slots", py::arg("k_pool"),
        py::arg("v_pool"), py::arg("slots"), py::arg("k"), py::arg("v"), py::arg("stream"));
  m.def("wkv_forward", &wkv_forward, "RWKV-4's WKV over a sequence; updates state to the end", py::arg("w"),
        py::arg("u"), py::arg("k"), py::arg("v"), py::arg("resets"), py::arg("state"), py::arg("stream"));
  m.def("wkv_backward", &wkv_backward, "Gradients of WKV: (gk, gv, gw, gu) from the start state and gy",
        py::arg("w"), py::arg("u"), py::arg("k"), py::arg("v"), py::arg("resets"), py::arg("state"), py::arg("gy"),
        py::arg("stream"));
}
