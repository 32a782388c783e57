// GGUF's 5- and 6-bit blocks multiplied from their own values, exactly:
//
//   q8m: quant.cpp's q8 layout (int8) with w = q * d + m per block of 32, q in 0..31: Q5_1, and Q5_K's
//        32-weight sub-blocks (d = d_super * sc, m = -dmin_super * mn, both exact in float32). The
//        offset term is q4's: m times the block's sum of x.
//   q6k: w = (d * sc) * q (+ m) per half block (16 weights), q 6-bit, sc int8, d the file's float16
//        one per 256 weights, m (optional) one per 32: Q6_K (q in -32..31, no m), and any mix of Q4_K,
//        Q5_K and Q6_K rows (a merged qkv whose v is Q6_K: Q4_K's and Q5_K's sub-blocks have one sc for
//        both halves and m = -dmin * mn). d * sc is formed at run time (exact in float32: 11 x 8
//        significant bits). Each half's integer sum is scaled apart (kParts = 2): twice the folds and
//        FMAs of q8. 6.5625 bits a weight, as in Q6_K: a row's super-block (8 blocks) is 6 units of
//        16 16-bit lanes. Block b < 6 is unit b: lane j holds element j in bits 10-15 and j + 16 in
//        bits 4-9 (6-bit two's complement), widened by 3 shifts; blocks 6 and 7 fill the 4 bits left at
//        the bottom of units 0-2 and 3-5 (element j's low 4 bits, element j + 16's, then both top 2
//        bits). A nibble plane and a 2-bit plane (Q6_K's own split) took 12 operations a block and row,
//        1.75x the time of the values held as int8 (8.6 bits a weight, which this form replaced with the
//        same bits out).
//
// Q5_0 ((q - 16) * d) is plain q8. The AVX-512 variant differs only where quant.h's block_dot does
// (VNNI, q8m); q6k's half sums are single multiply-adds in both.
#include <torch/library.h>

#include "linear.h"

namespace {

using namespace rosechat::quant;

struct Q8M : Q8<> {
  const float* m;
  template <int R>
  __m256 offset(int64_t o, int64_t b, __m256i w_index) const { return block_lanes<R>(m, nb, o, b, w_index); }
  static constexpr bool kOffset = true;
};

// d * sc of block b's half `part` for rows o..o+R in the tile's lanes. sc int8 [ceil(N/8), K/32, 2, 8]
// (cpu_ops.pack_sub_scales): a group's 8 rows' scales of block b's first half, then of its second; d
// float16 [ceil(N/8), K/256, 8] (cpu_ops.pack_scales of [N, K/256])
template <int R, typename S>
inline __m256 sub_scale(const S* d, const int8_t* sc, int64_t nb, int64_t o, int64_t b, int part, __m256i w_index) {
  const int64_t g = o / kLanes;
  const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + ((g * nb + b) * 2 + part) * kLanes));
  const __m256 s = _mm256_mul_ps(load8(d + (g * (nb / 8) + b / 8) * kLanes), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)));
  if constexpr (R == kLanes) return s;
  else return _mm256_permutevar8x32_ps(s, w_index);  // o's own lane (R = 1), or rows o..o+R
}

struct Q6K : Rows {
  const uint16_t* d;
  const int8_t* sc;
  int64_t nb;
  static ROSECHAT_ALWAYS_INLINE void widen(const uint8_t* row, int64_t stride, int64_t b, __m256i& lo, __m256i& hi) {
    const uint8_t* span = row + b / 8 * 6 * stride;
    const auto unit = [&](int64_t u) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span + u * stride)); };
    if (b % 8 < 6) {  // sign-extended from bits 10-15 and 4-9
      const __m256i v = unit(b % 8);
      lo = _mm256_srai_epi16(v, 10);
      hi = _mm256_srai_epi16(_mm256_slli_epi16(v, 6), 10);
    } else {  // low 4 bits from the bottoms of units 0 and 1 (or 3 and 4), the top 2 from unit 2's (5's), signed
      const int64_t u = b % 8 == 6 ? 0 : 3;
      const __m256i top = unit(u + 2), low = _mm256_set1_epi16(15);
      lo = _mm256_or_si256(_mm256_and_si256(unit(u), low), _mm256_srai_epi16(_mm256_slli_epi16(top, 14), 10));
      hi = _mm256_or_si256(_mm256_and_si256(unit(u + 1), low),  // bits 0-1 of top land in 2-3: cleared
                           _mm256_andnot_si256(low, _mm256_srai_epi16(_mm256_slli_epi16(top, 12), 10)));
    }
  }
  template <int R>
  __m256 scale(int64_t o, int64_t b, int part, __m256i w_index) const { return sub_scale<R>(d, sc, nb, o, b, part, w_index); }
  static constexpr bool kOffset = false;
  static constexpr int kParts = 2;
  static constexpr int kSpanBlocks = 8, kSpanUnits = 6;
  // block b's value j (0..31) of a row, as widen gives it
  static int value(const uint8_t* row, int64_t stride, int64_t b, int j) {
    const uint8_t* span = row + b / 8 * 6 * stride;
    const auto lane = [&](int64_t u) { return span[u * stride + 2 * (j % 16)] | span[u * stride + 2 * (j % 16) + 1] << 8; };
    int v;
    if (b % 8 < 6) {
      v = lane(b % 8) >> (j < 16 ? 10 : 4) & 63;
    } else {
      const int64_t u = b % 8 == 6 ? 0 : 3;
      v = (lane(u + j / 16) & 15) | (lane(u + 2) >> (j < 16 ? 0 : 2) & 3) << 4;
    }
    return v >= 32 ? v - 64 : v;
  }
};

