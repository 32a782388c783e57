// A load's repack: GGUF blocks straight from the file's bytes into the kernels' layouts (kernels/cpu/ops.py
// pack_q4, pack_q8, pack_q6k, pack_scales, pack_sub_scales), each output byte written once, in order, by both threads.
// The same bytes as those torch functions give (tests/kernels/test_cpu_repack.py); torch's strided copies
// of the same shuffles moved single bytes and took most of a cold load (1.7B Q4_1: 3.4 s of 4.7).
//
// Every op takes rows r0.. of a matrix as the file's blocks, src uint8 [n, blocks, block bytes] (contiguous,
// typically the memory-mapped file), and writes the outputs' rows (qs) and row groups (scales) that those
// rows make, where qs, d, m, sc are the weight's own tensors sliced at r0 (a multiple of 8). The layouts:
//   qs: rows in groups of 8 (the last group n % 8 rows), a group storing 32-byte unit u of each of its rows
//       together; q4's unit is a pair of blocks, byte 2j + h = byte j of block 2u + h (zeros past the last
//       block); q8's unit is one block, byte 2j + h = value 16h + j.
//   scales [groups, blocks, 8] (pack_scales), pairs [groups, P, 2, 8] (pack_sub_scales): a group's 8 rows'
//       values together, rows past n zero.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "check.h"
#include "pool.h"

#include <cstring>

namespace {

constexpr int64_t kRows = 8;  // a row group
constexpr int64_t kUnit = 32;  // bytes of a qs unit

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

void check_src(const at::Tensor& src, int64_t block_bytes) {
  ROSECHAT_CHECK(src.scalar_type() == at::kByte && src.dim() == 3 && src.is_contiguous() && src.size(2) == block_bytes,
              "src must be contiguous uint8 [rows, blocks, ", block_bytes, "]");
}

void check_out(const at::Tensor& t, int64_t numel, const char* what) {
  ROSECHAT_CHECK(t.is_contiguous() && t.numel() == numel, what, " must be contiguous with ", numel, " elements");
}

// f(group, first row, rows in it) for each row group of n rows, split between the threads
template <typename F>
void for_groups(int64_t n, const F& f) {
  rosechat::parallel_for(0, (n + kRows - 1) / kRows, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) f(g, g * kRows, std::min(kRows, n - g * kRows));
  });
}

// scales [groups, blocks, 8] from the float16 at byte `at` of every block (Q4_0's m: -8 times d, `neg8`)
template <typename S>
void scales_into(const uint8_t* src, int64_t n, int64_t nb, int64_t bytes, int64_t at, float factor, S* out) {
  for_groups(n, [&](int64_t g, int64_t r0, int64_t rows) {
    S* o = out + g * nb * kRows;
    for (int64_t b = 0; b < nb; ++b, o += kRows) {
      for (int64_t r = 0; r < rows; ++r) o[r] = static_cast<S>(half_at(src + ((r0 + r) * nb + b) * bytes + at) * factor);
      for (int64_t r = rows; r < kRows; ++r) o[r] = S(0);
    }
  });
}

void scales(const at::Tensor& src, const at::Tensor& out, int64_t at, float factor) {
  const int64_t n = src.size(0), nb = src.size(1), bytes = src.size(2);
  check_out(out, (n + kRows - 1) / kRows * nb * kRows, "scales");
  const uint8_t* s = src.data_ptr<uint8_t>();
  if (out.scalar_type() == at::kHalf) scales_into(s, n, nb, bytes, at, factor, out.data_ptr<at::Half>());
  else scales_into(s, n, nb, bytes, at, factor, out.data_ptr<float>());
}

