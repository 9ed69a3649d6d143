// The group-quantized linear's tiles on AVX512-VNNI: group_tiles_scalar.h's arithmetic with
// 16 outputs per vector, VPDPBUSD multiplying 64 code bytes by 4 inputs of a row into 16
// exact int32 sums. The integer sums are exact and the float operations run in the scalar
// code's order for every output, so the bits are the scalar code's (a test builds both).
//
// x is quantized with gathers (a lane per group, its inputs in order), the same operations
// as the scalar loop. Per group, a tile's 8 code vectors are decoded once (nibbles, plus
// the planes of fifth and sixth bits) and then serve every row of the run.

#pragma once

#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "group_formats.h"

namespace pagedserve_groups {

constexpr int64_t kRowRun = 8;  // rows sharing one pass over a tile's codes (2 x 8
// accumulators fit the 32 vector registers; runs of 8 beat runs of 4 from 8 rows on)

// Rows of `k` inputs at least this many per task of at::parallel_for when quantizing.
constexpr int64_t kQuantizeGrainInputs = 16 * 1024;

// Input i of 16 consecutive groups (a lane per group) from `x`, 32 inputs per group, as fp32.
inline __m512 gather_input(const float* x, __m512i lanes, int i, __mmask16 mask) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask,
                                  _mm512_add_epi32(lanes, _mm512_set1_epi32(i)), x, 4);
}

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }

inline __m512 load16(const at::BFloat16* x) {  // exact: bf16 is fp32's upper half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Groups j0..j0+count-1 of x (flattened: group j is x[j * 32 .. j * 32 + 31], whatever its
// row, since K is a multiple of 32), as the scalar quantize_row computes them: a lane per
// group, taking its 32 inputs in turn, so that its max is std::max's (amax stays where |x|
// is NaN or equal); the codes' sum is an integer, the same in any order.
template <typename T>
void quantize_groups(const T* x, int64_t j0, int64_t count, QuantizedRows& q) {
  constexpr int stride = std::is_same_v<T, float> ? kGroup : kGroup / 2;  // 32-bit words
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(stride));
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  const T* base = x + j0 * kGroup;
  __m512 amax = _mm512_setzero_ps();
  auto take = [&](__m512 v) { amax = _mm512_max_ps(_mm512_and_ps(v, magnitude), amax); };
  if constexpr (std::is_same_v<T, float>) {
    for (int i = 0; i < kGroup; ++i) take(gather_input(base, lanes, i, mask));
  } else {  // a 32-bit gather takes inputs i and i + 1 (i even) of each group
    const auto* words = reinterpret_cast<const float*>(base);
    for (int i = 0; i < kGroup / 2; ++i) {
      const __m512i pair = _mm512_castps_si512(gather_input(words, lanes, i, mask));
      take(_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
      take(_mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(0xFFFF0000))));
    }
  }
  const __m512 levels = _mm512_set1_ps(127.0f);
  const __m512 inverse =
      _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), levels, amax);
  alignas(64) float inverses[16];
  _mm512_store_ps(inverses, inverse);
  _mm512_mask_storeu_ps(q.scales.get() + j0, mask, _mm512_div_ps(amax, levels));
  for (int64_t j = 0; j < count; ++j) {
    const __m512 scale = _mm512_set1_ps(inverses[j]);
    int8_t* out = q.codes.get() + (j0 + j) * kGroup;
    __m512i sum = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      const __m512 v = load16(base + j * kGroup + half * 16);
      // Rounded to nearest even (the default rounding, as std::nearbyint), then narrowed.
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v, scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + half * 16), _mm512_cvtepi32_epi8(codes));
      sum = _mm512_add_epi32(sum, codes);
    }
    q.sums[j0 + j] = static_cast<float>(_mm512_reduce_add_epi32(sum)) * q.scales[j0 + j];
  }
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k, bool groups, bool supers) {
  QuantizedRows q(m, k, groups, supers);
  if (groups) {
    const int64_t runs = (m * (k / kGroup) + 15) / 16;  // runs of 16 groups
    const int64_t grain = std::max<int64_t>(1, kQuantizeGrainInputs / (16 * kGroup));
    at::parallel_for(0, runs, grain, [&](int64_t begin, int64_t end) {
      for (int64_t run = begin; run < end; ++run) {
        quantize_groups(x, run * 16, std::min<int64_t>(16, m * (k / kGroup) - run * 16), q);
      }
    });
  }
  if (supers) {
    const int64_t blocks = m * (k / kSuper);
    at::parallel_for(0, blocks, std::max<int64_t>(1, kQuantizeGrainInputs / kSuper),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t j = begin; j < end; ++j) {
                         const int64_t r = j / (k / kSuper), b = j % (k / kSuper);
                         quantize_super_block(x + j * kSuper, r, b, k, q);
                       }
                     });
  }
  return q;
}

