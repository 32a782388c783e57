// The outer tiles: several rows of x against 8 weight rows (16 on 512-bit vectors, the avx512 variant) with
// no fold per row of x (tile_outer below); linear.h runs them where x has rows enough.
#pragma once

#include "tile.h"

namespace rosechat::quant {

// Several rows of x (a prefill chunk, a speculative check, a batch of decodes): tile.h's tiles fold
// each weight row's 8 partial sums per block and row of x, work that grows with the rows of x. Here
// the weight rows are turned instead, once a block for every row of x: transposed so that lane r of
// vector m holds pair m (elements 2m, 2m + 1) of row r, and each row of x adds 16 multiply-adds a block
// (VNNI's on avx512; a multiply-add and an add on avx2), its pairs broadcast from memory, straight into
// the block sums of 8 (16 on 512-bit vectors) weight rows: no fold. The sums are the same integers and
// are scaled by the same FMAs in the same order as tile's: the same bits, batch invariance kept.
using Pair = int32_t __attribute__((may_alias));  // two int16 values of x, read as one (embedded broadcast)

template <int N>  // lanes: weight rows a vector holds (8: 256-bit vectors, one group; 16: 512-bit, two)
struct Lanes;

template <>
struct Lanes<8> {
  using I = __m256i;
  using F = __m256;
#ifdef ROSECHAT_AVX512
  static I pick(I a, I index, I b) { return _mm256_permutex2var_epi32(a, index, b); }
#endif
  static I steps(int first) { return _mm256_setr_epi32(first, first + 2, first + 4, first + 6, first + 8, first + 10,
                                                        first + 12, first + 14); }
  static I dot(I acc, I w, const int16_t* x) {
    const I pair = _mm256_set1_epi32(*reinterpret_cast<const Pair*>(x));
#ifdef ROSECHAT_AVX512
    return _mm256_dpwssd_epi32(acc, w, pair);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, pair));
#endif
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
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
  template <typename W>
  static F scale(const W& w, int64_t o, int64_t b, int part, __m256i index) { return w.template scale<kLanes>(o, b, part, index); }
  template <typename W>
  static F offset(const W& w, int64_t o, int64_t b, __m256i index) { return w.template offset<kLanes>(o, b, index); }
  static void store(float* y, F v, int valid) {
    if (valid == 8) return _mm256_storeu_ps(y, v);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v);
  }
};

#ifdef ROSECHAT_AVX512

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
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
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
#endif

// Vectors of 8 dwords each of N / 8 rows (vector i: rows (N / 8) i on) in, vector m with lane r dword m of
// row r out: three rounds of two-source picks, each splitting the pairs of vectors by one bit of m
template <int N>
inline void transpose(typename Lanes<N>::I v[8], typename Lanes<N>::I even, typename Lanes<N>::I odd) {
#ifndef ROSECHAT_AVX512
  if constexpr (N == 8) {  // AVX2 has no two-source pick: the unpack network (24 operations too)
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    for (int i = 0; i < 8; i += 4)
      for (int j = 0; j < 2; ++j)
        u[i + 2 * j] = _mm256_unpacklo_epi64(t[i + j], t[i + j + 2]), u[i + 2 * j + 1] = _mm256_unpackhi_epi64(t[i + j], t[i + j + 2]);
    // u[0..3]: rows 0-3 of dwords (0, 1, 2, 3) in the low lanes and (4, 5, 6, 7) in the high; u[4..7] rows 4-7
    for (int m = 0; m < 4; ++m)
      v[m] = _mm256_permute2x128_si256(u[m], u[m + 4], 0x20), v[m + 4] = _mm256_permute2x128_si256(u[m], u[m + 4], 0x31);
  } else
#endif
  {
    for (int bit = 1; bit < 8; bit <<= 1)
      for (int i = 0; i < 8; ++i)
        if (!(i & bit)) {
          const auto a = v[i], b = v[i | bit];
          v[i] = Lanes<N>::pick(a, even, b);
          v[i | bit] = Lanes<N>::pick(a, odd, b);
        }
  }
}