// Q4_0 (block 18 bytes: d, 16 of nibbles; m = -8d) and Q4_1 (20: d, m, nibbles) -> q4's qs, d, m
void repack_q4(const at::Tensor& src, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  ROSECHAT_CHECK(src.dim() == 3 && (src.size(2) == 18 || src.size(2) == 20), "src must be Q4_0 or Q4_1 blocks");
  const int64_t bytes = src.size(2), first = bytes - 16;
  check_src(src, bytes);
  const int64_t n = src.size(0), nb = src.size(1), units = (nb + 1) / 2;
  ROSECHAT_CHECK(qs.scalar_type() == at::kByte && d.scalar_type() == m.scalar_type(), "qs uint8, d and m alike");
  check_out(qs, n * units * kUnit, "qs");
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* out = qs.data_ptr<uint8_t>();
  for_groups(n, [&](int64_t, int64_t r0, int64_t rows) {
    uint8_t* o = out + r0 * units * kUnit;
    for (int64_t u = 0; u < units; ++u) {
      for (int64_t r = 0; r < rows; ++r, o += kUnit) {
        const uint8_t* lo = s + ((r0 + r) * nb + 2 * u) * bytes + first;
        if (2 * u + 1 < nb) {
          const uint8_t* hi = lo + bytes;
          for (int j = 0; j < 16; ++j) o[2 * j] = lo[j], o[2 * j + 1] = hi[j];
        } else {
          for (int j = 0; j < 16; ++j) o[2 * j] = lo[j], o[2 * j + 1] = 0;
        }
      }
    }
  });
  scales(src, d, 0, 1.0f);
  if (bytes == 20) scales(src, m, 2, 1.0f);
  else scales(src, m, 0, -8.0f);
}

// Q8_0 (34 bytes: d, 32 int8) -> q8's qs (int8, each block's halves interleaved) and d
void repack_q8(const at::Tensor& src, const at::Tensor& qs, const at::Tensor& d) {
  check_src(src, 34);
  const int64_t n = src.size(0), nb = src.size(1);
  ROSECHAT_CHECK(qs.scalar_type() == at::kChar, "qs int8");
  check_out(qs, n * nb * kUnit, "qs");
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* out = reinterpret_cast<uint8_t*>(qs.data_ptr<int8_t>());
  for_groups(n, [&](int64_t, int64_t r0, int64_t rows) {
    uint8_t* o = out + r0 * nb * kUnit;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t r = 0; r < rows; ++r, o += kUnit) {
        const uint8_t* q = s + ((r0 + r) * nb + b) * 34 + 2;
        for (int j = 0; j < 16; ++j) o[2 * j] = q[j], o[2 * j + 1] = q[16 + j];
      }
    }
  });
  scales(src, d, 0, 1.0f);
}

// Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, 128 of nibbles: 4 chunks of
// 32 bytes, sub-block 2c the low nibbles of chunk c, 2c + 1 its high ones) -> q4k's qs (q4's layout: a unit
// is the sub-block pair of one chunk), dd (d, dmin) and sc (scale, min) in pairs
void repack_q4k(const at::Tensor& src, const at::Tensor& qs, const at::Tensor& dd, const at::Tensor& sc) {
  check_src(src, 144);
  const int64_t n = src.size(0), supers = src.size(1), units = supers * 4;
  const int64_t groups = (n + kRows - 1) / kRows;
  ROSECHAT_CHECK(qs.scalar_type() == at::kByte && dd.scalar_type() == at::kHalf && sc.scalar_type() == at::kByte,
              "qs uint8, dd float16, sc uint8");
  check_out(qs, n * units * kUnit, "qs");
  check_out(dd, groups * supers * 2 * kRows, "dd");
  check_out(sc, groups * supers * 8 * 2 * kRows, "sc");
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* out = qs.data_ptr<uint8_t>();
  uint16_t* out_dd = reinterpret_cast<uint16_t*>(dd.data_ptr<at::Half>());
  uint8_t* out_sc = sc.data_ptr<uint8_t>();
  for_groups(n, [&](int64_t g, int64_t r0, int64_t rows) {
    uint8_t* o = out + r0 * units * kUnit;
    for (int64_t u = 0; u < units; ++u) {
      for (int64_t r = 0; r < rows; ++r, o += kUnit) {
        // GGML order per sub-block: byte j = value j | value j + 16 << 4; the pair's bytes interleaved
        const uint8_t* a = s + ((r0 + r) * supers + u / 4) * 144 + 16 + (u % 4) * 32;
        const uint8_t* b = a + 16;
        for (int j = 0; j < 16; ++j) {
          o[2 * j] = static_cast<uint8_t>((a[j] & 0x0F) | (b[j] << 4));
          o[2 * j + 1] = static_cast<uint8_t>((a[j] >> 4) | (b[j] & 0xF0));
        }
      }
    }
    uint16_t* od = out_dd + g * supers * 2 * kRows;  // [supers, 2, 8]
    uint8_t* os = out_sc + g * supers * 16 * kRows;  // [supers * 8, 2, 8]
    std::memset(od, 0, supers * 2 * kRows * 2);
    std::memset(os, 0, supers * 16 * kRows);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < supers; ++k) {
        const uint8_t* blk = s + ((r0 + r) * supers + k) * 144;
        std::memcpy(od + (k * 2) * kRows + r, blk, 2);
        std::memcpy(od + (k * 2 + 1) * kRows + r, blk + 2, 2);
        const uint8_t *low = blk + 4, *high = blk + 8, *extra = blk + 12;
        for (int j = 0; j < 8; ++j) {  // as blocks.k_scale_min
          const uint8_t scale = j < 4 ? low[j] & 63 : (extra[j - 4] & 0x0F) | ((low[j - 4] >> 6) << 4);
          const uint8_t min = j < 4 ? high[j] & 63 : (extra[j - 4] >> 4) | ((high[j - 4] >> 6) << 4);
          os[((k * 8 + j) * 2) * kRows + r] = scale;
          os[((k * 8 + j) * 2 + 1) * kRows + r] = min;
        }
      }
    }
  });
}

