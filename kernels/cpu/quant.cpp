// Weight-only quantized linear layers for x86 CPUs with AVX2: y = x @ W.T with W kept in blocks of 32.
//
//   q4: w = q * d + m,  q in 0..15 (GGUF Q4_0 with m = -8d, Q4_1, and Q4_K's 32-weight sub-blocks map
//       onto it exactly). A row's blocks go in pairs: byte 2j of a pair is byte j of the first block
//       in GGML order (element j low nibble, element j + 16 high), byte 2j + 1 byte j of the second,
//       so one 16-bit lane holds element j of both halves of both blocks: shifts and masks widen
//       them, no byte shuffles (cpu_ops.pack_q4 interleaves GGML bytes so; a lone last block is
//       paired with zeros)
//   q4k: q4's nibbles with Q4_K's own scales: 6-bit sc and mn per 32, float16 d and dmin per 256 (Q4K below).
//   q8: w = q * d,      q in -127..127 (GGUF Q8_0 and Q5_0 exactly; float weights quantized per 32).
//       A block's byte 2j is element j, byte 2j + 1 element j + 16 (cpu_ops.pack_q8): shifts widen them.
//       quant_k.cpp's q8m (Q5_1, Q5_K) and q6 (Q6_K) keep this layout with other scales.
//
// Rows go in groups of 8: a group stores each 32-byte unit (a q4 block pair, a q8 block) of its 8
// rows together (cpu_ops.interleave_rows), and the block scales d (and q4's m) as [group, block, 8]
// (cpu_ops.pack_scales), so the 8 rows a tile multiplies are one sequential stream and their scales
// for a block one load (8 rows), a broadcast (1) or a load and a permute.
//
// As in llama.cpp, each row of x is quantized per block of 32 and every block dot product runs on
// integers, scaled once per block. Unlike llama.cpp, x is quantized to int16, not int8: its error is
// then far below the weights' own (an 8-bit x flips near-tied greedy tokens that fp32 gets right).
// A tile computes 8 outputs (8 weight rows x 1 row of x at one sequence, 1 x 8 at eight, ...): their
// 8 int32 block sums are transposed into one vector, so converting, scaling and accumulating cost one
// instruction each per block for all 8. Memory traffic is the packed weight itself, a sixth (q4) or
// a third (q8) of the fp32 matrix.
//
// The machinery the formats share (x's quantization, the tiles, row lookups) is in quant.h. Built at
// first use by torch.utils.cpp_extension (kernels/cpu/ops.py). Parallel over groups of output rows
// through pool.h, so it honours torch.set_num_threads.
#include <torch/library.h>

#include "linear.h"

namespace {

using namespace rosechat::quant;

// q4: nibbles, a pair of blocks a 32-byte unit (the layout above); d and m [ceil(N/8), K/32, 8] of S
template <typename S>
struct Q4 : Rows {
  const S *d, *m;
  int64_t nb;
  static inline void widen(const uint8_t* row, int64_t stride, int64_t b, __m256i& lo, __m256i& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b / 2 * stride));
    const __m256i low = _mm256_set1_epi16(0x0F);
    if (b % 2 == 0) {  // the pair's first block: the low byte of every lane
      lo = _mm256_and_si256(v, low);
      hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    } else {
      lo = _mm256_and_si256(_mm256_srli_epi16(v, 8), low);
      hi = _mm256_srli_epi16(v, 12);
    }
  }
#ifdef ROSECHAT_AVX512
  static inline void widen512(const uint8_t* row, int64_t stride, int64_t b, __m512i& lo, __m512i& hi) {
    const __m512i v = _mm512_loadu_si512(row + b / 2 * stride);
    const __m512i low = _mm512_set1_epi16(0x0F);
    if (b % 2 == 0) {
      lo = _mm512_and_si512(v, low);
      hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    } else {
      lo = _mm512_and_si512(_mm512_srli_epi16(v, 8), low);
      hi = _mm512_srli_epi16(v, 12);
    }
  }
