// The small float32 layers of a CPU decode step, fused: RMSNorm (with the residual add), RoPE,
// SiLU * up, the K/V cache write and one-query paged attention.
//
// At one sequence a decode step's math is small and the packed linears stream the weights; what is
// left is some twenty ATen calls per layer, each a few microseconds of dispatch and temporaries
// (RMSNorm alone is six of them on CPU). Each op here is one call doing one pass over its rows.
// Every row (token, or sequence and KV head) is computed on its own, so results do not depend on
// the batch. Built with quant.cpp into one extension (kernels/cpu/ops.py).
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

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// q . key for 8 keys: one accumulator per key (8 independent FMA chains), summed across lanes together
inline void key_scores(const float* q, const float* const* keys, int64_t D, float* out) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= D; e += 8) {
    const __m256 qv = _mm256_loadu_ps(q + e);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[t] + e), acc[t]);
  }
  // a hadd tree leaves lane t holding half of key t's sum in each 128-bit half
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  for (; e < D; ++e)
    for (int t = 0; t < 8; ++t) out[t] += q[e] * keys[t][e];
}

// out[g] = sum_j p[g][j] * value_j for NG query heads sharing a KV head: each value vector is loaded
// once for all of them (a head's values outgrow L1 past ~100 keys, and L2 then bounds the loop).
// p: NG rows of len probabilities; value_j at values + slots[j] * stride; out: NG rows of D.
template <int NG>
void weigh_values(const float* p, int64_t len, const float* values, const int64_t* slots, int64_t stride,
                  int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {  // NG x 4 accumulators stay in registers across the keys
    __m256 acc[NG][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const float* v = values + slots[j] * stride + d;
      for (int c = 0; c < 4; ++c) {
        const __m256 vc = _mm256_loadu_ps(v + 8 * c);
        for (int g = 0; g < NG; ++g) acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * len + j]), vc, acc[g][c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + g * D + d + 8 * c, acc[g][c]);
  }
  for (int g = 0; g < NG && d < D; ++g) {  // head sizes that are not a multiple of 32
    float* o = out + g * D;
    std::fill(o + d, o + D, 0.0f);
    for (int64_t j = 0; j < len; ++j) {
      const float* v = values + slots[j] * stride;
      const float w = p[g * len + j];
      int64_t e = d;
      for (; e + 8 <= D; e += 8)
        _mm256_storeu_ps(o + e, _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(v + e), _mm256_loadu_ps(o + e)));
      for (; e < D; ++e) o[e] += w * v[e];
    }
  }
}

// out = x / rms(x) * w, one row
inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv)));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  check_f32(x, "x");
  check_f32(w, "weight");
  ROSECHAT_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [T, N]");
  ROSECHAT_CHECK(w.dim() == 1 && w.size(0) == x.size(1), "weight: [N] for x's N = ", x.size(1));
}

// x [T, N] -> RMSNorm(x) * w
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  rosechat::parallel_for(0, x.size(0), 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * n, wp, static_cast<float>(eps), n, op + t * n);
  });
  return out;
}

// residual += x, then x = RMSNorm(residual) * w: both in place (the pre-norm block's seam)
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, w);
  check_rows(residual, w);
  ROSECHAT_CHECK(x.sizes() == residual.sizes(), "x and residual: the same shape");
  const int64_t n = x.size(1);
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  rosechat::parallel_for(0, x.size(0), 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float *xr = xp + t * n, *rr = rp + t * n;
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      norm_row(rr, wp, static_cast<float>(eps), n, xr);
    }
  });
}

// Neox RoPE in place on x [T, H, D] (any strides but the last): halves (a, b) -> (a c - b s, b c + a s)
void rope_rows(at::Tensor& x, const float* cos, const float* sin, int64_t cs_stride) {
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  float* xp = x.data_ptr<float>();
  rosechat::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
      for (int64_t h = 0; h < H; ++h) {
        float *a = xp + t * st + h * sh, *bb = a + half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(bb + i);
          const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
          _mm256_storeu_ps(a + i, _mm256_sub_ps(_mm256_mul_ps(va, vc), _mm256_mul_ps(vb, vs)));
          _mm256_storeu_ps(bb + i, _mm256_add_ps(_mm256_mul_ps(vb, vc), _mm256_mul_ps(va, vs)));
        }
        for (; i < half; ++i) {
          const float va = a[i], vb = bb[i];
          a[i] = va * c[i] - vb * s[i];
          bb[i] = vb * c[i] + va * s[i];
        }
      }
    }
  });
}

