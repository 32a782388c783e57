// Weight-only quantized linear layers for x86 CPUs with AVX2: y = x @ W.T with W kept in blocks of 32.
//
//   q4: w = q * d + m,  q in 0..15 (GGUF Q4_0 with m = -8d, Q4_1, and Q4_K's 32-weight sub-blocks map
//       onto it exactly). A row's blocks go in pairs: byte 2j of a pair is byte j of the first block
//       in GGML order (element j low nibble, element j + 16 high), byte 2j + 1 byte j of the second,
//       so one 16-bit lane holds element j of both halves of both blocks: shifts and masks widen
//       them, no byte shuffles (cpu_ops.pack_q4 interleaves GGML bytes so; a lone last block is
//       paired with zeros)
//   q8: w = q * d,      q in -127..127 (GGUF Q8_0 exactly; Q5/Q6 blocks requantized per 32). A
//       block's byte 2j is element j, byte 2j + 1 element j + 16 (cpu_ops.pack_q8): shifts widen them
//
// As in llama.cpp, each row of x is quantized per block of 32 and every block dot product runs on
// integers, scaled once per block. Unlike llama.cpp, x is quantized to int16, not int8: its error is
// then far below the weights' own (an 8-bit x flips near-tied greedy tokens that fp32 gets right),
// and vpmaddwd on 16-bit pairs costs about what the 4-bit unpacking does. Memory traffic is the
// packed weight itself, a sixth (q4) or a third (q8) of the fp32 matrix.
//
// Built at first use by torch.utils.cpp_extension (kernels/cpu_ops.py). Parallel over output rows
// through cpu_pool.h, so it honours torch.set_num_threads.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_pool.h"

#include <algorithm>

namespace {

constexpr int64_t kBlock = 32;
// Accumulators a tile keeps in registers: weight rows x rows of x. Up to 8 rows of x share one
// widened weight block (8 x 1 measured 1.5-2x faster at 8 rows than 2 x 4); more spill.
constexpr int kAccumulators = 8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x quantized per block of 32: q int16 [M, K], d the block scales, s = d * sum(q) (the q4 offset term)
struct QuantizedRows {
  at::Tensor q, d, s;
};

void quantize_row(const float* x, int64_t k, int16_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / kBlock; ++b, x += kBlock, q += kBlock) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // rounds to nearest
    // packs works within 128-bit lanes: the 64-bit permute puts the 16 values back in order
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), hi);
    d[b] = top / 32767.0f;
    s[b] = d[b] * hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))));
  }
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock;
  QuantizedRows out{at::empty({rows, k}, x.options().dtype(at::kShort)), at::empty({rows, nb}, x.options()),
                    at::empty({rows, nb}, x.options())};
  const float* xp = x.data_ptr<float>();
  int16_t* qp = out.q.data_ptr<int16_t>();
  float *dp = out.d.data_ptr<float>(), *sp = out.s.data_ptr<float>();
  rosechat::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, qp + r * k, dp + r * nb, sp + r * nb);
  });
  return out;
}

// int32 sums of a block's 32 products, as floats: weights widened to int16 (lo: elements 0-15, hi: 16-31)
inline __m256 block_dot(__m256i w_lo, __m256i w_hi, const int16_t* x) {
  const __m256i a = _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  const __m256i b = _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}

inline float dot_f32(const float* a, const float* b, int64_t len) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (; i < len; ++i) sum += a[i] * b[i];
  return sum;
}

// The weight formats: how a row's block b widens to two int16 halves, and the per-row offset term.
struct Q4 {
  static constexpr int kMaxOutTile = 4;  // weight rows sharing one loaded x block
  const uint8_t* q;
  const float *d, *m;
  int64_t nb;
  inline void widen(int64_t row, int64_t b, __m256i& lo, __m256i& hi) const {
    const int64_t row_bytes = (nb + 1) / 2 * 32;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + row * row_bytes + b / 2 * 32));
    const __m256i low = _mm256_set1_epi16(0x0F);
    if (b % 2 == 0) {  // the pair's first block: the low byte of every lane
      lo = _mm256_and_si256(v, low);
      hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    } else {
      lo = _mm256_and_si256(_mm256_srli_epi16(v, 8), low);
      hi = _mm256_srli_epi16(v, 12);
    }
  }
  inline float offset(int64_t row, const float* xs) const { return dot_f32(m + row * nb, xs, nb); }
};

struct Q8 {
  static constexpr int kMaxOutTile = 1;  // more measured slower for q8 (more streams of twice the bytes)
  const int8_t* q;
  const float* d;
  int64_t nb;
  inline void widen(int64_t row, int64_t b, __m256i& lo, __m256i& hi) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (row * nb + b) * kBlock));
    lo = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);  // the low byte of each lane, sign-extended
    hi = _mm256_srai_epi16(v, 8);
  }
  inline float offset(int64_t, const float*) const { return 0.0f; }
};

