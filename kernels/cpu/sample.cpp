// Sampling on the CPU, one call per step: each row's argmax (greedy), or its penalty, temperature,
// top-k, top-p, min-p and draw. Rows are independent (any batch gives a row the same token). Built with
// layers.cpp into one extension; its operators join rosechat_layers.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include "check.h"
#include "pool.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace rosechat::vec;

// Each row's first index of its maximum, as torch.argmax (a NaN counts as the maximum): greedy
// sampling over a vocabulary. ATen's CPU argmax is not vectorised, and its parallel reductions wake
// OpenMP's sleeping threads (~0.1 ms a step at one row).
int64_t row_argmax(const float* x, int64_t n) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float best = *std::max_element(lanes, lanes + 8);
  for (int64_t j = i; j < n; ++j) best = std::max(best, x[j]);
  const bool any_nan = _mm256_movemask_ps(nan) != 0 || std::any_of(x + i, x + n, [](float v) { return v != v; });
  for (int64_t j = 0; j < n; ++j)  // the first maximum (or NaN): a short scan in L1/L2
    if (any_nan ? x[j] != x[j] : x[j] == best) return j;
  return 0;  // n == 0 is refused by the caller
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_f32(x, "x");
  ROSECHAT_CHECK(x.dim() == 2 && x.size(1) > 0 && x.is_contiguous(), "x: contiguous [rows, n], n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  rosechat::parallel_for(0, rows, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(xp + r * n, n);
  });
  return out;
}


// ---- sampling: one call per step, every row's penalty, temperature, top-k, top-p, min-p and draw ----
//
// The stages as HF's logits processors and engine/sampler.py order them, without a sort of the whole
// vocabulary or a random number per token: exp((l - max) / T) once per token (vectorised); top-k by
// partial selection; top-p on the few tokens that can be in the nucleus (gathered in the exp pass), cut
// down further by bisection on the weight while many remain, then sorted; min-p against the top token's
// weight (1).
// The draw walks the kept tokens in vocabulary order to u * (their total): one uniform u per row,
// from the row's own generator, as Sampler._draw_torch does.

struct Cand {
  float w;
  int64_t id;
};

// Heavier first; equal weights in vocabulary order (as a stable descending sort, torch's route, has them)
inline bool heavier(const Cand& a, const Cand& b) { return a.w > b.w || (a.w == b.w && a.id < b.id); }

int64_t sample_penalised(float* x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p, double u,
                         std::vector<float>& w, std::vector<Cand>& cand);

// The row's penalised logits are written in place for the sampling and put back after it: the caller's
// logits stay as they were without a copy of the vocabulary.
int64_t sample_row(float* x, int64_t n, const int64_t* seen, int64_t n_seen, float penalty, float temperature,
                   int64_t top_k, float top_p, float min_p, double u, std::vector<float>& w,
                   std::vector<Cand>& cand) {
  if (penalty == 1.0f || n_seen == 0) return sample_penalised(x, n, temperature, top_k, top_p, min_p, u, w, cand);
  thread_local std::vector<float> old;  // HF: gather every seen logit first, so a repeated id counts once
  old.resize(n_seen);
  for (int64_t j = 0; j < n_seen; ++j) old[j] = x[seen[j]];
  for (int64_t j = 0; j < n_seen; ++j) x[seen[j]] = old[j] > 0 ? old[j] / penalty : old[j] * penalty;
  const int64_t token = sample_penalised(x, n, temperature, top_k, top_p, min_p, u, w, cand);
  for (int64_t j = n_seen - 1; j >= 0; --j) x[seen[j]] = old[j];  // backwards: a repeat's first read wins
  return token;
}