// A format whose 32-byte units are q4's block pairs of nibbles (2) or q8's int8 blocks (1): its outer
// tiles transpose the units as they are, then take each block's pairs apart (a quarter of the picks of
// transposing widened blocks).
template <typename W>
concept RawUnits = W::kUnitBlocks == 1 || W::kUnitBlocks == 2;
// q6k's super-block of 8 blocks in 6 units (quant_k.cpp): the 6 units are transposed as they are, and
// every block's pairs are taken from them by its widen's own 16-bit lane operations (6 transposes a
// super-block, not 16 of widened blocks; a 16-bit lane stays whole in a dword, so the operations hold)
template <typename W>
concept SuperBlockUnits = W::kSpanBlocks == 8 && W::kSpanUnits == 6;

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
    static_assert(SuperBlockUnits<W>);
    // Blocks 6 and 7 are used after block 5 (block order is the FMAs' order: the bits), from units 0-2 (3-5).
    // With 32 registers (avx512) their pairs are kept whole; avx2's 16 spill half as much when the bits are
    // gathered into one vector a block (per 16-bit lane element j's low 4 bits, element j + 16's, both top 2
    // bits) and taken apart after block 5: 2048x8192 at 32 rows 7.7 -> 7.0 ms (avx512: 3.4 -> 3.6, so not there)
#ifdef ROSECHAT_AVX512
    constexpr bool kGather = false;
#else
    constexpr bool kGather = true;
#endif
    const I low = V::set16(15), top = V::set16(static_cast<int16_t>(0xC000));
    for (int64_t s = 0; s * 8 < w.nb; ++s) {
      I late[4][8];  // blocks 6 and 7: lo, hi each (kGather: late[0] and late[1] the gathered bits)
      for (int k = 0; k < 6; ++k) {
        I d[8], lo[8], hi[8];
        for (int g = 0; g < N / kLanes; ++g) prefetch<W>(w.row(o + kLanes * g), stride, s * 8 + k);
        V::units(w, o, stride, s * 6 + k, d);
        transpose<N>(d, even, odd);
        for (int m = 0; m < 8; ++m) {
          lo[m] = V::srai16(d[m], 10);  // block k: sign-extended from bits 10-15 and 4-9
          hi[m] = V::srai16(V::slli16(d[m], 6), 10);
          const I nibble = V::and_(d[m], low);
          if constexpr (kGather) {
            I& bits = late[k / 3][m];
            bits = k % 3 == 0 ? nibble : V::or_(bits, V::slli16(nibble, 4 * (k % 3)));
          } else {  // widen's: the low 4 bits of element j, of j + 16, then the top 2 bits of both
            I& lo_late = late[k / 3 * 2][m];
            I& hi_late = late[k / 3 * 2 + 1][m];
            if (k % 3 == 0) lo_late = nibble;
            else if (k % 3 == 1) hi_late = nibble;
            else lo_late = V::or_(lo_late, V::srai16(V::slli16(d[m], 14), 10)),
                 hi_late = V::or_(hi_late, V::srai16(V::and_(V::slli16(d[m], 12), top), 10));
          }
        }
        block(s * 8 + k, lo, hi);
      }
      for (int i = 0; i < 2; ++i) {
        if constexpr (kGather) {  // the top 2 bits sign-extended into bits 4-5, as widen's
          I lo[8], hi[8];
          for (int m = 0; m < 8; ++m) {
            const I p = late[i][m];
            lo[m] = V::or_(V::and_(p, low), V::srai16(V::and_(V::slli16(p, 6), top), 10));
            hi[m] = V::or_(V::and_(V::srli16(p, 4), low), V::srai16(V::and_(V::slli16(p, 4), top), 10));
          }
          block(s * 8 + 6 + i, lo, hi);
        } else {
          block(s * 8 + 6 + i, late[2 * i], late[2 * i + 1]);
        }
      }
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(N, w.n - o));
  for (int t = 0; t < T; ++t) V::store(y + (r0 + t) * w.n + o, V::addf(acc[t], offsets[t]), valid);
}


// Weight rows [o_begin, o_end) against x rows r0..r0+T on outer tiles: two groups at a time on 512-bit
// vectors where the wide tiles are on and the format's units transpose as they are, else one
template <int T, typename W>
void outer_tiles(const W& w, const QuantizedRows& xq, int64_t o_begin, int64_t o_end, int64_t r0, float* y) {
  int64_t o = o_begin;
  const int64_t end = std::min(o_end, w.n);
#ifdef ROSECHAT_AVX512
  {  // 16 rows' units
    if (wide_tiles_flag().load(std::memory_order_relaxed))
      for (; o + 2 * kLanes <= end; o += 2 * kLanes) tile_outer<T, 16>(w, xq, o, r0, y);
  }
#endif
  for (; o < end; o += kLanes) tile_outer<T, 8>(w, xq, o, r0, y);
}

}  // namespace rosechat::quant
