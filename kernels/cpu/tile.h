// The tiles of the blocked linears (quant.cpp, quant_k.cpp): 8 outputs at a time, one weight
// format's rows (quant.h's formats and theirs) against x quantized per block; blocked_linear
// spreads them over the pool's threads.
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

// Several rows of x (a prefill chunk, a speculative check, a batch of decodes): the tiles above fold
// each weight row's 8 partial sums per block and row of x, work that grows with the rows of x. Here
// the weight rows are turned instead, once a block for every row of x: widened as the one-row tiles
// widen them, then transposed so that lane r of vector m holds pair m (elements 2m, 2m + 1) of row r,
// and each row of x adds 16 VNNI multiply-adds a block, its pairs broadcast from memory, straight into
// the block sums of 8 (16 on 512-bit vectors) weight rows: no fold. The sums are the same integers and
// are scaled by the same FMAs in the same order as tile's: the same bits, batch invariance kept.
using Pair = int32_t __attribute__((may_alias));  // two int16 values of x, read as one (embedded broadcast)

template <int N>  // lanes: weight rows a vector holds (8: 256-bit vectors, one group; 16: 512-bit, two)
struct Lanes;

template <>
struct Lanes<8> {
  using I = __m256i;
  using F = __m256;
  static I pick(I a, I index, I b) { return _mm256_permutex2var_epi32(a, index, b); }
  static I steps(int first) { return _mm256_setr_epi32(first, first + 2, first + 4, first + 6, first + 8, first + 10,
                                                        first + 12, first + 14); }
  static I dot(I acc, I w, const int16_t* x) {
    return _mm256_dpwssd_epi32(acc, w, _mm256_set1_epi32(*reinterpret_cast<const Pair*>(x)));
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I set16(int16_t v) { return _mm256_set1_epi16(v); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I srai16(I a, int n) { return _mm256_srai_epi16(a, n); }
  // vector i: unit u of row o + i (rows past n repeat row n - 1)
  template <typename W>
  static void units(const W& w, int64_t o, int64_t stride, int64_t u, I d[8]) {
    for (int i = 0; i < 8; ++i)
      d[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.row(std::min(o + i, w.n - 1)) + u * stride));
  }
  static F zerof() { return _mm256_setzero_ps(); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  // vector i: row o + i's block b (rows past n repeat row n - 1, as tile's do)
  template <typename W>
  static void widen(const W& w, int64_t o, int64_t stride, int64_t b, I lo[8], I hi[8]) {
    for (int i = 0; i < 8; ++i) W::widen(w.row(std::min(o + i, w.n - 1)), stride, b, lo[i], hi[i]);
  }
  template <typename W>
  static F scale(const W& w, int64_t o, int64_t b, int part, __m256i index) { return w.template scale<kLanes>(o, b, part, index); }
  template <typename W>
  static F offset(const W& w, int64_t o, int64_t b, __m256i index) { return w.template offset<kLanes>(o, b, index); }
  static void store(float* y, F v, int valid) {
    if (valid == 8) return _mm256_storeu_ps(y, v);
    _mm256_mask_storeu_ps(y, static_cast<__mmask8>((1u << valid) - 1), v);
  }
};

template <>
struct Lanes<16> {
  using I = __m512i;
  using F = __m512;
  static I pick(I a, I index, I b) { return _mm512_permutex2var_epi32(a, index, b); }
  static I steps(int first) {
    return _mm512_setr_epi32(first, first + 2, first + 4, first + 6, first + 8, first + 10, first + 12, first + 14,
                             first + 16, first + 18, first + 20, first + 22, first + 24, first + 26, first + 28, first + 30);
  }
  static I dot(I acc, I w, const int16_t* x) {
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(*reinterpret_cast<const Pair*>(x)));
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I set16(int16_t v) { return _mm512_set1_epi16(v); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I srai16(I a, int n) { return _mm512_srai_epi16(a, n); }
  // vector i: unit u of rows o + 2i and o + 2i + 1 (group o's, then group o + 8's)
  template <typename W>
  static void units(const W& w, int64_t o, int64_t stride, int64_t u, I d[8]) {
    for (int g = 0; g < 2; ++g)
      for (int i = 0; i < 4; ++i) d[4 * g + i] = _mm512_loadu_si512(w.row(o + 8 * g) + u * stride + 64 * i);
  }
  static F zerof() { return _mm512_setzero_ps(); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F addf(F a, F b) { return _mm512_add_ps(a, b); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F join(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
  // two whole groups: vector i holds rows o + 2i and o + 2i + 1 (group o's, then group o + 8's)
  template <typename W>
  static void widen(const W& w, int64_t o, int64_t stride, int64_t b, I lo[8], I hi[8]) {
    for (int g = 0; g < 2; ++g)
      for (int i = 0; i < 4; ++i) W::widen512(w.row(o + 8 * g) + 64 * i, stride, b, lo[4 * g + i], hi[4 * g + i]);
  }
  template <typename W>
  static F scale(const W& w, int64_t o, int64_t b, int part, __m256i index) {
    return join(w.template scale<kLanes>(o, b, part, index), w.template scale<kLanes>(o + kLanes, b, part, index));
  }
  template <typename W>
  static F offset(const W& w, int64_t o, int64_t b, __m256i index) {
    return join(w.template offset<kLanes>(o, b, index), w.template offset<kLanes>(o + kLanes, b, index));
  }
  static void store(float* y, F v, int) { _mm512_storeu_ps(y, v); }
};

// Vectors of 8 dwords each of N / 8 rows (vector i: rows (N / 8) i on) in, vector m with lane r dword m of
// row r out: three rounds of two-source picks, each splitting the pairs of vectors by one bit of m
template <int N>
inline void transpose(typename Lanes<N>::I v[8], typename Lanes<N>::I even, typename Lanes<N>::I odd) {
  for (int bit = 1; bit < 8; bit <<= 1)
    for (int i = 0; i < 8; ++i)
      if (!(i & bit)) {
        const auto a = v[i], b = v[i | bit];
        v[i] = Lanes<N>::pick(a, even, b);
        v[i | bit] = Lanes<N>::pick(a, odd, b);
      }
}

// A format whose 32-byte units are q4's block pairs of nibbles (2) or q8's int8 blocks (1): its outer
// tiles transpose the units as they are, then take each block's pairs apart (a quarter of the picks of
// transposing widened blocks). Others (q6k) transpose what their widen gives.
template <typename W>
concept RawUnits = W::kUnitBlocks == 1 || W::kUnitBlocks == 2;

// Block blk of a transposed unit's dwords d: pairs (2m, 2m + 1) to lo, (2m + 16, 2m + 17) to hi
template <typename W, typename V>
inline void unit_pairs(typename V::I d, int blk, typename V::I& lo, typename V::I& hi) {
  if constexpr (W::kUnitBlocks == 2) {  // a 16-bit lane's nibbles: block 0's j and j + 16, then block 1's
    const typename V::I low = V::set16(0x0F);
    if (blk == 0) {
      lo = V::and_(d, low);
      hi = V::and_(V::srli16(d, 4), low);
    } else {
      lo = V::and_(V::srli16(d, 8), low);
      hi = V::srli16(d, 12);
    }
  } else {  // a 16-bit lane's bytes: j, then j + 16
    lo = V::srai16(V::slli16(d, 8), 8);
    hi = V::srai16(d, 8);
  }
}

// Weight rows o..o+N (N = 16: two whole groups) against x rows r0..r0+T
template <int T, int N, typename W>
inline void tile_outer(const W& w, const QuantizedRows& xq, int64_t o, int64_t r0, float* y) {
  using V = Lanes<N>;
  using I = typename V::I;
  using F = typename V::F;
  constexpr int P = W::kParts;
  const I even = V::steps(0), odd = V::steps(1);
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);  // unused by 8-row scale loads
  const int64_t stride = w.stride(o);
  F acc[T], offsets[T];
  for (int t = 0; t < T; ++t) acc[t] = offsets[t] = V::zerof();
  // block b's pairs, lo[m] and hi[m] with lane r row o + r's, against every row of x
  const auto block = [&](int64_t b, const I lo[8], const I hi[8]) {
    F scales[P];
    for (int p = 0; p < P; ++p) scales[p] = V::template scale<W>(w, o, b, p, index);
    F offset = V::zerof();
    if constexpr (W::kOffset) offset = V::template offset<W>(w, o, b, index);
    for (int t = 0; t < T; ++t) {
      const int16_t* x = xq.q + (b * xq.rows + r0 + t) * kBlock;
      I low = V::zero(), high = V::zero();  // two chains: a half's sums (P = 2 scales them apart)
      for (int m = 0; m < 8; ++m) {
        low = V::dot(low, lo[m], x + 2 * m);
        high = V::dot(high, hi[m], x + 16 + 2 * m);
      }
      const F x_scale = V::set1(xq.d[b * xq.stride + r0 + t]);
      if constexpr (P == 1) {
        acc[t] = V::fma(V::cvt(V::add(low, high)), V::mul(scales[0], x_scale), acc[t]);
      } else {
        acc[t] = V::fma(V::cvt(low), V::mul(scales[0], x_scale), acc[t]);
        acc[t] = V::fma(V::cvt(high), V::mul(scales[1], x_scale), acc[t]);
      }
      if constexpr (W::kOffset) offsets[t] = V::fma(offset, V::set1(xq.s[b * xq.stride + r0 + t]), offsets[t]);
    }
  };
  if constexpr (RawUnits<W>) {
    for (int64_t u = 0; u * W::kUnitBlocks < w.nb; ++u) {
      I d[8];  // unit u of the rows, then dword m of them all in d[m]
      for (int g = 0; g < N / kLanes; ++g) prefetch<W>(w.row(o + kLanes * g), stride, u * W::kUnitBlocks);
      V::units(w, o, stride, u, d);
      transpose<N>(d, even, odd);
      for (int blk = 0; blk < W::kUnitBlocks && u * W::kUnitBlocks + blk < w.nb; ++blk) {
        I lo[8], hi[8];
        for (int m = 0; m < 8; ++m) unit_pairs<W, V>(d[m], blk, lo[m], hi[m]);
        block(u * W::kUnitBlocks + blk, lo, hi);
      }
    }
  } else {
    for (int64_t b = 0; b < w.nb; ++b) {
      I lo[8], hi[8];  // elements 0..15 and 16..31 of the rows' block b, then transposed to pairs
      V::widen(w, o, stride, b, lo, hi);
      transpose<N>(lo, even, odd);
      transpose<N>(hi, even, odd);
      block(b, lo, hi);
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(N, w.n - o));
  for (int t = 0; t < T; ++t) V::store(y + (r0 + t) * w.n + o, V::addf(acc[t], offsets[t]), valid);
}

// Formats whose tiles take 512-bit widens
template <typename W>
concept Wide512 = requires(const uint8_t* p, __m512i v) { W::widen512(p, int64_t{}, int64_t{}, v, v); };

// Weight rows [o_begin, o_end) against x rows r0..r0+T on outer tiles: two groups at a time on 512-bit
// vectors where the wide tiles are on and the format has them, else one
template <int T, typename W>
void outer_tiles(const W& w, const QuantizedRows& xq, int64_t o_begin, int64_t o_end, int64_t r0, float* y) {
  int64_t o = o_begin;
  const int64_t end = std::min(o_end, w.n);
  if constexpr (Wide512<W>) {
    if (wide_tiles_flag().load(std::memory_order_relaxed))
      for (; o + 2 * kLanes <= end; o += 2 * kLanes) tile_outer<T, 16>(w, xq, o, r0, y);
  }
  for (; o < end; o += kLanes) tile_outer<T, 8>(w, xq, o, r0, y);
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

template <typename W>
at::Tensor blocked_linear(const at::Tensor& x, const W& w) {
  const int64_t rows = x.size(0), n = w.n;
  const QuantizedRows xq = quantize_rows(x);
  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  constexpr int64_t kOutBlock = 16;  // weight rows that stay in cache while every tile of x passes them
  static_assert(kOutBlock % kLanes == 0, "tiles start on a group of 8 rows: chunks are whole grains");
  rosechat::parallel_for(0, (n + kLanes - 1) / kLanes * kLanes, kOutBlock, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; o += kOutBlock) {
      const int64_t o_end = std::min(end, o + kOutBlock);
      int64_t r0 = 0;
#ifdef ROSECHAT_AVX512
      // q6k's blocks widen and transpose apart (no RawUnits): at 2 rows slower than folding (0.85x), from 4 faster
      if (rows >= (RawUnits<W> ? 2 : 4) && outer_tiles_flag().load(std::memory_order_relaxed)) {
        for (; r0 + 8 <= rows; r0 += 8) outer_tiles<8>(w, xq, o, o_end, r0, yp);
        switch (rows - r0) {  // the rest at once: a speculative check of k guesses is k + 1 rows
          case 7: outer_tiles<7>(w, xq, o, o_end, r0, yp); break;
          case 6: outer_tiles<6>(w, xq, o, o_end, r0, yp); break;
          case 5: outer_tiles<5>(w, xq, o, o_end, r0, yp); break;
          case 4: outer_tiles<4>(w, xq, o, o_end, r0, yp); break;
          case 3: outer_tiles<3>(w, xq, o, o_end, r0, yp); break;
          case 2: outer_tiles<2>(w, xq, o, o_end, r0, yp); break;
          case 1: row_tiles<1>(w, xq, o, o_end, r0, yp); break;
        }
        continue;
      }
#endif
      for (; r0 + 8 <= rows; r0 += 8) row_tiles<8>(w, xq, o, o_end, r0, yp);
      if (rows - r0 >= 4) row_tiles<4>(w, xq, o, o_end, r0, yp), r0 += 4;
      if (rows - r0 >= 2) row_tiles<2>(w, xq, o, o_end, r0, yp), r0 += 2;
      if (rows - r0 >= 1) row_tiles<1>(w, xq, o, o_end, r0, yp);
    }
  });
  return y;
}

}  // namespace rosechat::quant