inline __m512 load_halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 signed bytes as 16 int32 lanes.
inline __m512i load_signed_bytes(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// fp32 to bf16, rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// The epilogue of one group for one row: acc + isum * (scales * xs) + offsets * xsum (xsum:
// the codes' sum times xs), in the stated order; the AMX path runs this very function.
inline __m512 accumulate(__m512 acc, __m512i isum, __m512 scales, __m512 offsets, float xs,
                         float xsum) {
  const __m512 step = _mm512_mul_ps(scales, _mm512_set1_ps(xs));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), step, acc);
  return _mm512_fmadd_ps(offsets, _mm512_set1_ps(xsum), acc);
}

// acc[r] plus the bias into row r0 + r of `out`, tile t's columns (the first `valid`).
template <int64_t Rows>
__attribute__((always_inline)) inline void store_rows(const __m512* acc, int64_t t, int64_t r0,
                                                      const Output& out, int64_t valid) {
  const __mmask16 mask = valid >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bias = out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + t * kTile)
                                          : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r) {
    const __m512 y = _mm512_add_ps(acc[r], bias);
    const int64_t first = (r0 + r) * out.stride + t * kTile;
    if (out.bf16) {
      _mm256_mask_storeu_epi16(static_cast<at::BFloat16*>(out.data) + first, mask, to_bf16(y));
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(out.data) + first, mask, y);
    }
  }
}

// `plane` shifted left by `s` bits in each byte's view (a negative s shifts right), masked
// to `mask`: the bits of one code vector from a plane of fifth (and sixth) bits. The 16-bit
// shift moves bits across bytes only outside `mask`.
template <int S>
inline __m512i plane_bits(__m512i plane, __m512i mask) {
  if constexpr (S > 0) return _mm512_and_si512(_mm512_slli_epi16(plane, S), mask);
  if constexpr (S < 0) return _mm512_and_si512(_mm512_srli_epi16(plane, -S), mask);
  return _mm512_and_si512(plane, mask);
}