#endif
  template <int R>
  __m256 scale(int64_t o, int64_t b, int, __m256i w_index) const { return block_lanes<R>(d, nb, o, b, w_index); }
  template <int R>
  __m256 offset(int64_t o, int64_t b, __m256i w_index) const { return block_lanes<R>(m, nb, o, b, w_index); }
  static constexpr bool kOffset = true;
  static constexpr int kParts = 1;
  static constexpr int kSpanBlocks = 2, kSpanUnits = 1;
  static constexpr int kUnitBlocks = 2;  // blocks a unit holds, as tile_outer reads them
};

// qs uint8 [N, ceil(K/64) * 32] (block pairs, cpu_ops.pack_q4); d and m [ceil(N/8), K/32, 8], both float32
// or both float16 (S)
template <typename S>
Q4<S> q4_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  ROSECHAT_CHECK(d.dim() == 3 && qs.dim() == 2, "q4 weight [N, ceil(K/64) * 32], block scales [ceil(N/8), K/32, 8] "
              "(cpu_ops.pack_scales)");
  const int64_t n = qs.size(0), nb = d.size(1);  // the scales count the blocks
  ROSECHAT_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.size(1) == (nb + 1) / 2 * 32,
              "q4 weight: contiguous uint8 [N, ceil(K/64) * 32] (cpu_ops.pack_q4), K = ", nb * kBlock);
  return Q4<S>{Rows{qs.data_ptr<uint8_t>(), n, qs.size(1)}, scales<S>(d, n, nb, "block scales"),
               scales<S>(m, n, nb, "q4 offsets"), nb};
}

// q4k: GGUF's Q4_K as the file holds it. q4's nibbles; per block of 32 its 6-bit scale and min (sc uint8
// [ceil(N/8), K/32, 2, 8]: a group's 8 scales, then its 8 mins); per super-block of 256 the file's float16
// d and dmin (dd [ceil(N/8), K/256, 2, 8]). w = (d * sc) * q - dmin * mn: both products exact in float32
// (11 x 6 significant bits), so a block gets the very scale and offset a float32 q4 weight would hold,
// in 4.6 bits a weight (the file's 4.5), not 6.
struct Q4K : Rows {
  const uint16_t* dd;
  const uint8_t* sc;
  int64_t nb;
  static inline void widen(const uint8_t* row, int64_t stride, int64_t b, __m256i& lo, __m256i& hi) {
    Q4<float>::widen(row, stride, b, lo, hi);
  }
#ifdef ROSECHAT_AVX512
  static inline void widen512(const uint8_t* row, int64_t stride, int64_t b, __m512i& lo, __m512i& hi) {
    Q4<float>::widen512(row, stride, b, lo, hi);
  }
#endif
  // d * sc (which = 0) or -(dmin * mn) (1) of block b for rows o..o+R in the tile's lanes: R = 1 (a
  // prefill's tiles) forms its one row's product; others the group's 8, then picks (the same floats)
  template <int R>
  __m256 product(int64_t o, int64_t b, int which, __m256i w_index) const {
    const int64_t g = o / kLanes;
    const uint16_t* super = dd + ((g * (nb / 8) + b / 8) * 2 + which) * kLanes;
    const uint8_t* sub = sc + ((g * nb + b) * 2 + which) * kLanes;
    if constexpr (R == 1) {
      const float v = to_float(super[o % kLanes]) * static_cast<float>(sub[o % kLanes]);
      return _mm256_set1_ps(which ? -v : v);
    } else {
      const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub));
      __m256 v = _mm256_mul_ps(load8(super), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s8)));
      if (which) v = _mm256_xor_ps(v, _mm256_set1_ps(-0.0f));  // a sign flip: exact
      if constexpr (R == kLanes) return v;
      else return _mm256_permutevar8x32_ps(v, w_index);
    }
  }
  template <int R>
  __m256 scale(int64_t o, int64_t b, int, __m256i w_index) const { return product<R>(o, b, 0, w_index); }
  template <int R>
  __m256 offset(int64_t o, int64_t b, __m256i w_index) const { return product<R>(o, b, 1, w_index); }
  static constexpr bool kOffset = true;
  static constexpr int kParts = 1;
  static constexpr int kSpanBlocks = 2, kSpanUnits = 1;
  static constexpr int kUnitBlocks = 2;  // blocks a unit holds, as tile_outer reads them
};

