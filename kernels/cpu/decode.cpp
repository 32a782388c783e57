// A Llama model's CPU decode step in a single call: each layer runs the same kernels the Python layer
// calls (quant.cpp's packed linears, layers.cpp's fused small layers), in the same order on
// the same tensors, so the result is the Python path's bit for bit. What it saves is Python: at one
// sequence the layer's ~25 module calls and op dispatches from Python cost as much as its math. The
// weights are handed over once (LlamaDecodeWeights). The CUDA path has CUDA graphs for that; this is
// the CPU's counterpart. Shared prefixes (a system prompt, a forked chat) take the cascade attention
// of kernels/pytorch/decode.py, op for op. The ops are called through the dispatcher (a fraction of a
// microsecond each from C++).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "check.h"

namespace {

using Linear4 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Linear5 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&);
using Linear3 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// x @ W.T for a packed weight given as (qs, d, m, sc) (BlockWeight.decode_operands): uint8 qs is q4, or
// where sc is not empty q4k (uint8 sc) or q6k (int8 sc); int8 qs is q8 with m empty, q8m with offsets m
at::Tensor linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                  const at::Tensor& sc) {
  static const auto q4 = op<Linear4>("rosechat_quant::q4_linear");
  static const auto q8 = op<Linear3>("rosechat_quant::q8_linear");
  static const auto q8m = op<Linear4>("rosechat_quant::q8m_linear");
  static const auto q4k = op<Linear4>("rosechat_quant::q4k_linear");
  static const auto q6k = op<Linear5>("rosechat_quant::q6k_linear");
  if (qs.scalar_type() == at::kByte) {
    if (sc.numel() == 0) return q4.call(x, qs, d, m);
    return sc.scalar_type() == at::kChar ? q6k.call(x, qs, d, sc, m) : q4k.call(x, qs, d, sc);
  }
  ROSECHAT_CHECK(sc.numel() == 0, "int8 weights (q8, q8m) take no sub-scales");
  return m.numel() == 0 ? q8.call(x, qs, d) : q8m.call(x, qs, d, m);
}

constexpr size_t kPerLayer = 18;  // the two norms, then 4 tensors for each of the 4 linears

using Attention = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&, double);

// The step's decode attention as kernels/pytorch/decode.py runs it, op for op: each sequence's own keys
// through the slots, then every shared prefix attended once for all its sequences (cascade) and merged
// with their own part through the two log-sum-exps. A prefix: its member rows (empty: every row), its
// blocks, and its first block when they are consecutive in the pool (read in place), else -1.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                  const at::Tensor& counts, double scale, at::TensorList prefix_seqs, at::TensorList prefix_blocks,
                  at::IntArrayRef prefix_first) {
  static const auto own = op<Attention>("rosechat_layers::decode_attention");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  auto [out, lse] = own.call(q, k_cache.view({-1, Hkv * D}), v_cache.view({-1, Hkv * D}), slots, counts, scale);
  for (size_t i = 0; i < prefix_seqs.size(); ++i) {
    const at::Tensor& seqs = prefix_seqs[i];
    const at::Tensor& blocks = prefix_blocks[i];
    const bool all = seqs.numel() == 0;
    const int64_t keys = blocks.numel() * bs, m = all ? T : seqs.numel();
    const auto read = [&](const at::Tensor& cache) {
      const at::Tensor kv = prefix_first[i] >= 0 ? cache.narrow(0, prefix_first[i], blocks.numel())
                                                 : cache.index_select(0, blocks);
      return kv.view({1, keys, Hkv, D}).transpose(1, 2);
    };
    const at::Tensor qp = all ? q : q.index_select(0, seqs);
    auto [op, lse_p] = at::_scaled_dot_product_flash_attention_for_cpu(
        qp.view({m, Hkv, G, D}).transpose(0, 1).reshape({1, Hkv, m * G, D}), read(k_cache), read(v_cache), 0.0,
        false, c10::nullopt, scale);
    op = op.view({Hkv, m, G, D}).transpose(0, 1).reshape({m, Hq, D});
    lse_p = lse_p.view({Hkv, m, G}).transpose(0, 1).reshape({m, Hq});
    const at::Tensor o_s = all ? out : out.index_select(0, seqs), lse_s = all ? lse : lse.index_select(0, seqs);
    const at::Tensor total = at::logaddexp(lse_p, lse_s);
    at::Tensor merged = op.mul_((lse_p - total).exp_().unsqueeze(-1)).add_(o_s * (lse_s - total).exp_().unsqueeze(-1));
    if (all)
      out = merged;
    else
      out.index_copy_(0, seqs, merged);
  }
  return out;
}