// The 6-bit field of the 256 values of one K-quant super-block, as q6k keeps them (pack_q6k: q & 63, q the
// int8 value): Q6_K's q - 32 (low 4 bits in ql, top 2 in qh), Q4_K's nibbles 0..15, Q5_K's 0..31 (a fifth
// bit in qh). The orders are the gguf package's dequantizers' (q6.q6_from_blocks, q4._q4_k_values, q5._q5_k).
void k_values(const uint8_t* blk, int64_t bytes, uint8_t* v) {
  if (bytes == 210) {  // two halves of 128: ql [64] and qh [32] each
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
      uint8_t* o = v + 128 * h;
      for (int l = 0; l < 32; ++l) {
        o[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) ^ 32;  // (q - 32) & 63
        o[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) ^ 32;
        o[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) ^ 32;
        o[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) ^ 32;
      }
    }
    return;
  }
  const uint8_t* qs = blk + (bytes == 144 ? 16 : 48);  // 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1
  const uint8_t* qh = blk + 16;  // Q5_K: sub-block j's fifth bits, bit j of its 32 bytes
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      uint8_t lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
      if (bytes == 176) lo |= ((qh[l] >> (2 * c)) & 1) << 4, hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      v[64 * c + l] = lo, v[64 * c + 32 + l] = hi;
    }
  }
}

// One row's super-block of values v (k_values) as q6k's 6 units of 16 16-bit lanes (pack_q6k): unit b, lane j:
// block b's value j in bits 10-15, j + 16 in bits 4-9; bits 0-3 of units 0-2 hold block 6's (low 4 bits of
// j, of j + 16, then both top 2 bits), of units 3-5 block 7's. Unit b goes to o + b * stride.
inline void q6k_units(const uint8_t* v, uint8_t* o, int64_t stride) {
  for (int b = 0; b < 6; ++b, o += stride) {
    const uint8_t* x = v + (b < 3 ? 192 : 224);  // block 6 or 7
    for (int j = 0; j < 16; ++j) {
      const int a = x[j], c = x[16 + j];
      const int low = b % 3 == 0 ? a & 15 : b % 3 == 1 ? c & 15 : (a >> 4) | ((c >> 4) << 2);
      const int lane = (v[32 * b + j] << 10) | (v[32 * b + 16 + j] << 4) | low;
      o[2 * j] = static_cast<uint8_t>(lane & 0xFF), o[2 * j + 1] = static_cast<uint8_t>(lane >> 8);
    }
  }
}

