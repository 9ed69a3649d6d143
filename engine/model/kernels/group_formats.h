// The weight formats of the group-quantized linear (group_linear.cpp), a row of x quantized
// for it, and both read in plain scalar code: the reference every vector path matches.
//
// Codes. A weight W [N, K] is stored in tiles of 16 outputs. Per group of 32 inputs a tile's
// codes take 64 * bits bytes, laid out for 16-lane integer dot products: code vector v
// (v = 0..7) holds inputs 4v..4v+3 of the tile's 16 outputs, its byte 4n + i being output n's
// input 4v + i.
//   8 bits: the 8 code vectors, 64 bytes each.
//   4 bits: 4 nibble vectors; vector j's low nibbles are code vector 2j, its high nibbles 2j+1.
//   5 bits: the 4 nibble vectors, then a plane of fifth bits: bit v of its byte 4n + i is
//           bit 4 of code vector v's byte 4n + i.
//   6 bits: the 4 nibble vectors, then two planes: bits 2u and 2u + 1 of plane p's byte
//           4n + i are bits 4 and 5 of code vector 4p + u's byte 4n + i.
//
// Scales, by scheme (per tile; "16" is one value per output of the tile):
//   affine: per group an fp16 scale and offset [K / 32, 16] each: W = scale * code + offset.
//     GGML's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (Q4_0's w = d (q - 8) is scale d, offset -8d,
//     exact in fp16), and pagedserve's own int4/int8.
//   super-min: per 256 inputs an fp16 d and dmin [K / 256, 16]; per group an unsigned scale
//     and min, [K / 32, 2, 16] bytes: W = (d * sc) * code - dmin * m. GGML's Q4_K, Q5_K.
//   super-signed: per 256 inputs an fp16 d [K / 256, 16]; per 16 inputs a signed byte scale
//     [K / 16, 16]: W = (d * sc) * (code - 2^(bits - 1)). GGML's Q6_K.
// Each product above is exact in fp32 (at most 24 significant bits), so `dequantize_row`
// gives the very values GGML's own dequantization gives, and the kernel computes the file's model.
//
// A row of x is quantized to int8 (scale max|x| / 127, rounded to nearest even) as
// llama.cpp quantizes it for each weight type: per group of 32 for the affine weights (with
// the sum of the group's codes, as its Q8_1 keeps), per super-block of 256 for the super
// weights (with the integer sums of the codes per 16, as its Q8_K keeps), so that the
// small scales apply to exact integer sums and the float arithmetic runs once per
// super-block. A weight's offset (or minimum) meets the same rounded inputs as its scaled
// codes: for weights centred on zero their rounding errors then cancel, where the offset
// times the inputs' exact sum left them whole (the default model's perplexity, scored as
// llama-perplexity scores it: 11.760 against llama.cpp's 11.641 on the same file, before).

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

namespace pagedserve_groups {

constexpr int64_t kTile = 16;    // outputs per tile
constexpr int64_t kGroup = 32;   // inputs per code group (and per affine scale)
constexpr int64_t kSuper = 256;  // inputs per super-block's d (and dmin)
constexpr int64_t kHalf = 16;    // inputs per super-signed scale

enum Scheme : int64_t { kAffine = 0, kSuperMin = 1, kSuperSigned = 2 };

// A packed weight's arrays and shape; `n` outputs in ceil(n / 16) tiles.
struct Weights {
  const uint8_t* codes;
  const at::Half* scales;   // affine: per group; super: d per super-block
  const at::Half* offsets;  // affine: per group; super-min: dmin per super-block; else unused
  const uint8_t* sub;       // super-min: scale and min per group; super-signed: scale per 16
  int64_t k;
  int64_t bits;
  int64_t scheme;

  int64_t group_bytes() const { return 64 * bits; }
  int64_t tile_bytes() const { return (k / kGroup) * group_bytes(); }
  int64_t scale_rows() const { return scheme == kAffine ? k / kGroup : k / kSuper; }
  int64_t sub_bytes() const {
    return scheme == kSuperMin ? (k / kGroup) * 2 * kTile
                               : (scheme == kSuperSigned ? (k / kHalf) * kTile : 0);
  }
};

// Tile t's arrays.
struct Tile {
  const uint8_t* codes;
  const at::Half* scales;
  const at::Half* offsets;
  const uint8_t* sub;

