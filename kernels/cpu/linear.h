// blocked_linear: y = x @ W.T for a weight format of quant.h (quant.cpp's and quant_k.cpp's formats),
// spread over the pool's threads in chunks of weight rows, each chunk's rows of x on the tiles that suit
// their count (tile.h's folding tiles, outer.h's outer ones).
#pragma once

#include "outer.h"

namespace rosechat::quant {

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