int64_t sample_penalised(float* x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p, double u,
                         std::vector<float>& w, std::vector<Cand>& cand) {
  if (temperature == 0.0f) return row_argmax(x, n);
  const int64_t top = row_argmax(x, n);
  const float mx = x[top];
  if (!(mx > -INFINITY)) return top;  // every logit -inf (or NaN): nothing to weigh
  // weights relative to the top token (whose weight is 1): exp((x - max) / T), 0 for -inf
  w.resize(n);
  cand.clear();
  const bool top_k_first = top_k > 0 && top_k < n;
  // Top-p's candidates, gathered in this pass: a token of weight at most (1 - p) / n is never in the
  // nucleus (all of them weigh at most 1 - p, and the total is at least the top token's 1). The few
  // left are cut further below; a sweep of the vocabulary for them cost more than the exp pass.
  const float cut = top_p < 1.0f && !top_k_first ? 0.999f * (1.0f - top_p) / static_cast<float>(n) : INFINITY;
  const float inv_t = 1.0f / temperature;
  const __m256 vmax = _mm256_set1_ps(mx), vinv = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(-87.0f);
  const __m256 vcut = _mm256_set1_ps(cut);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax), vinv);
    const __m256 e = _mm256_and_ps(exp8(z), _mm256_cmp_ps(z, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(w.data() + i, e);
    acc = _mm256_add_ps(acc, e);
    for (int above = _mm256_movemask_ps(_mm256_cmp_ps(e, vcut, _CMP_GT_OQ)); above; above &= above - 1) {
      const int lane = __builtin_ctz(above);
      cand.push_back({w[i + lane], i + lane});
    }
  }
  double total = hsum(acc);
  for (; i < n; ++i) {
    const float z = (x[i] - mx) * inv_t;
    w[i] = z >= -87.0f ? exp1(z) : 0.0f;
    total += w[i];
    if (w[i] > cut) cand.push_back({w[i], i});
  }
  const float keep_from = min_p > 0.0f ? min_p : 0.0f;  // min-p: weight below min_p * 1 is dropped
  if (top_k_first) {  // top-k: the k heaviest (ties: any k of them, as a sort would)
    cand.resize(n);
    for (int64_t j = 0; j < n; ++j) cand[j] = {w[j], j};
    std::nth_element(cand.begin(), cand.begin() + (top_k - 1), cand.end(), heavier);
    cand.resize(top_k);
    total = 0.0;
    for (const Cand& c : cand) total += c.w;
  }
  if (top_p < 1.0f) {
    const double need = top_p * total;  // the nucleus: tokens while the mass before them is < need
    float lo = 0.0f, hi = 1.0f;  // the mass above lo reaches need; above hi it does not
    for (int it = 0; cand.size() > 256 && it < 32; ++it) {
      const float mid = 0.5f * (lo + hi);
      double above = 0.0;
      for (const Cand& c : cand) above += c.w > mid ? c.w : 0.0f;
      if (above >= need) {
        lo = mid;
        cand.erase(std::remove_if(cand.begin(), cand.end(), [mid](const Cand& c) { return c.w <= mid; }),
                   cand.end());
      } else {
        hi = mid;
      }
    }
    std::sort(cand.begin(), cand.end(), heavier);
    double before = 0.0;
    size_t kept = 0;
    while (kept < cand.size() && (kept == 0 || before < need)) before += cand[kept++].w;
    cand.resize(kept);
  }
  // The draw: the kept tokens (weight >= keep_from and > 0) in vocabulary order, the first whose running
  // weight passes u * their total. size and at(k) -> (weight, id) name them: the few candidates, or all.
  // `known`: their total where already summed (all tokens, no min-p), else < 0
  const auto draw = [&](size_t size, auto at, double known) -> int64_t {
    double mass = known;
    if (mass < 0.0) {
      mass = 0.0;
      for (size_t k = 0; k < size; ++k) {
        const float v = at(k).first;
        mass += v >= keep_from ? v : 0.0f;
      }
    }
    const double target = u * mass;
    double run = 0.0;
    int64_t last = top;
    for (size_t k = 0; k < size; ++k) {
      const auto [v, id] = at(k);
      if (v < keep_from || v <= 0.0f) continue;
      last = id;
      run += v;
      if (run > target) return id;
    }
    return last;  // u * mass rounded past the end
  };
  if (!cand.empty()) {
    std::sort(cand.begin(), cand.end(), [](const Cand& a, const Cand& b) { return a.id < b.id; });
    return draw(cand.size(), [&](size_t k) { return std::pair<float, int64_t>(cand[k].w, cand[k].id); }, -1.0);
  }
  return draw(static_cast<size_t>(n), [&](size_t k) { return std::pair<float, int64_t>(w[k], k); },
              keep_from > 0.0f ? -1.0 : total);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& seen, const at::Tensor& seen_offsets,
                       const at::Tensor& penalties, const at::Tensor& temperatures, const at::Tensor& top_ks,
                       const at::Tensor& top_ps, const at::Tensor& min_ps, const at::Tensor& uniforms) {
  check_f32(logits, "logits");
  ROSECHAT_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.is_contiguous(), "logits: contiguous [rows, n]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  for (const at::Tensor* t : {&penalties, &temperatures, &top_ps, &min_ps})
    ROSECHAT_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows && t->is_contiguous(), "per-row float32 [rows]");
  ROSECHAT_CHECK(top_ks.scalar_type() == at::kLong && top_ks.numel() == rows, "top_ks: int64 [rows]");
  ROSECHAT_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == rows, "uniforms: float64 [rows]");
  ROSECHAT_CHECK(seen.scalar_type() == at::kLong && seen_offsets.scalar_type() == at::kLong &&
              seen_offsets.numel() == rows + 1 && seen.is_contiguous(), "seen: int64 ids, seen_offsets [rows + 1]");
  const int64_t* off = seen_offsets.data_ptr<int64_t>();
  const int64_t* ids = seen.data_ptr<int64_t>();
  ROSECHAT_CHECK(off[rows] <= seen.numel(), "seen_offsets past the ids");
  for (int64_t j = 0; j < off[rows]; ++j) ROSECHAT_CHECK(ids[j] >= 0 && ids[j] < n, "a seen id outside the vocabulary");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const float *pen = penalties.data_ptr<float>(), *temp = temperatures.data_ptr<float>();
  const float *tp = top_ps.data_ptr<float>(), *mp = min_ps.data_ptr<float>();
  const int64_t* tk = top_ks.data_ptr<int64_t>();
  const double* us = uniforms.data_ptr<double>();
  rosechat::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> w;
    thread_local std::vector<Cand> cand;
    for (int64_t r = begin; r < end; ++r)
      o[r] = sample_row(x + r * n, n, ids + off[r], off[r + 1] - off[r], pen[r], temp[r], tk[r], tp[r], mp[r], us[r],
                        w, cand);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rosechat_layers, lib) {
  lib.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  lib.def("sample_rows(Tensor logits, Tensor seen, Tensor seen_offsets, Tensor penalties, Tensor temperatures, "
          "Tensor top_ks, Tensor top_ps, Tensor min_ps, Tensor uniforms) -> Tensor", &sample_rows);
}
