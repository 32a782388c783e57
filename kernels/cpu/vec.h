// What the float32 kernels of layers.cpp and sample.cpp share: input checks, a horizontal sum, e^x on 8 lanes.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include "check.h"

namespace rosechat::vec {

inline void check_f32(const at::Tensor& t, const char* what) {
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

}  // namespace rosechat::vec
