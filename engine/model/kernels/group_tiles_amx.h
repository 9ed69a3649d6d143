// The group-quantized linear's blocks of 16 rows on AMX-INT8 (affine 4- and 8-bit weights),
// with the bits of the VNNI path (group_tiles_avx512.h): see group_linear.cpp's header.

#pragma once

#include "amx_tiles.h"
#include "group_tiles_avx512.h"

namespace pagedserve_groups {

// AMX-INT8 for blocks of 16 rows. Per group of 32 inputs: A = 16 rows x 32 bytes of x's
// codes (stride k), B = 8 rows x 64 bytes, the tile's codes for the group in VNNI layout (4
// consecutive inputs of each of the 16 outputs per row), and one TDPBSUD makes the group's
// 16 x 16 exact int32 sums (signed A, unsigned B), which `accumulate` then takes row by row.
// Tiles: tmm0-1 A, tmm2-3 B, tmm4-7 C.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxChunkRows = 128;  // rows per pass over a task's tiles
constexpr int64_t kGroupBytes = kGroup * kTile;  // one group's B: 8 rows x 64 bytes

using pagedserve_amx::amx_permitted;
using pagedserve_amx::load_tile_config;
using pagedserve_amx::TileConfig;

void configure_tiles() {
  alignas(64) TileConfig config{};
  config.palette = 1;
  for (int i = 0; i < 8; ++i) {
    const bool a = i < 2, b = i >= 2 && i < 4;
    config.rows[i] = b ? kGroup / 4 : kAmxRows;
    config.colsb[i] = a ? kGroup : 64;
  }
  load_tile_config(config);
}

// A 4-bit tile's codes as 8-bit ones in `b` ([K / 32][8][64]): each packed vector's low
// nibbles are one B row (inputs 8j..8j+3), its high nibbles the next (8j+4..8j+7).
void unpack_nibbles(const uint8_t* codes, int64_t k, uint8_t* b) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t j = 0; j < k / 8; ++j) {
    const __m512i packed = _mm512_loadu_si512(codes + j * 64);
    _mm512_store_si512(b + j * 128, _mm512_and_si512(packed, low_nibbles));
    _mm512_store_si512(b + j * 128 + 64,
                       _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles));
  }
}

// The group's C tile (stored in `c`) into acc: `accumulate` per row.
// Unrolled, so that the 16 accumulators stay in registers.
__attribute__((always_inline)) inline void accumulate_block(__m512* acc, const int32_t* c,
                                                            __m512 s, __m512 z, const float* xs,
                                                            const float* xsum, int64_t groups) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < kAmxRows; ++r) {
    acc[r] = accumulate(acc[r], _mm512_load_si512(c + r * kTile), s, z, xs[r * groups],
                        xsum[r * groups]);
  }
}

// Groups g and g + 1 (if `two`) of the block: their C tiles stored into c[0] and c[1].
inline void group_sums(const int8_t* xq, int64_t k, const uint8_t* b, int64_t g, bool two,
                       int32_t (*c)[kAmxRows * kTile]) {
  _tile_zero(4);
  _tile_loadd(0, xq + g * kGroup, k);
  _tile_loadd(2, b + g * kGroupBytes, 64);
  _tile_dpbsud(4, 0, 2);
  if (two) {
    _tile_zero(5);
    _tile_loadd(1, xq + (g + 1) * kGroup, k);
    _tile_loadd(3, b + (g + 1) * kGroupBytes, 64);
    _tile_dpbsud(5, 1, 3);
  }
  _tile_stored(4, c[0], 64);
  if (two) _tile_stored(5, c[1], 64);
}

// Rows r0..r0+15 against tile t, whose B for group g is at b + g * kGroupBytes. Software
// pipelined: the sums of groups g + 2 and g + 3 are computed and stored before the epilogue
// of groups g and g + 1 reads theirs, so the vector loads never wait on a tile store.
void tile_rows_amx(const Weights& w, int64_t t, const uint8_t* b, const QuantizedRows& q,
                   int64_t r0, const Output& out, int64_t valid) {
  const int64_t k = w.k;
  const int64_t groups = k / kGroup;
  const Tile tile(w, t);
  const int8_t* xq = q.codes.get() + r0 * k;
  const float* xs = q.scales.get() + r0 * groups;
  const float* xsum = q.sums.get() + r0 * groups;
  alignas(64) int32_t c[2][2][kAmxRows * kTile];
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  group_sums(xq, k, b, 0, groups > 1, c[0]);
  for (int64_t g = 0; g < groups; g += 2) {
    if (g + 2 < groups) group_sums(xq, k, b, g + 2, g + 3 < groups, c[(g / 2 + 1) % 2]);
    accumulate_block(acc, c[(g / 2) % 2][0], load_halves(tile.scales + g * kTile),
                     load_halves(tile.offsets + g * kTile), xs + g, xsum + g, groups);
    if (g + 1 < groups) {
      accumulate_block(acc, c[(g / 2) % 2][1], load_halves(tile.scales + (g + 1) * kTile),
                       load_halves(tile.offsets + (g + 1) * kTile), xs + g + 1, xsum + g + 1,
                       groups);
    }
  }
  store_rows<kAmxRows>(acc, t, r0, out, valid);
}

}  // namespace pagedserve_groups
