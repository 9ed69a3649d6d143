// The group-quantized linear's tiles in scalar code: the arithmetic every vector path
// (group_tiles_avx2.h, group_tiles_avx512.h) reproduces bit for bit, for CPUs with neither.
//
// For an output n and a row m of x (group_formats.h has the formats):
//   affine, over the groups g of 32 inputs in order (x quantized per group):
//     isum = sum_{i in g} code[n][i] * xq[m][i]                        (int32, exact)
//     acc  = fma(float(isum), scale[n][g] * xs[m][g], acc)
//     acc  = fma(offset[n][g], xsum[m][g], acc)    xsum = float(sum_{i in g} xq[m][i]) * xs
//   super-min, over the super-blocks b of 256 inputs in order (x quantized per 256):
//     isum = sum_{g in b} sc[n][g] * sum_{i in g} code[n][i] * xq[m][i]   (int32, exact)
//     msum = sum_{g in b} m[n][g] * sum_{i in g} xq[m][i]                  (int32, exact)
//     acc  = fma(float(isum), d[n][b] * xs[m][b], acc)
//     acc  = fma(float(msum), -(dmin[n][b] * xs[m][b]), acc)
//   super-signed (the code's centre c = 2^(bits - 1), a scale per 16 inputs h):
//     isum = sum_{h in b} sc[n][h] * (sum_{i in h} code * xq - c * sum_{i in h} xq)  (exact)
//     acc  = fma(float(isum), d[n][b] * xs[m][b], acc)
// The integer sums stay below 2^31; float(isum) rounds alike everywhere.

#pragma once

#include "group_formats.h"

namespace pagedserve_groups {

constexpr int64_t kRowRun = 8;  // rows sharing one pass over a tile's codes

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k, bool groups, bool supers) {
  QuantizedRows q(m, k, groups, supers);
  const int64_t grain = std::max<int64_t>(1, 16 * 1024 / k);
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (groups) quantize_row(x, r, k, q);
      for (int64_t b = 0; supers && b < k / kSuper; ++b) {
        quantize_super_block(x + r * k + b * kSuper, r, b, k, q);
      }
    }
  });
  return q;
}

// Group g of the affine weights, against one row's group inputs `xq`, into acc[lane].
inline void affine_group(const Weights& w, const Tile& tile, int64_t g, const int8_t* xq, float xs,
                         float xsum, float* acc) {
  const uint8_t* codes = tile.codes + g * w.group_bytes();
  for (int64_t lane = 0; lane < kTile; ++lane) {
    int32_t isum = 0;
    for (int64_t i = 0; i < kGroup; ++i) isum += code_at(codes, w.bits, i, lane) * xq[i];
    float scale, offset;
    group_scale(w, tile, g, lane, scale, offset);
    acc[lane] = std::fmaf(static_cast<float>(isum), scale * xs, acc[lane]);
    acc[lane] = std::fmaf(offset, xsum, acc[lane]);
  }
}

// Super-block b, against one row's super-block inputs `xq` and their sums per 16.
inline void super_block(const Weights& w, const Tile& tile, int64_t b, const int8_t* xq,
                        const int32_t* sums16, float xs, float* acc) {
  const int32_t centre = 1 << (w.bits - 1);
  for (int64_t lane = 0; lane < kTile; ++lane) {
    int32_t isum = 0, msum = 0;
    for (int64_t j = 0; j < kSuper / kGroup; ++j) {
      const int64_t g = b * (kSuper / kGroup) + j;
      const uint8_t* codes = tile.codes + g * w.group_bytes();
      int32_t dots[2] = {0, 0};
      for (int64_t i = 0; i < kGroup; ++i) {
        dots[i / kHalf] += code_at(codes, w.bits, i, lane) * xq[j * kGroup + i];
      }
      if (w.scheme == kSuperMin) {
        isum += tile.sub[g * 2 * kTile + lane] * (dots[0] + dots[1]);
        msum += tile.sub[g * 2 * kTile + kTile + lane] * (sums16[2 * j] + sums16[2 * j + 1]);
      } else {
        for (int64_t u = 0; u < 2; ++u) {
          const auto sc = static_cast<int8_t>(tile.sub[(2 * g + u) * kTile + lane]);
          isum += sc * (dots[u] - centre * sums16[2 * j + u]);
        }
      }
    }
    const float d = static_cast<float>(tile.scales[b * kTile + lane]);
    acc[lane] = std::fmaf(static_cast<float>(isum), d * xs, acc[lane]);
    if (w.scheme == kSuperMin) {
      const float dmin = static_cast<float>(tile.offsets[b * kTile + lane]);
      acc[lane] = std::fmaf(static_cast<float>(msum), -(dmin * xs), acc[lane]);
    }
  }
}

// Rows r0..r0+rows-1 against tile t, into the tile's columns of those rows of `out`.
template <int64_t Bits, int64_t Scheme>
void tile_run(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, int64_t rows,
              const Output& out, int64_t valid) {
  const int64_t k = w.k;
  const Tile tile(w, t);
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float acc[kTile] = {};
    if constexpr (Scheme == kAffine) {
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const int64_t at = r * (k / kGroup) + g;
        affine_group(w, tile, g, q.codes.get() + r * k + g * kGroup, q.scales[at], q.sums[at], acc);
      }
    } else {
      for (int64_t b = 0; b < k / kSuper; ++b) {
        super_block(w, tile, b, q.codes256.get() + r * k + b * kSuper,
                    q.sums16.get() + r * (k / kHalf) + b * (kSuper / kHalf),
                    q.scales256[r * (k / kSuper) + b], acc);
      }
    }
    store_lanes(acc, t, r, out, valid);
  }
}

// Rows r_begin..r_end-1 against tile t, in runs of kRowRun rows.
template <int64_t Bits, int64_t Scheme>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r_begin,
               int64_t r_end, const Output& out, int64_t valid) {
  for (int64_t r = r_begin; r < r_end; r += kRowRun) {
    tile_run<Bits, Scheme>(w, t, q, r, std::min(kRowRun, r_end - r), out, valid);
  }
}

}  // namespace pagedserve_groups