  Tile(const Weights& w, int64_t t)
      : codes(w.codes + t * w.tile_bytes()),
        scales(w.scales + t * w.scale_rows() * kTile),
        offsets(w.scheme == kSuperSigned ? nullptr : w.offsets + t * w.scale_rows() * kTile),
        sub(w.scheme == kAffine ? nullptr : w.sub + t * w.sub_bytes()) {}
};

// Code of input `i` (0..31) of output `lane` in a group's codes.
inline int32_t code_at(const uint8_t* group, int64_t bits, int64_t i, int64_t lane) {
  const int64_t v = i / 4;
  const int64_t byte = lane * 4 + i % 4;
  if (bits == 8) return group[v * 64 + byte];
  const uint8_t nibbles = group[(v / 2) * 64 + byte];
  int32_t code = v % 2 == 0 ? (nibbles & 0x0F) : (nibbles >> 4);
  if (bits == 5) code |= ((group[256 + byte] >> v) & 1) << 4;
  if (bits == 6) code |= ((group[256 + (v / 4) * 64 + byte] >> (2 * (v % 4))) & 3) << 4;
  return code;
}

// The scale and offset of group g's weights for output `lane` (affine and super-min):
// W = scale * code + offset.
inline void group_scale(const Weights& w, const Tile& tile, int64_t g, int64_t lane,
                        float& scale, float& offset) {
  if (w.scheme == kAffine) {
    scale = static_cast<float>(tile.scales[g * kTile + lane]);
    offset = static_cast<float>(tile.offsets[g * kTile + lane]);
    return;
  }
  const int64_t b = g / (kSuper / kGroup);
  const uint8_t* sub = tile.sub + g * 2 * kTile;
  scale = static_cast<float>(tile.scales[b * kTile + lane]) * static_cast<float>(sub[lane]);
  offset = -(static_cast<float>(tile.offsets[b * kTile + lane]) *
             static_cast<float>(sub[kTile + lane]));
}

// Output `row` of the weight in fp32 into `out` [k], as GGML's dequantization gives it (the
// products are exact: no rounding to fuse).
inline void dequantize_row(const Weights& w, int64_t row, float* out) {
  const Tile tile(w, row / kTile);
  const int64_t lane = row % kTile;
  for (int64_t g = 0; g < w.k / kGroup; ++g) {
    const uint8_t* codes = tile.codes + g * w.group_bytes();
    float* values = out + g * kGroup;
    if (w.scheme == kSuperSigned) {
      const float d = static_cast<float>(tile.scales[(g * kGroup / kSuper) * kTile + lane]);
      for (int64_t half = 0; half < 2; ++half) {
        const auto sc = static_cast<int8_t>(tile.sub[(2 * g + half) * kTile + lane]);
        const float scale = d * static_cast<float>(sc);
        for (int64_t i = half * kHalf; i < (half + 1) * kHalf; ++i) {
          values[i] = scale * static_cast<float>(code_at(codes, w.bits, i, lane) - (1 << (w.bits - 1)));
        }
      }
      continue;
    }
    float scale, offset;
    group_scale(w, tile, g, lane, scale, offset);
    for (int64_t i = 0; i < kGroup; ++i) {
      values[i] = scale * static_cast<float>(code_at(codes, w.bits, i, lane)) + offset;
    }
  }
}

// Rows of `k` inputs quantized two ways, each where a call's weights need it:
// - per group of 32 (affine weights): int8 codes, the scale and the codes' sum times it;
// - per super-block of 256 (super weights, as llama.cpp's Q8_K): int8 codes, the scale, and
//   the integer sum of the codes per 16.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> codes;     // [m, k], per group of 32
  std::unique_ptr<float[]> scales;     // [m, k / 32]
  std::unique_ptr<float[]> sums;       // [m, k / 32]
  std::unique_ptr<int8_t[]> codes256;  // [m, k], per super-block
  std::unique_ptr<float[]> scales256;  // [m, k / 256]
  std::unique_ptr<int32_t[]> sums16;   // [m, k / 16]
  // The codes again, rows interleaved R = kInterleave at a time (AVX2's decoded tiles; else
  // empty): row r's input i at ((r / R) * R * k + (i / 4) * 4R + (r % R) * 4 + i % 4), rows
  // past m zero.
  std::unique_ptr<int8_t[]> runs;     // of `codes`
  std::unique_ptr<int8_t[]> runs256;  // of `codes256`
  // Per group of 32, the integer sum of its codes (AVX2's decoded 8-bit tiles; else empty).
  std::unique_ptr<int32_t[]> code_sums;  // [m, k / 32]
  // Per super-block (AVX2), the int16 pairs its epilogues multiply by pairs of small scales:
  // 4 pairs of its groups' sums (sums of 32), then 8 pairs of its sums per 16, each the
  // first sum in the low 16 bits and the second in the high (each sum below 2^15).
  static constexpr int64_t kPairSums = 12;
  std::unique_ptr<int32_t[]> pair_sums;  // [m, k / 256, kPairSums]