// weights: input norm, post-attention norm, then (qs, d, m, sc) of qkv, o, gate_up and down (18 tensors).
// x [T, H]: the last layer's output; residual [T, H]: the stream before it (both updated in place:
// the residual takes x, x is normed). Returns the layer's output, not yet added to the residual.
// Every token is a decode; att_slots [T, L] / att_counts [T] and the prefixes are the step's gather plan.
at::Tensor llama_decode_layer(at::Tensor& x, at::Tensor& residual, at::TensorList w, double eps,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& att_slots,
                              const at::Tensor& att_counts, at::TensorList prefix_seqs, at::TensorList prefix_blocks,
                              at::IntArrayRef prefix_first, double scale, int64_t num_heads, int64_t num_kv_heads) {
  static const auto add_rms_norm = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>(
      "rosechat_layers::add_rms_norm_");
  static const auto rotary = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "rosechat_layers::rotary_");
  static const auto write_kv = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                       const at::Tensor&)>("rosechat_layers::write_kv");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("rosechat_layers::silu_mul");
  ROSECHAT_CHECK(w.size() == kPerLayer, "llama_decode_layer takes 18 weight tensors, got ", w.size());
  ROSECHAT_CHECK(prefix_seqs.size() == prefix_blocks.size() && prefix_blocks.size() == prefix_first.size(),
              "one member list, block list and first block per shared prefix");

  const int64_t T = x.size(0), D = k_cache.size(-1), q_size = num_heads * D, kv_size = num_kv_heads * D;
  add_rms_norm.call(x, residual, w[0], eps);
  const at::Tensor qkv = linear(x, w[2], w[3], w[4], w[5]);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
  rotary.call(q, k, cos, sin);
  write_kv.call(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor attended = attend(q.contiguous(), k_cache, v_cache, att_slots, att_counts, scale, prefix_seqs,
                                     prefix_blocks, prefix_first);
  at::Tensor o = linear(attended.view({T, q_size}), w[6], w[7], w[8], w[9]);
  add_rms_norm.call(o, residual, w[1], eps);
  return linear(silu_mul.call(linear(o, w[10], w[11], w[12], w[13])), w[14], w[15], w[16], w[17]);
}

// A Llama model's decode weights, held in C++ once (packed weights are final after loading), so a
// step passes one object where it passed each layer's 18 tensors from Python: converting them and
// the Python loop over 30 layers cost ~0.6 ms a step, a tenth of a one-sequence step.
struct LlamaDecodeWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> w;  // 18 per layer (as llama_decode_layer takes them), then the final norm
  double eps, scale;
  int64_t num_heads, num_kv_heads;
  LlamaDecodeWeights(std::vector<at::Tensor> weights, double eps, double scale, int64_t num_heads,
                     int64_t num_kv_heads)
      : w(std::move(weights)), eps(eps), scale(scale), num_heads(num_heads), num_kv_heads(num_kv_heads) {
    ROSECHAT_CHECK(w.size() % kPerLayer == 1, "18 weight tensors per layer, then the final norm: got ", w.size());
  }
  int64_t num_layers() const { return static_cast<int64_t>(w.size() / kPerLayer); }
};

// Every layer of a decode-only step, then the final norm: x [T, H] embedded tokens -> normed hidden
// states. k_pool / v_pool [layers, blocks, block_size, kv_heads, head_dim]; the gather plan as for
// llama_decode_layer.
at::Tensor llama_decode(const c10::intrusive_ptr<LlamaDecodeWeights>& model, at::Tensor x, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& slot_mapping, const at::Tensor& att_slots, const at::Tensor& att_counts,
                        at::TensorList prefix_seqs, at::TensorList prefix_blocks, at::IntArrayRef prefix_first) {
  static const auto add_rms_norm = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>(
      "rosechat_layers::add_rms_norm_");
  const int64_t layers = model->num_layers();
  ROSECHAT_CHECK(k_pool.dim() == 5 && k_pool.size(0) == layers && v_pool.sizes() == k_pool.sizes(),
              "KV pools [", layers, ", blocks, block_size, kv_heads, head_dim]");
  at::Tensor residual = at::zeros_like(x);  // the first layer's residual add is onto zeros
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor k_cache = k_pool.select(0, l), v_cache = v_pool.select(0, l);
    x = llama_decode_layer(x, residual, at::TensorList(model->w).slice(kPerLayer * l, kPerLayer), model->eps, cos, sin, k_cache,
                           v_cache, slot_mapping, att_slots, att_counts, prefix_seqs, prefix_blocks, prefix_first,
                           model->scale, model->num_heads, model->num_kv_heads);
  }
  add_rms_norm.call(x, residual, model->w.back(), model->eps);
  return x;
}

}  // namespace

TORCH_LIBRARY(rosechat_decode, lib) {
  lib.class_<LlamaDecodeWeights>("LlamaDecodeWeights")
      .def(torch::init<std::vector<at::Tensor>, double, double, int64_t, int64_t>());
  lib.def("llama_decode(__torch__.torch.classes.rosechat_decode.LlamaDecodeWeights model, Tensor x, Tensor cos, "
          "Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping, Tensor att_slots, "
          "Tensor att_counts, Tensor[] prefix_seqs, Tensor[] prefix_blocks, int[] prefix_first) -> Tensor",
          &llama_decode);
}
