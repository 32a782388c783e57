// What the blocked linears of quant.cpp (q4, q8) and quant_k.cpp (q8m, q6: GGUF's Q5 and Q6 blocks)
// share: x quantized per block of 32 to int16, the integer block dot products and their folds (the
// tiles that use them: tile.h), the row lookups. A weight format is a struct (quant.cpp's Q4 and Q8 describe the members a
// tile reads: widen, scale, kOffset, kParts, kSpanBlocks, kSpanUnits). The layouts are described in quant.cpp.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include "check.h"
#include "pool.h"

#include <algorithm>
#include <type_traits>
#include <vector>

// The avx512 variant (kernels/cpu/isa.py) is built for F, BW, VL, DQ and VNNI. Its block sums take
// VNNI's multiply-add: the same exact integers, so every result is the avx2 variant's bit for bit.
// Block sums on 512-bit vectors measured 1.35x (one sequence) to 2.3x (eight) slower on Zen 4, which
// splits 512-bit operations in two, and 1.2-1.6x faster at one row on Intel's server cores: the tiles
// keep 256 bits but for tile_wide (one row of x), which kernels/cpu/tiles.py turns on where it times faster.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ROSECHAT_AVX512 1
#endif

// For a format's widen: GCC left q6k's (two branches, up to 3 loads) a call, the tile's sums spilled
// around each: 5x slower
#define ROSECHAT_ALWAYS_INLINE inline __attribute__((always_inline))

namespace rosechat::quant {

constexpr int64_t kBlock = 32;
constexpr int kLanes = 8;  // outputs a tile computes together: R weight rows x T rows of x, R * T = 8
// At one row of x a tile streams 8 weight rows once: waiting on memory, not arithmetic, sets its
// time (30 SmolLM2 layers streamed from DRAM took 1.75x as long as from L3). The weights are read in
// order (a group's units, then the next group's), so each unit's cache lines are fetched this many
// bytes ahead: 4.0 -> 3.35 ms for the 30 layers at 2 threads, 7.4 -> 5.6 ms at one (1 and 4 KiB: slower)
constexpr int64_t kPrefetch = 2048;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x quantized per block of 32: q int16 block-major, [K/32, M, 32] (a tile of 8 rows of x reads 512
// contiguous bytes a block, where rows K apart made 8 streams: 9% faster at 8 rows); d the block
// scales and s = d * sum(q) (what a q4 block's offset m multiplies), [K/32, M + 8]: a tile loads
// its rows' values with one load (the 8 slots past M are read but never used). The buffers are the
// calling thread's, reused from call to call (a decode step makes ~120 of these calls; three
// allocations each showed in its profile), so a thread holds one QuantizedRows at a time.
struct QuantizedRows {
  const int16_t* q;
  const float *d, *s;
  int64_t rows, stride;
};

// one row of x; q: its block 0, the next block rows * 32 values on
inline void quantize_row(const float* x, int64_t k, int16_t* q, int64_t rows, float* d, float* s, int64_t stride) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / kBlock; ++b, x += kBlock, q += rows * kBlock) {
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
    const float db = top / 32767.0f;
    d[b * stride] = db;
    const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
    s[b * stride] = db * hsum(_mm256_cvtepi32_ps(sums));
  }
}

inline QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock, stride = rows + kLanes;
  thread_local std::vector<__m256i> q;  // 32-byte aligned: no load of a block straddles two cache lines
  thread_local std::vector<float> scales;
  if (q.size() > (int64_t{1} << 16) && rows * k / 16 * 4 < static_cast<int64_t>(q.size()))
    q = {}, scales = {};  // after a long prompt's chunk (megabytes), decode steps need kilobytes
  q.resize(rows * k / 16);
  scales.resize(2 * nb * stride);
  const float* xp = x.data_ptr<float>();
  int16_t* qp = reinterpret_cast<int16_t*>(q.data());
  float *dp = scales.data(), *sp = dp + nb * stride;
  rosechat::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, qp + r * kBlock, rows, dp + r, sp + r, stride);
  });
  return {qp, dp, sp, rows, stride};
}