// Weight rows o..o+R against x rows r0..r0+T (both compile-time: the accumulators stay in registers).
template <int R, int T, typename W>
inline void tile(const W& w, const QuantizedRows& xq, int64_t o, int64_t r0, float* y, int64_t n) {
  const int64_t nb = w.nb, k = nb * kBlock;
  const int16_t* xq_p = xq.q.data_ptr<int16_t>() + r0 * k;
  const float* xd = xq.d.data_ptr<float>() + r0 * nb;
  const float* xs = xq.s.data_ptr<float>() + r0 * nb;
  __m256 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < R; ++i) {
      __m256i lo, hi;
      w.widen(o + i, b, lo, hi);
      const float wd = w.d[(o + i) * nb + b];
      for (int t = 0; t < T; ++t)
        acc[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * xd[t * nb + b]), block_dot(lo, hi, xq_p + t * k + b * kBlock),
                                    acc[i][t]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) y[(r0 + t) * n + o + i] = hsum(acc[i][t]) + w.offset(o + i, xs + t * nb);
}

// Weight rows [o_begin, o_end) against x rows r0..r0+T, in tiles of R weight rows.
template <int T, typename W>
void row_tile(const W& w, const QuantizedRows& xq, int64_t o_begin, int64_t o_end, int64_t r0, float* y, int64_t n) {
  constexpr int R = std::min(W::kMaxOutTile, kAccumulators / T);
  int64_t o = o_begin;
  for (; o + R <= o_end; o += R) tile<R, T>(w, xq, o, r0, y, n);
  for (; o < o_end; ++o) tile<1, T>(w, xq, o, r0, y, n);
}

// Every row of x takes the same operations in the same order whatever tile it falls in, so a
// sequence's result does not depend on the batch around it (batch invariance).
template <typename W>
at::Tensor blocked_linear(const at::Tensor& x, const W& w, int64_t n) {
  const int64_t rows = x.size(0);
  const QuantizedRows xq = quantize_rows(x);
  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  constexpr int64_t kOutBlock = 16;  // weight rows that stay in cache while every tile of x passes them
  rosechat::parallel_for(0, n, kOutBlock, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; o += kOutBlock) {
      const int64_t o_end = std::min(end, o + kOutBlock);
      int64_t r0 = 0;
      for (; r0 + 8 <= rows; r0 += 8) row_tile<8>(w, xq, o, o_end, r0, yp, n);
      if (rows - r0 >= 4) row_tile<4>(w, xq, o, o_end, r0, yp, n), r0 += 4;
      if (rows - r0 >= 2) row_tile<2>(w, xq, o, o_end, r0, yp, n), r0 += 2;
      if (rows - r0 >= 1) row_tile<1>(w, xq, o, o_end, r0, yp, n);
    }
  });
  return y;
}

void check(const at::Tensor& x, int64_t n, int64_t k, std::initializer_list<at::Tensor> scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) == k && k % kBlock == 0, "x has ", x.size(1), " columns; the weight takes ", k);
  for (const auto& s : scales)
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == n * (k / kBlock),
                "block scales: contiguous float32 [N, K/32]");
}

// x [M, K] float32; qs uint8 [N, ceil(K/64) * 32] (block pairs); d, m float32 [N, K/32] -> [M, N] float32
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(d.dim() == 2 && qs.dim() == 2, "q4 weight [N, ceil(K/64) * 32], block scales [N, K/32]");
  const int64_t n = qs.size(0), k = d.size(1) * kBlock;  // the scales count the blocks
  check(x, n, k, {d, m});
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.size(1) == (k / kBlock + 1) / 2 * 32,
              "q4 weight: contiguous uint8 [N, ceil(K/64) * 32] (cpu_ops.pack_q4), K = ", k);
  return blocked_linear(x, Q4{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), k / kBlock}, n);
}

// x [M, K] float32; qs int8 [N, K] (pack_q8's order); d float32 [N, K/32] -> [M, N] float32
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  const int64_t n = qs.size(0), k = qs.size(1);
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous(), "q8 weight: contiguous int8 [N, K]");
  check(x, n, k, {d});
  return blocked_linear(x, Q8{qs.data_ptr<int8_t>(), d.data_ptr<float>(), k / kBlock}, n);
}

}  // namespace

TORCH_LIBRARY(rosechat_quant, lib) {
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor", &q4_linear);
  lib.def("q8_linear(Tensor x, Tensor qs, Tensor d) -> Tensor", &q8_linear);
}