Q4K q4k_weight(const at::Tensor& qs, const at::Tensor& dd, const at::Tensor& sc) {
  ROSECHAT_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) % 128 == 0,
              "q4k weight: contiguous uint8 [N, K/2] (cpu_ops.pack_q4), K a multiple of 256");
  const int64_t n = qs.size(0), nb = qs.size(1) / 16, groups = (n + 7) / 8;
  ROSECHAT_CHECK(dd.scalar_type() == at::kHalf && dd.is_contiguous() && dd.dim() == 4 && dd.size(0) == groups &&
                  dd.size(1) == nb / 8 && dd.size(2) == 2 && dd.size(3) == kLanes,
              "q4k super-block scales: contiguous float16 [ceil(N/8), K/256, 2, 8] (cpu_ops.pack_sub_scales)");
  ROSECHAT_CHECK(sc.scalar_type() == at::kByte && sc.is_contiguous() && sc.dim() == 4 && sc.size(0) == groups &&
                  sc.size(1) == nb && sc.size(2) == 2 && sc.size(3) == kLanes,
              "q4k block scales and mins: contiguous uint8 [ceil(N/8), K/32, 2, 8] (cpu_ops.pack_sub_scales)");
  return Q4K{Rows{qs.data_ptr<uint8_t>(), n, qs.size(1)}, static_cast<const uint16_t*>(dd.data_ptr()),
             sc.data_ptr<uint8_t>(), nb};
}

// x [M, K] float32 @ the q4 weight (q4_weight) -> [M, N] float32
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  return with_scales(d, [&](auto s) {
    const auto w = q4_weight<decltype(s)>(qs, d, m);
    check_x(x, w.nb * kBlock);
    return blocked_linear(x, w);
  });
}

// x [M, K] float32 @ the q8 weight (q8_weight) -> [M, N] float32
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return with_scales(d, [&](auto s) {
    const auto w = q8_weight<decltype(s)>(qs, d);
    check_x(x, w.nb * kBlock);
    return blocked_linear(x, w);
  });
}

at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dd, const at::Tensor& sc) {
  const Q4K w = q4k_weight(qs, dd, sc);
  check_x(x, w.nb * kBlock);
  return blocked_linear(x, w);
}

// Rows ids as float32 (an embedding lookup), as engine/weights/packed.block_rows rounds them
template <typename S>
at::Tensor q4_rows_of(const Q4<S>& w, const at::Tensor& ids) {
  const int64_t nb = w.nb;
  return weight_rows(w, nb * kBlock, ids, [&](int64_t r, float* out) {
    const uint8_t* row = w.row(r);
    const int64_t stride = w.stride(r);
    for (int64_t b = 0; b < nb; ++b, out += kBlock) {
      const uint8_t* pair = row + b / 2 * stride;  // byte 2j + (b % 2): byte j of block b in GGML order
      const float db = scale_of(w.d, nb, r, b), mb = scale_of(w.m, nb, r, b);
      for (int j = 0; j < 16; ++j) {
        const uint8_t v = pair[2 * j + b % 2];
        out[j] = static_cast<float>(v & 0x0F) * db + mb;
        out[j + 16] = static_cast<float>(v >> 4) * db + mb;
      }
    }
  });
}