// q [T, Hq, D] and k [T, Hk, D] rotated in place; cos, sin [T, D/2] (or [T, 1, D/2])
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto* t : {&q, &k}) {
    check_f32(*t, "q/k");
    ROSECHAT_CHECK(t->dim() == 3 && t->size(2) % 2 == 0 && t->size(0) == cos.size(0), "q/k: [T, H, D], D even");
  }
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t half = q.size(2) / 2;
  ROSECHAT_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * half &&
                  sin.numel() == cos.numel() && k.size(2) == q.size(2), "cos/sin: contiguous [T, D/2]");
  rope_rows(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  rope_rows(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
}

// x [T, 2I] (gate | up) -> silu(gate) * up [T, I]
at::Tensor silu_mul(const at::Tensor& x) {
  check_f32(x, "x");
  ROSECHAT_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x: contiguous [T, 2I]");
  const int64_t inter = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  rosechat::parallel_for(0, x.size(0), 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *g = xp + t * 2 * inter, *u = g + inter;
      float* o = op + t * inter;
      int64_t i = 0;
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 vg = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(vg, _mm256_add_ps(one, exp8(_mm256_xor_ps(vg, sign))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
      }
      for (; i < inter; ++i) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
  });
  return out;
}

// k, v [T, Hkv, D] (rows may be strided views of a qkv output) into caches [blocks, block_size, Hkv, D]
// at slots [T] int64; slot -1 is skipped
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  for (const at::Tensor* t : {&k, &v, static_cast<const at::Tensor*>(&k_cache), static_cast<const at::Tensor*>(&v_cache)})
    check_f32(*t, "k/v and caches");
  ROSECHAT_CHECK(k.dim() == 3 && k.stride(1) == k.size(2) && v.sizes() == k.sizes() && v.stride(1) == v.size(2),
              "k, v: [T, Hkv, D], each token's heads contiguous");
  ROSECHAT_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(-1) * k_cache.size(-2) == k.size(1) * k.size(2), "caches: contiguous, k's row size");
  ROSECHAT_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots: contiguous int64 [T]");
  const int64_t row = k.size(1) * k.size(2), capacity = k_cache.numel() / row;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    const int64_t s = sp[t];
    if (s < 0) continue;
    ROSECHAT_CHECK(s < capacity, "slot ", s, " is past the cache's ", capacity, " slots");
    std::copy_n(k.data_ptr<float>() + t * k.stride(0), row, k_cache.data_ptr<float>() + s * row);
    std::copy_n(v.data_ptr<float>() + t * v.stride(0), row, v_cache.data_ptr<float>() + s * row);
  }
}