// A group's 8 code vectors (see group_formats.h's layout) as 8-bit codes.
template <int64_t Bits>
__attribute__((always_inline)) inline void decode_group(const uint8_t* c, __m512i* v) {
  if constexpr (Bits == 8) {
    for (int i = 0; i < 8; ++i) v[i] = _mm512_loadu_si512(c + i * 64);
    return;
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i packed = _mm512_loadu_si512(c + j * 64);
    v[2 * j] = _mm512_and_si512(packed, nibble);
    v[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
  if constexpr (Bits == 5) {
    const __m512i plane = _mm512_loadu_si512(c + 256);
    const __m512i bit = _mm512_set1_epi8(0x10);
    v[0] = _mm512_or_si512(v[0], plane_bits<4>(plane, bit));
    v[1] = _mm512_or_si512(v[1], plane_bits<3>(plane, bit));
    v[2] = _mm512_or_si512(v[2], plane_bits<2>(plane, bit));
    v[3] = _mm512_or_si512(v[3], plane_bits<1>(plane, bit));
    v[4] = _mm512_or_si512(v[4], plane_bits<0>(plane, bit));
    v[5] = _mm512_or_si512(v[5], plane_bits<-1>(plane, bit));
    v[6] = _mm512_or_si512(v[6], plane_bits<-2>(plane, bit));
    v[7] = _mm512_or_si512(v[7], plane_bits<-3>(plane, bit));
  }
  if constexpr (Bits == 6) {
    const __m512i bits = _mm512_set1_epi8(0x30);
    for (int p = 0; p < 2; ++p) {
      const __m512i plane = _mm512_loadu_si512(c + 256 + p * 64);
      v[4 * p] = _mm512_or_si512(v[4 * p], plane_bits<4>(plane, bits));
      v[4 * p + 1] = _mm512_or_si512(v[4 * p + 1], plane_bits<2>(plane, bits));
      v[4 * p + 2] = _mm512_or_si512(v[4 * p + 2], plane_bits<0>(plane, bits));
      v[4 * p + 3] = _mm512_or_si512(v[4 * p + 3], plane_bits<-2>(plane, bits));
    }
  }
}

// The exact int32 sums of code vectors first..first+count-1 against a row's inputs `x`.
__attribute__((always_inline)) inline __m512i dot(const __m512i* v, int first, int count,
                                                  const int8_t* x) {
  __m512i isum = _mm512_setzero_si512();
  for (int i = first; i < first + count; ++i) {
    isum = _mm512_dpbusd_epi32(isum, v[i], broadcast4(x + 4 * i));
  }
  return isum;
}

// Rows r0..r0+Rows-1 against affine tile t, into the tile's columns of those rows of `out`.
template <int64_t Rows, int64_t Bits>
void affine_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0,
                 const Output& out, int64_t valid) {
  const int64_t k = w.k;
  const int64_t groups = k / kGroup;
  const Tile tile(w, t);
  const int8_t* xq = q.codes.get() + r0 * k;
  __m512 acc[Rows];
  for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i v[8];
    decode_group<Bits>(tile.codes + g * w.group_bytes(), v);
    const __m512 s = load_halves(tile.scales + g * kTile);
    const __m512 z = load_halves(tile.offsets + g * kTile);
    for (int64_t r = 0; r < Rows; ++r) {
      const int64_t row = (r0 + r) * groups + g;
      acc[r] = accumulate(acc[r], dot(v, 0, 8, xq + r * k + g * kGroup), s, z, q.scales[row],
                          q.sums[row]);
    }
  }
  store_rows<Rows>(acc, t, r0, out, valid);
}

// The sum over `count` small scales of a tile (16 bytes at p, p + step, ...; signed or
// not) times a row's integer input sums (one per scale, each the sum of `width` consecutive
// entries of `sums`), per output: a super-block's mins term or its centring term.
inline __m512i weighted_sums(const uint8_t* p, int64_t step, bool is_signed, const int32_t* sums,
                             int count, int width) {
  __m512i total = _mm512_setzero_si512();
  for (int j = 0; j < count; ++j) {
    int32_t sum = 0;
    for (int i = 0; i < width; ++i) sum += sums[j * width + i];
    const __m512i scales = is_signed ? load_signed_bytes(p + j * step)
                                     : _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                           reinterpret_cast<const __m128i*>(p + j * step)));
    total = _mm512_add_epi32(total, _mm512_mullo_epi32(scales, _mm512_set1_epi32(sum)));
  }
  return total;
}

