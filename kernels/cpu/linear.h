// blocked_linear: y = x @ W.T for a weight format of quant.h (quant.cpp's and quant_k.cpp's formats),
// spread over the pool's threads in chunks of weight rows, each chunk's rows of x on the tiles that suit
// their count (tile.h's folding tiles, outer.h's outer ones).
#pragma once

#include "outer.h"

namespace rosechat::quant {

// x rows [r_begin, r_end) against weight rows [o, o_end) (within a group-aligned chunk), on the tiles that suit
// the count: outer tiles from a few rows on (kOuterRows), else the folding tiles of 8, 4, 2 and 1 rows
template <typename W>
void rows_on_tiles(const W& w, const QuantizedRows& xq, int64_t o, int64_t o_end, int64_t r_begin, int64_t r_end,
                   float* y) {
  int64_t r0 = r_begin;
  // From how many rows outer tiles are faster (kernels.cpu.bench_quant --outer): at 2 rows 1.6-2.0x the folding
  // tiles on avx512 (q6k 1.0x); without VNNI (avx2: a multiply-add and an add) 2 rows ran at 0.86-0.92x, 5 at
  // 1.03-1.45x
#ifdef ROSECHAT_AVX512
  constexpr int64_t kOuterRows = 2;
#else
  constexpr int64_t kOuterRows = 4;
#endif
  if (r_end - r0 >= kOuterRows && outer_tiles_flag().load(std::memory_order_relaxed)) {
    for (; r0 + 8 <= r_end; r0 += 8) outer_tiles<8>(w, xq, o, o_end, r0, y);
    switch (r_end - r0) {  // the rest at once: a speculative check of k guesses is k + 1 rows
      case 7: return outer_tiles<7>(w, xq, o, o_end, r0, y);
      case 6: return outer_tiles<6>(w, xq, o, o_end, r0, y);
      case 5: return outer_tiles<5>(w, xq, o, o_end, r0, y);
      case 4: return outer_tiles<4>(w, xq, o, o_end, r0, y);
      case 3: return outer_tiles<3>(w, xq, o, o_end, r0, y);
      case 2: return outer_tiles<2>(w, xq, o, o_end, r0, y);
      case 1: return row_tiles<1>(w, xq, o, o_end, r0, y);
    }
    return;
  }
  for (; r0 + 8 <= r_end; r0 += 8) row_tiles<8>(w, xq, o, o_end, r0, y);
  if (r_end - r0 >= 4) row_tiles<4>(w, xq, o, o_end, r0, y), r0 += 4;
  if (r_end - r0 >= 2) row_tiles<2>(w, xq, o, o_end, r0, y), r0 += 2;
  if (r_end - r0 >= 1) row_tiles<1>(w, xq, o, o_end, r0, y);
}

template <typename W>
at::Tensor blocked_linear(const at::Tensor& x, const W& w) {
  const int64_t rows = x.size(0), n = w.n;
  const QuantizedRows xq = quantize_rows(x);
  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  constexpr int64_t kOutBlock = 16;  // weight rows that stay in cache while every tile of x passes them
  static_assert(kOutBlock % kLanes == 0, "tiles start on a group of 8 rows: chunks are whole grains");
  // A long prompt's chunk in blocks of rows of x whose quantized values (512 KiB) stay in cache while a thread's
  // weight rows pass them: all 2048 rows of an 8B model's chunk (16 MiB at K = 4096) read once for every 16
  // weight rows made a q4k 4096 x 4096 at 512 rows 1.85x slower a row than at 64. Weights are read again
  // for each block instead. At 512 rows, q4k 4096 x 4096 one run: unblocked 169 ms, blocks of 256 KiB 70,
  // 512 KiB 59, 1 MiB 64, 2 MiB 92.
  const int64_t x_block = std::max<int64_t>(8, (int64_t{1} << 19) / (w.nb * kBlock * 2) / 8 * 8);
  rosechat::parallel_for(0, (n + kLanes - 1) / kLanes * kLanes, kOutBlock, [&](int64_t begin, int64_t end) {
    for (int64_t x0 = 0; x0 < rows; x0 += x_block)
      for (int64_t o = begin; o < end; o += kOutBlock)
        rows_on_tiles(w, xq, o, std::min(end, o + kOutBlock), x0, std::min(rows, x0 + x_block), yp);
  });
  return y;
}

}  // namespace rosechat::quant