struct Q6KM : Q6K {
  const float* m;
  template <int R>
  __m256 offset(int64_t o, int64_t b, __m256i w_index) const { return block_lanes<R>(m, nb, o, b, w_index); }
  static constexpr bool kOffset = true;
};

Q8M q8m_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const Q8<> w = q8_weight(qs, d);
  check_scales(m, w.n, w.nb, "q8m offsets");
  return Q8M{w, m.data_ptr<float>()};
}

// qs uint8 [N, 3K/4] (cpu_ops.pack_q6k), d float16 [ceil(N/8), K/256, 8], sc int8 [ceil(N/8), K/32, 2, 8]
Q6K q6k_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& sc) {
  ROSECHAT_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) % 192 == 0,
              "q6k weight: contiguous uint8 [N, 3K/4] (cpu_ops.pack_q6k), K a multiple of 256");
  const int64_t n = qs.size(0), nb = qs.size(1) / 24, groups = (n + 7) / 8;
  ROSECHAT_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 3 && d.size(0) == groups &&
                  d.size(1) == nb / 8 && d.size(2) == kLanes,
              "q6k super-block scales: contiguous float16 [ceil(N/8), K/256, 8] (cpu_ops.pack_scales)");
  ROSECHAT_CHECK(sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.dim() == 4 && sc.size(0) == groups &&
                  sc.size(1) == nb && sc.size(2) == 2 && sc.size(3) == kLanes,
              "q6k sub-scales: contiguous int8 [ceil(N/8), K/32, 2, 8] (cpu_ops.pack_sub_scales)");
  return Q6K{Rows{qs.data_ptr<uint8_t>(), n, qs.size(1)}, static_cast<const uint16_t*>(d.data_ptr()),
             sc.data_ptr<int8_t>(), nb};
}

// m empty: no offsets
at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& sc,
                      const at::Tensor& m) {
  const Q6K w = q6k_weight(qs, d, sc);
  check_x(x, w.nb * kBlock);
  if (m.numel() == 0) return blocked_linear(x, w);
  check_scales(m, w.n, w.nb, "q6k offsets");
  return blocked_linear(x, Q6KM{w, m.data_ptr<float>()});
}

at::Tensor q8m_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const Q8M w = q8m_weight(qs, d, m);
  check_x(x, w.nb * kBlock);
  return blocked_linear(x, w);
}

// Rows as gguf's dequantizer rounds them: q * d + m (a product, then a sum); (d * sc) * q (+ m)
at::Tensor q8m_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, const at::Tensor& ids) {
  const Q8M w = q8m_weight(qs, d, m);
  const int64_t nb = w.nb;
  return weight_rows(w, nb * kBlock, ids, [&](int64_t r, float* out) {
    const uint8_t* row = w.row(r);
    const int64_t stride = w.stride(r);
    for (int64_t b = 0; b < nb; ++b, out += kBlock) {
      const int8_t* block = reinterpret_cast<const int8_t*>(row + b * stride);  // byte 2j: j, 2j + 1: j + 16
      const float db = scale_of(w.d, nb, r, b), mb = scale_of(w.m, nb, r, b);
      for (int j = 0; j < 16; ++j) {
        out[j] = static_cast<float>(block[2 * j]) * db + mb;
        out[j + 16] = static_cast<float>(block[2 * j + 1]) * db + mb;
      }
    }
  });
}

// As gguf rounds them: (d * sc) * q (+ m)
at::Tensor q6k_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& sc, const at::Tensor& m,
                    const at::Tensor& ids) {
  const Q6K w = q6k_weight(qs, d, sc);
  const int64_t nb = w.nb;
  if (m.numel()) check_scales(m, w.n, nb, "q6k offsets");
  const float* offsets = m.numel() ? m.data_ptr<float>() : nullptr;
  return weight_rows(w, nb * kBlock, ids, [&](int64_t r, float* out) {
    const uint8_t* row = w.row(r);
    const int64_t stride = w.stride(r), g = r / kLanes, lane = r % kLanes;
    for (int64_t b = 0; b < nb; ++b, out += kBlock) {
      const float super = to_float(w.d[(g * (nb / 8) + b / 8) * kLanes + lane]);
      const float half[2] = {super * static_cast<float>(w.sc[((g * nb + b) * 2) * kLanes + lane]),
                             super * static_cast<float>(w.sc[((g * nb + b) * 2 + 1) * kLanes + lane])};
      const float mb = offsets ? scale_of(offsets, nb, r, b) : 0.0f;
      for (int j = 0; j < kBlock; ++j) {
        const float v = half[j / 16] * static_cast<float>(w.value(row, stride, b, j));
        out[j] = offsets ? v + mb : v;  // no + 0.0f without offsets: -0.0 stays -0.0
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rosechat_quant, lib) {
  lib.def("q8m_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor", &q8m_linear);
  lib.def("q8m_rows(Tensor qs, Tensor d, Tensor m, Tensor ids) -> Tensor", &q8m_rows);
  lib.def("q6k_linear(Tensor x, Tensor qs, Tensor d, Tensor sc, Tensor m) -> Tensor", &q6k_linear);
  lib.def("q6k_rows(Tensor qs, Tensor d, Tensor sc, Tensor m, Tensor ids) -> Tensor", &q6k_rows);
}