// Rows r0..r0+Rows-1 against super-block tile t (x quantized per super-block).
template <int64_t Rows, int64_t Bits, int64_t Scheme>
void super_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0,
                const Output& out, int64_t valid) {
  const int64_t k = w.k;
  const int64_t blocks = k / kSuper;
  const Tile tile(w, t);
  __m512 acc[Rows];
  for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i isum[Rows];
    for (int64_t r = 0; r < Rows; ++r) isum[r] = _mm512_setzero_si512();
    const int8_t* xb = q.codes256.get() + r0 * k + b * kSuper;
    for (int64_t j = 0; j < kSuper / kGroup; ++j) {
      const int64_t g = b * (kSuper / kGroup) + j;
      __m512i v[8];
      decode_group<Bits>(tile.codes + g * w.group_bytes(), v);
      if constexpr (Scheme == kSuperMin) {
        const __m512i scale = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile.sub + g * 2 * kTile)));
        for (int64_t r = 0; r < Rows; ++r) {
          const __m512i sum = dot(v, 0, 8, xb + r * k + j * kGroup);
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sum, scale));
        }
      } else {
        const __m512i scale_a = load_signed_bytes(tile.sub + 2 * g * kTile);
        const __m512i scale_b = load_signed_bytes(tile.sub + (2 * g + 1) * kTile);
        for (int64_t r = 0; r < Rows; ++r) {
          const int8_t* x = xb + r * k + j * kGroup;
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot(v, 0, 4, x), scale_a));
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot(v, 4, 4, x), scale_b));
        }
      }
    }
    const __m512 d = load_halves(tile.scales + b * kTile);
    for (int64_t r = 0; r < Rows; ++r) {
      const int64_t row = r0 + r;
      const int32_t* sums16 = q.sums16.get() + row * (k / kHalf) + b * (kSuper / kHalf);
      const __m512 xs = _mm512_set1_ps(q.scales256[row * blocks + b]);
      if constexpr (Scheme == kSuperMin) {
        const uint8_t* mins = tile.sub + b * (kSuper / kGroup) * 2 * kTile + kTile;
        const __m512i msum = weighted_sums(mins, 2 * kTile, false, sums16, kSuper / kGroup, 2);
        const __m512 dmin = load_halves(tile.offsets + b * kTile);
        const __m512 mstep = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(dmin, xs)), _mm512_set1_epi32(INT32_MIN)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, xs), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), mstep, acc[r]);
      } else {
        const uint8_t* scales = tile.sub + b * (kSuper / kHalf) * kTile;
        const __m512i centring = weighted_sums(scales, kTile, true, sums16, kSuper / kHalf, 1);
        const __m512i sum = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(centring, Bits - 1));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, xs), acc[r]);
      }
    }
  }
  store_rows<Rows>(acc, t, r0, out, valid);
}

template <int64_t Rows, int64_t Bits, int64_t Scheme>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, const Output& out,
               int64_t valid) {
  if constexpr (Scheme == kAffine) {
    affine_rows<Rows, Bits>(w, t, q, r0, out, valid);
  } else {
    super_rows<Rows, Bits, Scheme>(w, t, q, r0, out, valid);
  }
}

template <int64_t Bits, int64_t Scheme>
void tile_run(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, int64_t rows,
              const Output& out, int64_t valid) {
  switch (rows) {
    case 1: return tile_rows<1, Bits, Scheme>(w, t, q, r0, out, valid);
    case 2: return tile_rows<2, Bits, Scheme>(w, t, q, r0, out, valid);
    case 3: return tile_rows<3, Bits, Scheme>(w, t, q, r0, out, valid);
    case 4: return tile_rows<4, Bits, Scheme>(w, t, q, r0, out, valid);
    case 5: return tile_rows<5, Bits, Scheme>(w, t, q, r0, out, valid);
    case 6: return tile_rows<6, Bits, Scheme>(w, t, q, r0, out, valid);
    case 7: return tile_rows<7, Bits, Scheme>(w, t, q, r0, out, valid);
    default: return tile_rows<8, Bits, Scheme>(w, t, q, r0, out, valid);
  }
}

static_assert(kRowRun == 8, "tile_run instantiates runs of 1 to 8 rows");

// Rows r_begin..r_end-1 against tile t, in runs of kRowRun rows.
template <int64_t Bits, int64_t Scheme>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r_begin,
               int64_t r_end, const Output& out, int64_t valid) {
  for (int64_t r = r_begin; r < r_end; r += kRowRun) {
    tile_run<Bits, Scheme>(w, t, q, r, std::min(kRowRun, r_end - r), out, valid);
  }
}

}  // namespace pagedserve_groups