// Q6_K (210 bytes: ql [128], qh [64], int8 sc [16], d), Q4_K (144) or Q5_K (176: d, dmin, 12 bytes of scales,
// qh [32], qs [128]) super-blocks -> q6k's qs, d [groups, supers, 8] (float16: Q6_K's d, the others' d),
// sc [groups, supers * 8, 2, 8] (int8: Q6_K's scale per 16; the others' 6-bit scale per 32, twice) and, if
// m is not empty, m [groups, supers * 8, 8] (float32: -dmin * min per 32; 0 for Q6_K), as q6.Q6Weight packs them
void repack_q6k(const at::Tensor& src, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& sc,
                const at::Tensor& m) {
  ROSECHAT_CHECK(src.dim() == 3 && (src.size(2) == 210 || src.size(2) == 144 || src.size(2) == 176),
                 "src must be Q6_K, Q4_K or Q5_K super-blocks");
  const int64_t bytes = src.size(2);
  check_src(src, bytes);
  const int64_t n = src.size(0), supers = src.size(1), units = supers * 6, blocks = supers * 8;
  const int64_t groups = (n + kRows - 1) / kRows;
  const bool offsets = m.numel() > 0;
  ROSECHAT_CHECK(qs.scalar_type() == at::kByte && d.scalar_type() == at::kHalf && sc.scalar_type() == at::kChar,
                 "qs uint8, d float16, sc int8");
  ROSECHAT_CHECK(bytes == 210 || offsets, "Q4_K and Q5_K rows need m");
  check_out(qs, n * units * kUnit, "qs");
  check_out(d, groups * supers * kRows, "d");
  check_out(sc, groups * blocks * 2 * kRows, "sc");
  if (offsets) {
    ROSECHAT_CHECK(m.scalar_type() == at::kFloat, "m float32");
    check_out(m, groups * blocks * kRows, "m");
  }
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* out = qs.data_ptr<uint8_t>();
  uint16_t* out_d = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  int8_t* out_sc = sc.data_ptr<int8_t>();
  float* out_m = offsets ? m.data_ptr<float>() : nullptr;
  for_groups(n, [&](int64_t g, int64_t r0, int64_t rows) {
    uint8_t v[256];
    uint8_t* o = out + r0 * units * kUnit;
    uint16_t* od = out_d + g * supers * kRows;  // [supers, 8]
    int8_t* os = out_sc + g * blocks * 2 * kRows;  // [blocks, 2, 8]
    float* om = offsets ? out_m + g * blocks * kRows : nullptr;  // [blocks, 8]
    std::memset(od, 0, supers * kRows * 2);
    std::memset(os, 0, blocks * 2 * kRows);
    if (offsets) std::memset(om, 0, blocks * kRows * sizeof(float));
    for (int64_t k = 0; k < supers; ++k) {
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* blk = s + ((r0 + r) * supers + k) * bytes;
        k_values(blk, bytes, v);
        q6k_units(v, o + (k * 6 * rows + r) * kUnit, rows * kUnit);  // the group stores unit u of its rows together
        if (bytes == 210) {
          std::memcpy(od + k * kRows + r, blk + 208, 2);
          for (int j = 0; j < 16; ++j) os[((k * 8 + j / 2) * 2 + j % 2) * kRows + r] = static_cast<int8_t>(blk[192 + j]);
          continue;
        }
        std::memcpy(od + k * kRows + r, blk, 2);
        const float dmin = half_at(blk + 2);
        const uint8_t *low = blk + 4, *high = blk + 8, *extra = blk + 12;
        for (int j = 0; j < 8; ++j) {  // as blocks.k_scale_min
          const int scale = j < 4 ? low[j] & 63 : (extra[j - 4] & 0x0F) | ((low[j - 4] >> 6) << 4);
          const int min = j < 4 ? high[j] & 63 : (extra[j - 4] >> 4) | ((high[j - 4] >> 6) << 4);
          os[((k * 8 + j) * 2) * kRows + r] = os[((k * 8 + j) * 2 + 1) * kRows + r] = static_cast<int8_t>(scale);
          om[(k * 8 + j) * kRows + r] = -dmin * static_cast<float>(min);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(rosechat_repack, lib) {
  lib.def("repack_q4(Tensor src, Tensor(a!) qs, Tensor(b!) d, Tensor(c!) m) -> ()", &repack_q4);
  lib.def("repack_q8(Tensor src, Tensor(a!) qs, Tensor(b!) d) -> ()", &repack_q8);
  lib.def("repack_q4k(Tensor src, Tensor(a!) qs, Tensor(b!) dd, Tensor(c!) sc) -> ()", &repack_q4k);
  lib.def("repack_q6k(Tensor src, Tensor(a!) qs, Tensor(b!) d, Tensor(c!) sc, Tensor(d!) m) -> ()", &repack_q6k);
}
