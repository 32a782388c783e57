// The tiles of the blocked linears (quant.cpp, quant_k.cpp): 8 outputs at a time, one weight
// format's rows (quant.h's formats and theirs) against x quantized per block; blocked_linear
// (linear.h) spreads them over the pool's threads; outer.h has the tiles of several rows of x.
#pragma once

#include <atomic>

#include "quant.h"

namespace rosechat::quant {

// Whether one-row tiles run on 512-bit vectors (tile_wide), and outer tiles two groups at a time: set
// through quant.cpp's tile_bits (the load's timing, kernels/cpu/tiles.py, or a test)
inline std::atomic<bool>& wide_tiles_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
// Whether several rows of x take the outer tiles (tile_outer, the avx512 variant): on unless a test
// compares them with the folding tiles (quant.cpp's outer_tiles)
inline std::atomic<bool>& outer_tiles_flag() {
  static std::atomic<bool> flag{true};
  return flag;
}

// The group's unit kPrefetch bytes on from block b's (row: the group's first row): a span of kSpanBlocks
// blocks takes kSpanUnits 32-byte units (q6k: 8 blocks, 6 units), so its first blocks fetch them
template <typename W>
inline void prefetch(const uint8_t* row, int64_t stride, int64_t b) {
  if (b % W::kSpanBlocks < W::kSpanUnits) {
    const int64_t u = b / W::kSpanBlocks * W::kSpanUnits + b % W::kSpanBlocks;
    const char* unit = reinterpret_cast<const char*>(row + u * stride);
    for (int line = 0; line < 4; ++line) _mm_prefetch(unit + kPrefetch + 64 * line, _MM_HINT_T0);
  }
}

// Weight rows o..o+R (within one group of 8) against x rows r0..r0+T, R * T = 8: lane i * T + t of one
// accumulator holds output (o + i, r0 + t). Per block, each lane adds its exact integer block sum times
// (weight scale * x scale) in one FMA (per part: Q6's two halves, two), and with an offset m its
// m * sum(x) in another, whatever R and T are: a sequence's result does not depend on the batch
// around it (batch invariance). Rows past n (the last group's) repeat row n - 1, unstored.
template <int R, int T, typename W>
inline void tile(const W& w, const QuantizedRows& xq, int64_t o, int64_t r0, float* y) {
  static_assert(R * T == kLanes);
  constexpr int P = W::kParts;
  const int64_t n = w.n, nb = w.nb;
  const uint8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = w.row(std::min(o + i, n - 1));
  const int64_t stride = w.stride(o);
  const int16_t* x = xq.q + r0 * kBlock;
  const float* xd = xq.d + r0;
  const float* xs = xq.s + r0;
  int w_lane[kLanes], x_lane[kLanes];
  for (int l = 0; l < kLanes; ++l) w_lane[l] = o % kLanes + l / T, x_lane[l] = l % T;
  const __m256i w_index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_lane));
  const __m256i x_index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_lane));
  __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();  // two chains of FMAs, not one
  for (int64_t b = 0; b < nb; ++b) {
    const int16_t* xb = x + b * xq.rows * kBlock;  // block b of x row r0, row r0 + t 32 values on
    if constexpr (T == 1) prefetch<W>(rows[0], stride, b);  // wider tiles revisit units: no need
    Sums<P> total;  // output l = i * T + t: weight row i times x row t
    if constexpr (T == 1) {  // 8 rows: sums folded as they come (8 live sums and rows would spill)
      const auto sum = [&](int i) {
        __m256i lo, hi;
        W::widen(rows[i], stride, b, lo, hi);
        return dots<P>(lo, hi, xb);
      };
      const auto pair_at = [&](int i) { const Sums<P> a = sum(i); return pair(a, sum(i + 1)); };
      const auto quad_at = [&](int i) { const Sums<P> p = pair_at(i); return quad(p, pair_at(i + 2)); };
      total = totals(quad_at(0), quad_at(4));
    } else {  // every sum, then the transpose (measured faster where rows of x share a widened row)
      Sums<P> s[kLanes];
      for (int i = 0; i < R; ++i) {
        __m256i lo, hi;
        W::widen(rows[i], stride, b, lo, hi);
        for (int t = 0; t < T; ++t) s[i * T + t] = dots<P>(lo, hi, xb + t * kBlock);
      }
      total = totals(quad(pair(s[0], s[1]), pair(s[2], s[3])), quad(pair(s[4], s[5]), pair(s[6], s[7])));
    }
    const __m256 x_scale = lanes<T>(xd + b * xq.stride, x_index);
    for (int p = 0; p < P; ++p)
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total.v[p]), _mm256_mul_ps(w.template scale<R>(o, b, p, w_index), x_scale),
                            acc);
    if constexpr (W::kOffset)  // the block's m * sum(x)
      offsets = _mm256_fmadd_ps(w.template offset<R>(o, b, w_index), lanes<T>(xs + b * xq.stride, x_index), offsets);
  }
  float out[kLanes];
  _mm256_storeu_ps(out, _mm256_add_ps(acc, offsets));
  for (int i = 0; i < R && o + i < n; ++i)
    for (int t = 0; t < T; ++t) y[(r0 + t) * n + o + i] = out[i * T + t];
}