// One query per sequence against the keys at its slots: q [n, Hq, D]; k_rows, v_rows [S, Hkv * D];
// slots [n, L] int64, of which sequence i attends the first counts[i] (>= 1). Returns out [n, Hq, D]
// and the log-sum-exp of each row's scaled scores [n, Hq] (to merge with a shared prefix's part).
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_rows,
                                                    const at::Tensor& v_rows, const at::Tensor& slots,
                                                    const at::Tensor& counts, double scale) {
  for (const auto* t : {&q, &k_rows, &v_rows}) {
    check_f32(*t, "q and the caches");
    ROSECHAT_CHECK(t->is_contiguous(), "q and the caches: contiguous");
  }
  ROSECHAT_CHECK(q.dim() == 3 && k_rows.dim() == 2 && v_rows.sizes() == k_rows.sizes(), "q [n, Hq, D], rows [S, Hkv*D]");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), S = k_rows.size(0);
  const int64_t Hkv = k_rows.size(1) / D;
  ROSECHAT_CHECK(Hkv > 0 && Hkv * D == k_rows.size(1) && Hq % Hkv == 0, "the rows hold whole heads, Hq a multiple");
  ROSECHAT_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == n && slots.is_contiguous(),
              "slots: contiguous int64 [n, L]");
  ROSECHAT_CHECK(counts.scalar_type() == at::kLong && counts.numel() == n && counts.is_contiguous(), "counts: int64 [n]");
  const int64_t L = slots.size(1), G = Hq / Hkv;
  const int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    ROSECHAT_CHECK(cp[i] >= 1 && cp[i] <= L, "sequence ", i, ": ", cp[i], " keys of ", L, " slots");
    for (int64_t j = 0; j < cp[i]; ++j)
      ROSECHAT_CHECK(sp[i * L + j] >= 0 && sp[i * L + j] < S, "slot ", sp[i * L + j], " is outside the cache");
  }
  // Jobs: a sequence's KV head over a part of its keys. A long sequence's keys are cut into parts of at most
  // kPartKeys (256): one sequence's 3 KV heads (SmolLM2) left a thread of two idle a third of the time, at 1,300 keys
  // 175 us a layer. The parts depend on the sequence's own length only (batch invariance); a sequence of one
  // part is computed as before, bit for bit, and parts merge by their log-sum-exp in part order.
  constexpr int64_t kPartKeys = 256;
  std::vector<int64_t> parts(n), first_job(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    parts[i] = (cp[i] + kPartKeys - 1) / kPartKeys;
    first_job[i + 1] = first_job[i] + parts[i] * Hkv;
  }
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({n, Hq}, q.options());
  const bool split = first_job[n] > n * Hkv;
  // the parts' own outputs and log-sum-exps [job, G, D], [job, G] where a sequence has several
  std::vector<float> part_out(split ? first_job[n] * G * D : 0), part_lse(split ? first_job[n] * G : 0);
  const float *qp = q.data_ptr<float>(), *kp = k_rows.data_ptr<float>(), *vp = v_rows.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // every job a chunk of its own, claimed as threads come free (jobs differ in size: the last part is short)
  rosechat::parallel_for(0, first_job[n], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = std::upper_bound(first_job.begin(), first_job.end(), job) - first_job.begin() - 1;
      const int64_t h = (job - first_job[i]) % Hkv, part = (job - first_job[i]) / Hkv;
      const int64_t a = part * kPartKeys, len = std::min(cp[i], a + kPartKeys) - a;
      const int64_t* seq_slots = sp + i * L + a;
      scores.resize(G * len);
      const float* q_group = qp + (i * Hq + h * G) * D;
      for (int64_t j0 = 0; j0 < len; j0 += 8) {  // 8 keys at a time, each read once for the G query heads
        const int m = static_cast<int>(std::min<int64_t>(8, len - j0));
        const float* keys[8];
        for (int t = 0; t < 8; ++t) keys[t] = kp + seq_slots[j0 + std::min(t, m - 1)] * Hkv * D + h * D;
        for (int64_t g = 0; g < G; ++g) {
          float block[8];
          key_scores(q_group + g * D, keys, D, block);
          for (int t = 0; t < m; ++t) scores[g * len + j0 + t] = block[t] * fscale;
        }
      }
      // one part: straight into out and lse; several: into the parts' own, merged below
      float* o = parts[i] == 1 ? op + (i * Hq + h * G) * D : part_out.data() + job * G * D;
      float* l = parts[i] == 1 ? lp + i * Hq + h * G : part_lse.data() + job * G;
      for (int64_t g = 0; g < G; ++g) {  // softmax: scores become probabilities
        float* s = scores.data() + g * len;
        const float top = *std::max_element(s, s + len);
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= len; j += 8) {
          const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
          _mm256_storeu_ps(s + j, p);
          acc = _mm256_add_ps(acc, p);
        }
        float total = hsum(acc);
        for (; j < len; ++j) total += (s[j] = exp1(s[j] - top));
        const float inv = 1.0f / total;
        for (j = 0; j < len; ++j) s[j] *= inv;
        l[g] = top + std::log(total);
      }
      const float* values = vp + h * D;
      const float* p = scores.data();
      int64_t g = 0;
      for (; g + 3 <= G; g += 3) weigh_values<3>(p + g * len, len, values, seq_slots, Hkv * D, D, o + g * D);
      if (G - g == 2) weigh_values<2>(p + g * len, len, values, seq_slots, Hkv * D, D, o + g * D);
      if (G - g == 1) weigh_values<1>(p + g * len, len, values, seq_slots, Hkv * D, D, o + g * D);
    }
  }, /*per_thread=*/64);
  for (int64_t i = 0; i < n; ++i) {  // merge: out = sum over parts of exp(lse_p - lse) * out_p
    if (parts[i] == 1) continue;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const auto at = [&](int64_t part) { return (first_job[i] + part * Hkv + h) * G + g; };
        float top = -INFINITY, total = 0.0f;
        for (int64_t part = 0; part < parts[i]; ++part) top = std::max(top, part_lse[at(part)]);
        float* o = op + (i * Hq + h * G + g) * D;
        std::fill_n(o, D, 0.0f);
        for (int64_t part = 0; part < parts[i]; ++part) {
          const float w = std::exp(part_lse[at(part)] - top);
          const float* src = part_out.data() + at(part) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * src[d];
          total += w;
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        lp[i * Hq + h * G + g] = top + std::log(total);
      }
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(rosechat_layers, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  lib.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  lib.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rotary_);
  lib.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  lib.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()", &write_kv);
  lib.def("decode_attention(Tensor q, Tensor k_rows, Tensor v_rows, Tensor slots, Tensor counts, float scale) "
          "-> (Tensor, Tensor)", &decode_attention);
}

#ifdef ROSECHAT_KERNEL_KEY
// A build made at install (setup.py) carries the source key it was built from (kernels/cpu/ops.py
// source_key), which the loader reads from the file's bytes, without loading it, and compares with the
// sources it has: a module of other sources (a kernel edited since the install) is never loaded.
#define ROSECHAT_STR2(x) #x
#define ROSECHAT_STR(x) ROSECHAT_STR2(x)
extern "C" __attribute__((used, visibility("default")))
const char rosechat_kernel_key[] = "rosechat-kernel-key:" ROSECHAT_STR(ROSECHAT_KERNEL_KEY);
#endif
