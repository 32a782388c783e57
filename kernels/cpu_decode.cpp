// One Llama decoder layer of a CPU decode step in a single call: the same kernels the Python layer
// calls (cpu_quant.cpp's packed linears, cpu_layers.cpp's fused small layers), in the same order on
// the same tensors, so the result is the Python path's bit for bit. What it saves is Python: at one
// sequence the layer's ~25 module calls and op dispatches from Python cost as much as its math.
// The CUDA path has CUDA graphs for that; this is the CPU's counterpart. The ops are called through
// the dispatcher (a fraction of a microsecond each from C++).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using Linear4 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Linear3 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// x @ W.T for a packed weight given as (qs, d, m): uint8 qs is q4, int8 qs is q8 (m unused)
at::Tensor linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  static const auto q4 = op<Linear4>("rosechat_quant::q4_linear");
  static const auto q8 = op<Linear3>("rosechat_quant::q8_linear");
  return qs.scalar_type() == at::kByte ? q4.call(x, qs, d, m) : q8.call(x, qs, d);
}

// weights: input norm, post-attention norm, then (qs, d, m) of qkv, o, gate_up and down (14 tensors).
// x [T, H]: the last layer's output; residual [T, H]: the stream before it (both updated in place:
// the residual takes x, x is normed). Returns the layer's output, not yet added to the residual.
// Every token is a decode; att_slots [T, L] / att_counts [T] are the step's gather plan.
at::Tensor llama_decode_layer(at::Tensor& x, at::Tensor& residual, at::TensorList w, double eps,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& att_slots,
                              const at::Tensor& att_counts, double scale, int64_t num_heads, int64_t num_kv_heads) {
  static const auto add_rms_norm = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>(
      "rosechat_layers::add_rms_norm_");
  static const auto rotary = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "rosechat_layers::rotary_");
  static const auto write_kv = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                       const at::Tensor&)>("rosechat_layers::write_kv");
  static const auto attention = op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "rosechat_layers::decode_attention");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("rosechat_layers::silu_mul");
  TORCH_CHECK(w.size() == 14, "llama_decode_layer takes 14 weight tensors, got ", w.size());

  const int64_t T = x.size(0), D = k_cache.size(-1), q_size = num_heads * D, kv_size = num_kv_heads * D;
  add_rms_norm.call(x, residual, w[0], eps);
  const at::Tensor qkv = linear(x, w[2], w[3], w[4]);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
  rotary.call(q, k, cos, sin);
  write_kv.call(k, v, k_cache, v_cache, slot_mapping);
  const auto attended = attention.call(q.contiguous(), k_cache.view({-1, kv_size}), v_cache.view({-1, kv_size}),
                                       att_slots, att_counts, scale);
  at::Tensor o = linear(std::get<0>(attended).view({T, q_size}), w[5], w[6], w[7]);
  add_rms_norm.call(o, residual, w[1], eps);
  return linear(silu_mul.call(linear(o, w[8], w[9], w[10])), w[11], w[12], w[13]);
}

}  // namespace

TORCH_LIBRARY(rosechat_decode, lib) {
  lib.def("llama_decode_layer(Tensor(a!) x, Tensor(b!) residual, Tensor[] weights, float eps, Tensor cos, "
          "Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor att_slots, "
          "Tensor att_counts, float scale, int num_heads, int num_kv_heads) -> Tensor", &llama_decode_layer);
}