#ifdef ROSECHAT_AVX512
// A one-row tile on 512-bit vectors: a load holds unit u of two neighbouring rows of a group, so one
// widen, one multiply-add and one VNNI multiply-add serve two rows, and the fold is half as long (on a
// CPU with 512-bit units, ~1.75x fewer instructions a block than tile<8, 1>). The integer sums are
// the same integers, folded in another order, and scaled by the very same FMAs: bit for bit
// tile<8, 1>'s result. Where 512-bit operations are split in two (Zen 4) it measured slower:
// kernels/cpu/tiles.py times both once and keeps the faster. For a format with a widen512 and one part.
template <typename W>
concept WideFormat = W::kParts == 1 && requires(const uint8_t* p, __m512i v) { W::widen512(p, int64_t{}, int64_t{}, v, v); };

inline __m512i pair(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i quad(__m512i p, __m512i q) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
}

// Weight rows o..o+8 (one whole group) against x row r0
template <typename W>
inline void tile_wide(const W& w, const QuantizedRows& xq, int64_t o, int64_t r0, float* y) {
  const uint8_t* rows = w.row(o);  // rows o + 2i and o + 2i + 1: 64 bytes at rows + 64 i
  const int64_t nb = w.nb, stride = w.stride(o);
  const int16_t* x = xq.q + r0 * kBlock;
  const float* xd = xq.d + r0;
  const float* xs = xq.s + r0;
  // the fold leaves lane l of 128-bit lane 0 row 2l's total and of lane 2 row 2l + 1's: back in order
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i w_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);  // unused by 8-row scale loads
  __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int16_t* xb = x + b * xq.rows * kBlock;
    prefetch<W>(rows, stride, b);
    const __m512i x_lo = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
    const __m512i x_hi = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
    const auto sum = [&](int i) {  // rows 2i and 2i + 1: 8 partial sums each
      __m512i lo, hi;
      W::widen512(rows + 64 * i, stride, b, lo, hi);
      return _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, x_lo), hi, x_hi);
    };
    const __m512i p0 = pair(sum(0), sum(1)), p1 = pair(sum(2), sum(3));
    const __m512i q = quad(p0, p1);  // 128-bit lane k: rows (0, 2, 4, 6) for k = 0, 1, (1, 3, 5, 7) for 2, 3
    const __m512i t = _mm512_add_epi32(q, _mm512_shuffle_i32x4(q, q, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256i total = _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, t));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(w.template scale<kLanes>(o, b, 0, w_index),
                                                                   _mm256_set1_ps(xd[b * xq.stride])), acc);
    if constexpr (W::kOffset)
      offsets = _mm256_fmadd_ps(w.template offset<kLanes>(o, b, w_index), _mm256_set1_ps(xs[b * xq.stride]), offsets);
  }
  _mm256_storeu_ps(y + r0 * w.n + o, _mm256_add_ps(acc, offsets));  // y is [rows, n]: 8 outputs in a row
}
#endif

// Weight rows [o_begin, o_end) (whole groups of 8) against x rows r0..r0+T, in tiles of 8 / T weight rows.
template <int T, typename W>
void row_tiles(const W& w, const QuantizedRows& xq, int64_t o_begin, int64_t o_end, int64_t r0, float* y) {
  int64_t o = o_begin;
#ifdef ROSECHAT_AVX512
  if constexpr (T == 1 && WideFormat<W>) {
    if (wide_tiles_flag().load(std::memory_order_relaxed))
      for (; o + kLanes <= std::min(o_end, w.n); o += kLanes) tile_wide(w, xq, o, r0, y);  // whole groups
  }
#endif
  for (; o < std::min(o_end, w.n); o += kLanes / T) tile<kLanes / T, T>(w, xq, o, r0, y);
}

}  // namespace rosechat::quant