// The 8 int32 sums of a block's products for one weight row and one row of x, lanes partly summed
inline __m256i block_dot(__m256i w_lo, __m256i w_hi, const int16_t* x) {
  const __m256i lo = _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
#ifdef ROSECHAT_AVX512  // VNNI's multiply-add accumulates in the same instruction: the same integers
  return _mm256_dpwssd_epi32(lo, w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
#else
  return _mm256_add_epi32(lo, _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
#endif
}

// A transpose that adds as it goes, in three steps so a tile folds its sums as it computes them
// (8 live vectors of 8 sums would not fit in AVX2's 16 registers with the rest): pair(a, b) holds
// a's and b's sums in 4 lanes (2 each, per 128-bit half), quad(p, q) 4 outputs' in 2 lanes each,
// and totals(q0, q1) has lane l the total of output l. Integer sums are exact, so an output's block
// sum is the same whichever tile and lane computed it.
inline __m256i pair(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
inline __m256i quad(__m256i p, __m256i q) {
  return _mm256_add_epi32(_mm256_unpacklo_epi64(p, q), _mm256_unpackhi_epi64(p, q));
}
inline __m256i totals(__m256i q0, __m256i q1) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// Rows in groups of 8 (cpu_ops.interleave_rows): a group holds unit u (32 bytes: a q4 block pair, a
// q8 block) of each of its rows together, so a tile's 8 rows are one sequential stream.
struct Rows {
  const uint8_t* q;
  int64_t n, row_bytes;
  // the distance between a row's units in the group starting at row o (the last may be short)
  int64_t stride(int64_t o) const { return std::min<int64_t>(kLanes, n - o / kLanes * kLanes) * 32; }
  const uint8_t* row(int64_t r) const { return q + r / kLanes * kLanes * row_bytes + r % kLanes * 32; }
};

// Block scales are float32, or float16 (its raw bits, uint16_t) where the file's own are (GGUF Q4_0,
// Q4_1, Q8_0: exact): a q4 block then streams 20 bytes, as in the file, not 24. F16C converts 8 at once.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return _cvtsh_ss(v); }

// Lane l takes p[index[l]], N values in all: all 8 in order is a load, one a broadcast, else a permute
template <int N, typename S>
inline __m256 lanes(const S* p, __m256i index) {
  if constexpr (N == kLanes) return load8(p);
  else if constexpr (N == 1) return _mm256_set1_ps(to_float(*p));
  else return _mm256_permutevar8x32_ps(load8(p), index);
}
// A block's integer sums for one weight row and one row of x: P = 1, the whole block's (block_dot);
// P = 2, each half's apart (a format with a scale per 16 weights, GGUF's Q6_K). A half's total is at
// most 16 * 32 * 32767 < 2^24 in magnitude: exact as a float.
template <int P>
struct Sums {
  __m256i v[P];
};

template <int P>
inline Sums<P> dots(__m256i lo, __m256i hi, const int16_t* x) {
  if constexpr (P == 1) {
    return {{block_dot(lo, hi, x)}};
  } else {
    return {{_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
             _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)))}};
  }
}

// pair, quad and totals of each part
template <int P, typename F>
inline Sums<P> fold(const Sums<P>& a, const Sums<P>& b, F f) {
  Sums<P> r;
  for (int p = 0; p < P; ++p) r.v[p] = f(a.v[p], b.v[p]);
  return r;
}
template <int P>
inline Sums<P> pair(const Sums<P>& a, const Sums<P>& b) { return fold(a, b, [](__m256i u, __m256i v) { return pair(u, v); }); }
template <int P>
inline Sums<P> quad(const Sums<P>& a, const Sums<P>& b) { return fold(a, b, [](__m256i u, __m256i v) { return quad(u, v); }); }
template <int P>
inline Sums<P> totals(const Sums<P>& a, const Sums<P>& b) {
  return fold(a, b, [](__m256i u, __m256i v) { return totals(u, v); });
}

// Block scales laid out as cpu_ops.pack_scales lays them, [ceil(N/8), K/32, 8]: the 8 lanes of rows
// o..o+R (R = 8: a load, 1: a broadcast of o's own, else a permute by w_index)
template <int R, typename S>
inline __m256 block_lanes(const S* s, int64_t nb, int64_t o, int64_t b, __m256i w_index) {
  return lanes<R>(s + (o / kLanes * nb + b) * kLanes + (R == 1 ? o % kLanes : 0), w_index);
}

// A packed weight's block scales (or q4's offsets) for n rows of nb blocks, as pack_scales lays them out,
// of element type S (float: float32, uint16_t: float16)
template <typename S = float>
inline const S* scales(const at::Tensor& d, int64_t n, int64_t nb, const char* what) {
  constexpr bool half = std::is_same_v<S, uint16_t>;
  ROSECHAT_CHECK(d.scalar_type() == (half ? at::kHalf : at::kFloat) && d.is_contiguous() && d.dim() == 3 &&
                  d.size(0) == (n + 7) / 8 && d.size(1) == nb && d.size(2) == kLanes,
              what, ": contiguous ", half ? "float16" : "float32", " [ceil(N/8), K/32, 8] (cpu_ops.pack_scales)");
  return static_cast<const S*>(d.data_ptr());
}
inline void check_scales(const at::Tensor& d, int64_t n, int64_t nb, const char* what) { scales(d, n, nb, what); }