template <typename S>
at::Tensor q8_rows_of(const Q8<S>& w, const at::Tensor& ids) {
  const int64_t nb = w.nb;
  return weight_rows(w, nb * kBlock, ids, [&](int64_t r, float* out) {
    const uint8_t* row = w.row(r);
    const int64_t stride = w.stride(r);
    for (int64_t b = 0; b < nb; ++b, out += kBlock) {
      const int8_t* block = reinterpret_cast<const int8_t*>(row + b * stride);  // byte 2j: j, 2j + 1: j + 16
      const float db = scale_of(w.d, nb, r, b);
      for (int j = 0; j < 16; ++j) {
        out[j] = static_cast<float>(block[2 * j]) * db;
        out[j + 16] = static_cast<float>(block[2 * j + 1]) * db;
      }
    }
  });
}

at::Tensor q4k_rows(const at::Tensor& qs, const at::Tensor& dd, const at::Tensor& sc, const at::Tensor& ids) {
  const Q4K w = q4k_weight(qs, dd, sc);
  const int64_t nb = w.nb;
  return weight_rows(w, nb * kBlock, ids, [&](int64_t r, float* out) {
    const uint8_t* row = w.row(r);
    const int64_t stride = w.stride(r), g = r / kLanes, lane = r % kLanes;
    for (int64_t b = 0; b < nb; ++b, out += kBlock) {
      const uint8_t* pair = row + b / 2 * stride;
      const uint16_t* super = w.dd + (g * (nb / 8) + b / 8) * 2 * kLanes + lane;
      const uint8_t* sub = w.sc + (g * nb + b) * 2 * kLanes + lane;
      const float db = to_float(super[0]) * static_cast<float>(sub[0]);
      const float mb = -(to_float(super[kLanes]) * static_cast<float>(sub[kLanes]));
      for (int j = 0; j < 16; ++j) {
        const uint8_t v = pair[2 * j + b % 2];
        out[j] = static_cast<float>(v & 0x0F) * db + mb;
        out[j + 16] = static_cast<float>(v >> 4) * db + mb;
      }
    }
  });
}

at::Tensor q4_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, const at::Tensor& ids) {
  return with_scales(d, [&](auto s) { return q4_rows_of(q4_weight<decltype(s)>(qs, d, m), ids); });
}

at::Tensor q8_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& ids) {
  return with_scales(d, [&](auto s) { return q8_rows_of(q8_weight<decltype(s)>(qs, d), ids); });
}

}  // namespace

// mode 256 or 512: one-row tiles on 256- or 512-bit vectors (512 only in the avx512 variant); any other
// value leaves them. Returns the width now in use.
int64_t tile_bits(int64_t mode) {
#ifdef ROSECHAT_AVX512
  if (mode == 256 || mode == 512) wide_tiles_flag().store(mode == 512);
#endif
  return wide_tiles_flag().load() ? 512 : 256;
}

// mode 1 or 0: several rows of x on outer tiles or on the folding ones; any other value leaves them.
// Returns whether outer tiles are in use.
int64_t outer_tiles_mode(int64_t mode) {
  if (mode == 0 || mode == 1) outer_tiles_flag().store(mode == 1);
  return outer_tiles_flag().load();
}

TORCH_LIBRARY(rosechat_quant, lib) {
  lib.def("tile_bits(int mode) -> int", &tile_bits);
  lib.def("outer_tiles(int mode) -> int", &outer_tiles_mode);
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor", &q4_linear);
  lib.def("q8_linear(Tensor x, Tensor qs, Tensor d) -> Tensor", &q8_linear);
  lib.def("q4_rows(Tensor qs, Tensor d, Tensor m, Tensor ids) -> Tensor", &q4_rows);
  lib.def("q8_rows(Tensor qs, Tensor d, Tensor ids) -> Tensor", &q8_rows);
  lib.def("q4k_linear(Tensor x, Tensor qs, Tensor dd, Tensor sc) -> Tensor", &q4k_linear);
  lib.def("q4k_rows(Tensor qs, Tensor dd, Tensor sc, Tensor ids) -> Tensor", &q4k_rows);
}