  QuantizedRows(int64_t m, int64_t k, bool groups, bool supers) {
    if (groups) {
      codes.reset(new int8_t[m * k]);
      scales.reset(new float[m * (k / kGroup)]);
      sums.reset(new float[m * (k / kGroup)]);
    }
    if (supers) {
      codes256.reset(new int8_t[m * k]);
      scales256.reset(new float[m * (k / kSuper)]);
      sums16.reset(new int32_t[m * (k / kHalf)]);
    }
  }
};

// Row r of x into q's groups: per group of 32, scale = max|x| / 127, the codes x * (127 /
// max|x|) rounded to nearest even, and the codes' integer sum times the scale.
template <typename T>
void quantize_row(const T* x, int64_t r, int64_t k, QuantizedRows& q) {
  const int64_t groups = k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const T* p = x + r * k + g * kGroup;
    float amax = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(static_cast<float>(p[i])));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* out = q.codes.get() + r * k + g * kGroup;
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      out[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(p[i]) * inverse));
      sum += out[i];
    }
    q.scales[r * groups + g] = amax / 127.0f;
    q.sums[r * groups + g] = static_cast<float>(sum) * q.scales[r * groups + g];
    if (q.code_sums) q.code_sums[r * groups + g] = sum;
  }
}

// Super-block b of row r (x: its 256 inputs) into q: scale = max|x| / 127, the codes
// rounded to nearest even, their sums per 16. The max is exact whatever the order it is
// taken in, so every instruction set's version gives these bits.
template <typename T>
void quantize_super_block(const T* x, int64_t r, int64_t b, int64_t k, QuantizedRows& q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  int8_t* out = q.codes256.get() + r * k + b * kSuper;
  int32_t* sums = q.sums16.get() + r * (k / kHalf) + b * (kSuper / kHalf);
  for (int64_t h = 0; h < kSuper / kHalf; ++h) {
    int32_t sum = 0;
    for (int64_t i = h * kHalf; i < (h + 1) * kHalf; ++i) {
      out[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) * inverse));
      sum += out[i];
    }
    sums[h] = sum;
  }
  q.scales256[r * (k / kSuper) + b] = amax / 127.0f;
}

// Where a tile's results go: rows of `stride` elements, fp32 or bf16 (rounded to nearest
// even, as torch rounds), after adding the fp32 bias (or nothing).
struct Output {
  void* data;
  bool bf16;
  int64_t stride;
  const float* bias;
};

// Row r's 16 fp32 results of tile t plus the bias, the first `valid` of them, into `out`.
inline void store_lanes(const float* acc, int64_t t, int64_t r, const Output& out,
                        int64_t valid) {
  const int64_t first = r * out.stride + t * kTile;
  for (int64_t lane = 0; lane < std::min(valid, kTile); ++lane) {
    const float y = acc[lane] + (out.bias != nullptr ? out.bias[t * kTile + lane] : 0.0f);
    if (out.bf16) {
      static_cast<at::BFloat16*>(out.data)[first + lane] = at::BFloat16(y);
    } else {
      static_cast<float*>(out.data)[first + lane] = y;
    }
  }
}

}  // namespace pagedserve_groups