// f(S{}) with S the element type of block scales d: uint16_t for float16, float otherwise (then checked)
template <typename F>
auto with_scales(const at::Tensor& d, F f) {
  return d.scalar_type() == at::kHalf ? f(uint16_t{}) : f(float{});
}
inline void check_x(const at::Tensor& x, int64_t k) {
  ROSECHAT_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  ROSECHAT_CHECK(x.size(1) == k, "x has ", x.size(1), " columns; the weight takes ", k);
}

// The int8 layout (q8 and quant_k.cpp's q8m and q6): a block's byte 2j is element j, byte 2j + 1
// element j + 16 (cpu_ops.pack_q8), so shifts widen a block to its two int16 halves. Block scales d
// in groups of 8 rows, [ceil(N/8), K/32, 8] (cpu_ops.pack_scales). A format's members the tile reads:
// widen, scale<R>(o, b, part, w_index) (the lanes of rows o..o+R), kParts (1: one scale a block; 2: one
// a half), kOffset (with offset<R>(o, b, w_index): an offset a block, times the block's sum of x), and
// kSpanBlocks, kSpanUnits (a run of kSpanBlocks blocks fills kSpanUnits 32-byte units: prefetched ahead).
template <typename S = float>
struct Q8 : Rows {
  const S* d;
  int64_t nb;
  static inline void widen(const uint8_t* row, int64_t stride, int64_t b, __m256i& lo, __m256i& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * stride));
    lo = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);  // the low byte of each lane, sign-extended
    hi = _mm256_srai_epi16(v, 8);
  }
#ifdef ROSECHAT_AVX512
  static inline void widen512(const uint8_t* row, int64_t stride, int64_t b, __m512i& lo, __m512i& hi) {
    const __m512i v = _mm512_loadu_si512(row + b * stride);
    lo = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
    hi = _mm512_srai_epi16(v, 8);
  }
#endif
  template <int R>
  __m256 scale(int64_t o, int64_t b, int, __m256i w_index) const { return block_lanes<R>(d, nb, o, b, w_index); }
  static constexpr bool kOffset = false;
  static constexpr int kParts = 1;
  static constexpr int kSpanBlocks = 1, kSpanUnits = 1;
  static constexpr int kUnitBlocks = 1;  // blocks a unit holds, as tile_outer reads them
};

// qs int8 [N, K] (cpu_ops.pack_q8's order); d float32 (or float16: S) [ceil(N/8), K/32, 8]
template <typename S = float>
inline Q8<S> q8_weight(const at::Tensor& qs, const at::Tensor& d) {
  ROSECHAT_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) % kBlock == 0,
              "q8 weight: contiguous int8 [N, K], K a multiple of 32 (cpu_ops.pack_q8)");
  const int64_t n = qs.size(0), k = qs.size(1);
  return Q8<S>{Rows{reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()), n, k},
               scales<S>(d, n, k / kBlock, "block scales"), k / kBlock};
}

// Rows ids of a packed weight as float32 [ids, K] (an embedding lookup): w = q * d (+ m), rounded as
// engine/weights/packed.block_rows rounds it from GGML's blocks (a product, then a sum).
template <typename Row>
at::Tensor weight_rows(const Rows& rows, int64_t k, const at::Tensor& ids, const Row& row) {
  ROSECHAT_CHECK(ids.scalar_type() == at::kLong, "ids: int64");
  const at::Tensor flat = ids.reshape(-1).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    ROSECHAT_CHECK(id[i] >= 0 && id[i] < rows.n, "row ", id[i], " of a weight with ", rows.n, " rows");
  at::Tensor out = at::empty({flat.numel(), k}, at::kFloat);
  float* o = out.data_ptr<float>();
  rosechat::parallel_for(0, flat.numel(), 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) row(id[i], o + i * k);
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return out.view(shape);
}

// Block b's scale (or offset) of row r in pack_scales' [ceil(N/8), K/32, 8]
template <typename S>
inline float scale_of(const S* s, int64_t nb, int64_t r, int64_t b) {
  return to_float(s[(r / kLanes * nb + b) * kLanes + r % kLanes]);
}

}  // namespace rosechat::quant
