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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_f32(const at::Tensor& t, const char* what) {
  ROSECHAT_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": a float32 CPU tensor");
  ROSECHAT_CHECK(t.stride(-1) == 1, what, ": the last dim must be contiguous");
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x, Cephes' expf polynomial (within 2 ulp), 8 lanes; x <= -88 gives about 0
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

inline float exp1(float x) {  // the same polynomial as exp8, for tails
  float lanes[8];
  _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(x)));
  return lanes[0];
}

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
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({n, Hq}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k_rows.data_ptr<float>(), *vp = v_rows.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  rosechat::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / Hkv, h = job % Hkv, len = cp[i];
      const int64_t* seq_slots = sp + i * L;
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
        lp[i * Hq + h * G + g] = top + std::log(total);
      }
      const float* values = vp + h * D;
      const float* p = scores.data();
      float* o = op + (i * Hq + h * G) * D;
      int64_t g = 0;
      for (; g + 3 <= G; g += 3) weigh_values<3>(p + g * len, len, values, seq_slots, Hkv * D, D, o + g * D);
      if (G - g == 2) weigh_values<2>(p + g * len, len, values, seq_slots, Hkv * D, D, o + g * D);
      if (G - g == 1) weigh_values<1>(p + g * len, len, values, seq_slots, Hkv * D, D, o + g * D);
    }
  });
  return {out, lse};
}

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
// partial selection; top-p on the few tokens that can be in the nucleus (a token whose weight is at
// most (1 - p) * Z / n can never be: those together weigh at most (1 - p) * Z), cut down further by
// bisection on the weight while many remain, then sorted; min-p against the top token's weight (1).
// The draw walks the kept tokens in vocabulary order to u * (their total): one uniform u per row,
// from the row's own generator, as Sampler._draw_torch does.

struct Cand {
  float w;
  int64_t id;
};

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
  const float inv_t = 1.0f / temperature;
  const __m256 vmax = _mm256_set1_ps(mx), vinv = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(-87.0f);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax), vinv);
    const __m256 e = _mm256_and_ps(exp8(z), _mm256_cmp_ps(z, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(w.data() + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  double total = hsum(acc);
  for (; i < n; ++i) {
    const float z = (x[i] - mx) * inv_t;
    w[i] = z >= -87.0f ? exp1(z) : 0.0f;
    total += w[i];
  }
  const float keep_from = min_p > 0.0f ? min_p : 0.0f;  // min-p: weight below min_p * 1 is dropped
  cand.clear();
  if (top_k > 0 && top_k < n) {  // top-k: the k heaviest (ties: any k of them, as a sort would)
    cand.resize(n);
    for (int64_t j = 0; j < n; ++j) cand[j] = {w[j], j};
    std::nth_element(cand.begin(), cand.begin() + (top_k - 1), cand.end(),
                     [](const Cand& a, const Cand& b) { return a.w > b.w; });
    cand.resize(top_k);
    total = 0.0;
    for (const Cand& c : cand) total += c.w;
  }
  if (top_p < 1.0f) {
    const double need = top_p * total;  // the nucleus: tokens while the mass before them is < need
    if (cand.empty()) {
      const float eps = static_cast<float>((1.0 - top_p) * total / n);
      for (int64_t j = 0; j < n; ++j)
        if (w[j] > eps) cand.push_back({w[j], j});
    }
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
    std::sort(cand.begin(), cand.end(), [](const Cand& a, const Cand& b) { return a.w > b.w; });
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

TORCH_LIBRARY(rosechat_layers, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  lib.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  lib.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rotary_);
  lib.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  lib.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()", &write_kv);
  lib.def("decode_attention(Tensor q, Tensor k_rows, Tensor v_rows, Tensor slots, Tensor counts, float scale) "
          "-> (Tensor, Tensor)", &decode_attention);
  lib.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  lib.def("sample_rows(Tensor logits, Tensor seen, Tensor seen_offsets, Tensor penalties, Tensor temperatures, "
          "Tensor top_ks, Tensor top_ps, Tensor min_ps, Tensor uniforms) -> Tensor", &sample_rows);
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
