// The group-quantized linear's tiles on AVX2 (x86 CPUs without AVX-512: AMD before Zen 4,
// Intel's client cores): group_tiles_scalar.h's arithmetic, 8 outputs per vector.
//
// AVX2 has no VPDPBUSD: VPMADDUBSW multiplies 32 unsigned code bytes by signed input bytes
// and adds adjacent pairs into int16, and VPMADDWD multiplies those pairs by int16 factors
// and adds them into the int32 sum of each output's 4 inputs. The int16 sums are exact while
// they stay below 2^15: a pair of 4-bit codes gives at most 2 * 15 * 127 = 3,810, so a
// group's 8 code vectors add up in int16 before one widening; 5-bit codes widen every 4
// code vectors, 6-bit every 2, and 8-bit codes (which one pair could overflow) are split
// into nibbles, code = low + 16 high. The widening multiplies by ones, or by a super-block
// group's small scale (exact: at most 2 * 32,004 * 128 < 2^31). So the integer sums are
// exact, the float arithmetic runs in the scalar order, and the bits are the scalar code's.
//
// A tile's two halves of 8 outputs run together, in runs of up to 2 rows (AVX2 has 16
// vector registers), so each broadcast input serves 16 outputs. At one row the kernel is
// memory-bound, and the hardware prefetchers alone left it at about 21 GB/s on a 2-core
// Zen 3 whose cores stream 32 GB/s: each group asks the L2 for the codes `kPrefetchBytes`
// ahead (about 28 GB/s measured over a 1B model's shapes, `python -m bench.linear_kernels`).

#pragma once

#include <immintrin.h>

#include <cstring>

#include "group_formats.h"

namespace pagedserve_groups {

constexpr int64_t kRowRun = 2;  // rows sharing one pass over a tile's codes
// How far ahead of the group being computed its codes are prefetched into the L2 (measured
// at 12, 16, 24 and 32 KB on the 2-core Zen 3: 16 to 24 KB ran fastest).
constexpr int64_t kPrefetchBytes = 20 * 1024;

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

inline __m256 load8(const at::BFloat16* x) {  // exact: bf16 is fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// `quantize_super_block` with 8 lanes: the same bits (the maximum is exact in any order,
// each code is the same product rounded the same way, the sums are integers).
template <typename T>
void quantize_super_block8(const T* x, int64_t r, int64_t b, int64_t k, QuantizedRows& q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t i = 0; i < kSuper; i += 8) {
    lanes = _mm256_max_ps(_mm256_and_ps(load8(x + i), magnitude), lanes);  // NaN keeps lanes
  }
  alignas(32) float values[8];
  _mm256_store_ps(values, lanes);
  float amax = 0.0f;
  for (const float value : values) amax = std::max(amax, value);
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m256 scale = _mm256_set1_ps(inverse);
  int8_t* out = q.codes256.get() + r * k + b * kSuper;
  int32_t* sums = q.sums16.get() + r * (k / kHalf) + b * (kSuper / kHalf);
  for (int64_t h = 0; h < kSuper / kHalf; ++h) {
    // Rounded to nearest even (the default rounding, as std::nearbyint).
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + h * kHalf), scale));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + h * kHalf + 8), scale));
    alignas(32) int32_t codes[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), low);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8), high);
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) {
      out[h * kHalf + i] = static_cast<int8_t>(codes[i]);
      sum += codes[i];
    }
    sums[h] = sum;
  }
  q.scales256[r * (k / kSuper) + b] = amax / 127.0f;
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k, bool groups, bool supers) {
  QuantizedRows q(m, k, groups, supers);
  const int64_t grain = std::max<int64_t>(1, 16 * 1024 / k);
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (groups) quantize_row(x, r, k, q);
      for (int64_t b = 0; supers && b < k / kSuper; ++b) {
        quantize_super_block8(x + r * k + b * kSuper, r, b, k, q);
      }
    }
  });
  return q;
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

inline __m256 load_halves8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load_bytes8(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}

inline __m256 negated(__m256 v) {  // the sign bit flipped, as the scalar code negates
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
}

// `plane` shifted left by `S` bits in each byte's view (a negative S shifts right), masked:
// one code vector's fifth (and sixth) bits. The 16-bit shift moves bits across bytes only
// outside the mask.
template <int S>
inline __m256i plane_bits(__m256i plane, __m256i mask) {
  if constexpr (S > 0) return _mm256_and_si256(_mm256_slli_epi16(plane, S), mask);
  if constexpr (S < 0) return _mm256_and_si256(_mm256_srli_epi16(plane, -S), mask);
  return _mm256_and_si256(plane, mask);
}

// Code vectors 2J and 2J + 1 of a group, one half's 32 bytes of each (`c`: the group's
// codes plus the half's offset of 32 bytes), as 8-bit codes (8-bit codes: their nibbles).
template <int64_t Bits, int J>
__attribute__((always_inline)) inline void decode_pair(const uint8_t* c, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + J * 64));
  lo = _mm256_and_si256(packed, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
  if constexpr (Bits == 5) {
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256));
    const __m256i bit = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, plane_bits<4 - 2 * J>(plane, bit));
    hi = _mm256_or_si256(hi, plane_bits<3 - 2 * J>(plane, bit));
  }
  if constexpr (Bits == 6) {
    const __m256i plane =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256 + (J / 2) * 64));
    const __m256i bits = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, plane_bits<4 - 4 * (J % 2)>(plane, bits));
    hi = _mm256_or_si256(hi, plane_bits<2 - 4 * (J % 2)>(plane, bits));
  }
}

// Code vectors 2J and 2J + 1 of a group's two halves against `Rows` rows (`x`: row 0's
// group inputs, rows `stride` apart), added into the int16 sums s16[r][half].
template <int64_t Rows, int64_t Bits, int J>
__attribute__((always_inline)) inline void add_pair(const uint8_t* c, const int8_t* x,
                                                    int64_t stride, __m256i (*s16)[2]) {
  __m256i lo[2], hi[2];
  decode_pair<Bits, J>(c, lo[0], hi[0]);
  decode_pair<Bits, J>(c + 32, lo[1], hi[1]);
  for (int64_t r = 0; r < Rows; ++r) {
    const __m256i x0 = broadcast4(x + r * stride + 8 * J);
    const __m256i x1 = broadcast4(x + r * stride + 8 * J + 4);
    for (int h = 0; h < 2; ++h) {
      s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(lo[h], x0));
      s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(hi[h], x1));
    }
  }
}

// The int16 sums times `factor[half]` (int16, both of an output's pair lanes alike), added
// into isum; the sums are cleared.
template <int64_t Rows>
__attribute__((always_inline)) inline void widen(const __m256i* factor, __m256i (*s16)[2],
                                                 __m256i (*isum)[2]) {
  for (int64_t r = 0; r < Rows; ++r) {
    for (int h = 0; h < 2; ++h) {
      isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(s16[r][h], factor[h]));
      s16[r][h] = _mm256_setzero_si256();
    }
  }
}

// A group's small scales for outputs 0..7 and 8..15 (16 bytes at p) as int16 factors, each
// twice: the multipliers of VPMADDWD over an output's two int16 pair sums.
inline void pair_scales(const uint8_t* p, bool is_signed, __m256i* factor) {
  for (int h = 0; h < 2; ++h) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h));
    const __m128i twice = _mm_unpacklo_epi8(bytes, bytes);
    factor[h] = is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
  }
}

// The exact int32 sums of a group's code vectors against each row, per output: isum[r][h].
// 8-bit codes are summed as low and high nibbles, isum = low + 16 high.
template <int64_t Rows, int64_t Bits>
__attribute__((always_inline)) inline void group_sums(const uint8_t* c, const int8_t* x,
                                                      int64_t stride, __m256i (*isum)[2]) {
  const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
  __m256i s16[Rows][2];
  for (int64_t r = 0; r < Rows; ++r) {
    for (int h = 0; h < 2; ++h) isum[r][h] = s16[r][h] = _mm256_setzero_si256();
  }
  if constexpr (Bits == 8) {  // code vector pairs hold (low nibbles, high nibbles) of one vector
    const __m256i sixteen[2] = {_mm256_set1_epi16(16), _mm256_set1_epi16(16)};
    __m256i high[Rows][2];
    for (int64_t r = 0; r < Rows; ++r) high[r][0] = high[r][1] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      for (int h = 0; h < 2; ++h) {
        const __m256i codes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + v * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(codes, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), _mm256_set1_epi8(0x0F));
        for (int64_t r = 0; r < Rows; ++r) {
          const __m256i xr = broadcast4(x + r * stride + 4 * v);
          s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(lo, xr));
          high[r][h] = _mm256_add_epi16(high[r][h], _mm256_maddubs_epi16(hi, xr));
        }
      }
    }
    widen<Rows>(ones, s16, isum);
    widen<Rows>(sixteen, high, isum);
  } else {
    add_pair<Rows, Bits, 0>(c, x, stride, s16);
    if constexpr (Bits == 6) widen<Rows>(ones, s16, isum);
    add_pair<Rows, Bits, 1>(c, x, stride, s16);
    if constexpr (Bits >= 5) widen<Rows>(ones, s16, isum);
    add_pair<Rows, Bits, 2>(c, x, stride, s16);
    if constexpr (Bits == 6) widen<Rows>(ones, s16, isum);
    add_pair<Rows, Bits, 3>(c, x, stride, s16);
    widen<Rows>(ones, s16, isum);
  }
}

// A super-block group's sums, each widening multiplied by its small scale.
template <int64_t Rows, int64_t Bits, int64_t Scheme>
__attribute__((always_inline)) inline void scaled_group_sums(const Tile& tile, int64_t g,
                                                             const uint8_t* c, const int8_t* x,
                                                             int64_t stride,
                                                             __m256i (*isum)[2]) {
  __m256i s16[Rows][2];
  for (int64_t r = 0; r < Rows; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
  __m256i factor[2];
  if constexpr (Scheme == kSuperMin) {  // one scale per group of 32
    pair_scales(tile.sub + g * 2 * kTile, false, factor);
    add_pair<Rows, Bits, 0>(c, x, stride, s16);
    add_pair<Rows, Bits, 1>(c, x, stride, s16);
    if constexpr (Bits == 5) widen<Rows>(factor, s16, isum);
    add_pair<Rows, Bits, 2>(c, x, stride, s16);
    add_pair<Rows, Bits, 3>(c, x, stride, s16);
    widen<Rows>(factor, s16, isum);
  } else {  // one scale per 16 inputs: pairs 0 and 1, then 2 and 3
    pair_scales(tile.sub + 2 * g * kTile, true, factor);
    add_pair<Rows, Bits, 0>(c, x, stride, s16);
    widen<Rows>(factor, s16, isum);
    add_pair<Rows, Bits, 1>(c, x, stride, s16);
    widen<Rows>(factor, s16, isum);
    pair_scales(tile.sub + (2 * g + 1) * kTile, true, factor);
    add_pair<Rows, Bits, 2>(c, x, stride, s16);
    widen<Rows>(factor, s16, isum);
    add_pair<Rows, Bits, 3>(c, x, stride, s16);
    widen<Rows>(factor, s16, isum);
  }
}

// Pairs of a super-block's small scales (groups or sub-blocks 2p and 2p + 1) for each half,
// as int16 factors of VPMADDWD: lane 2n holds output n's scale of 2p, lane 2n + 1 its scale
// of 2p + 1 (`p`: the first of the 16-byte rows of scales, rows `step` bytes apart).
inline void scale_pairs(const uint8_t* p, int64_t step, int pairs, bool is_signed,
                        __m256i (*factor)[2]) {
  for (int pair = 0; pair < pairs; ++pair) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* at = p + 2 * pair * step + 8 * h;
      const __m128i first = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
      const __m128i second = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + step));
      const __m128i both = _mm_unpacklo_epi8(first, second);
      factor[pair][h] = is_signed ? _mm256_cvtepi8_epi16(both) : _mm256_cvtepu8_epi16(both);
    }
  }
}

// Per output of half h: sum over the scales of `factor` times a row's integer input sums
// (`sums`, one per scale, each the sum of `width` consecutive entries; each below 2^15),
// a super-block's mins or centring term, exact in int32.
inline __m256i weighted_sums(const __m256i (*factor)[2], int h, const int32_t* sums, int pairs,
                             int width) {
  __m256i total = _mm256_setzero_si256();
  for (int pair = 0; pair < pairs; ++pair) {
    int32_t first = 0, second = 0;
    for (int i = 0; i < width; ++i) {
      first += sums[2 * pair * width + i];
      second += sums[(2 * pair + 1) * width + i];
    }
    const int32_t both = static_cast<int32_t>((static_cast<uint32_t>(first) & 0xFFFF) |
                                              (static_cast<uint32_t>(second) << 16));
    total = _mm256_add_epi32(total, _mm256_madd_epi16(factor[pair][h], _mm256_set1_epi32(both)));
  }
  return total;
}

inline void prefetch_group(const uint8_t* c, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T1);
  }
}

// Rows r0..r0+Rows-1 against affine tile t (x quantized per group of 32).
template <int64_t Rows, int64_t Bits>
void affine_rows(const Weights& w, const Tile& tile, const QuantizedRows& q, int64_t r0,
                 float (*acc)[kTile]) {
  const int64_t k = w.k;
  const int64_t groups = k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = tile.codes + g * w.group_bytes();
    if (r0 == 0) prefetch_group(c, w.group_bytes());  // later runs find it cached
    __m256i isum[Rows][2];
    group_sums<Rows, Bits>(c, q.codes.get() + r0 * k + g * kGroup, k, isum);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load_halves8(tile.scales + g * kTile + 8 * h);
      const __m256 z = load_halves8(tile.offsets + g * kTile + 8 * h);
      for (int64_t r = 0; r < Rows; ++r) {
        const int64_t row = (r0 + r) * groups + g;
        const __m256 step = _mm256_mul_ps(s, _mm256_set1_ps(q.scales[row]));
        __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), step,
                                   _mm256_load_ps(acc[r] + 8 * h));
        a = _mm256_fmadd_ps(z, _mm256_set1_ps(q.sums[row]), a);
        _mm256_store_ps(acc[r] + 8 * h, a);
      }
    }
  }
}

// Rows r0..r0+Rows-1 against super-block tile t (x quantized per super-block of 256).
template <int64_t Rows, int64_t Bits, int64_t Scheme>
void super_rows(const Weights& w, const Tile& tile, const QuantizedRows& q, int64_t r0,
                float (*acc)[kTile]) {
  const int64_t k = w.k;
  const int64_t blocks = k / kSuper;
  constexpr int pairs = Scheme == kSuperMin ? kSuper / kGroup / 2 : kSuper / kHalf / 2;
  __m256i factor[pairs][2];
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (Scheme == kSuperMin) {  // the groups' minimums
      scale_pairs(tile.sub + b * (kSuper / kGroup) * 2 * kTile + kTile, 2 * kTile, pairs, false,
                  factor);
    } else {  // the sub-blocks' scales
      scale_pairs(tile.sub + b * (kSuper / kHalf) * kTile, kTile, pairs, true, factor);
    }
    __m256i isum[Rows][2];
    for (int64_t r = 0; r < Rows; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < kSuper / kGroup; ++j) {
      const int64_t g = b * (kSuper / kGroup) + j;
      const uint8_t* c = tile.codes + g * w.group_bytes();
      if (r0 == 0) prefetch_group(c, w.group_bytes());  // later runs find it cached
      const int8_t* x = q.codes256.get() + r0 * k + g * kGroup;
      scaled_group_sums<Rows, Bits, Scheme>(tile, g, c, x, k, isum);
    }
    for (int64_t r = 0; r < Rows; ++r) {
      const int64_t row = r0 + r;
      const int32_t* sums16 = q.sums16.get() + row * (k / kHalf) + b * (kSuper / kHalf);
      const __m256 xs = _mm256_set1_ps(q.scales256[row * blocks + b]);
      for (int h = 0; h < 2; ++h) {
        const __m256 step = _mm256_mul_ps(load_halves8(tile.scales + b * kTile + 8 * h), xs);
        float* a = acc[r] + 8 * h;
        if constexpr (Scheme == kSuperMin) {
          const __m256i msum = weighted_sums(factor, h, sums16, pairs, 2);
          const __m256 mstep =
              negated(_mm256_mul_ps(load_halves8(tile.offsets + b * kTile + 8 * h), xs));
          const __m256 v =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), step, _mm256_load_ps(a));
          _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), mstep, v));
        } else {
          const __m256i centring = weighted_sums(factor, h, sums16, pairs, 1);
          const __m256i sum = _mm256_sub_epi32(isum[r][h], _mm256_slli_epi32(centring, Bits - 1));
          _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), step, _mm256_load_ps(a)));
        }
      }
    }
  }
}

// Rows r0..r0+rows-1 (at most kRowRun) against tile t, into the tile's columns of `out`.
template <int64_t Bits, int64_t Scheme>
void tile_run(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, int64_t rows,
              const Output& out, int64_t valid) {
  const Tile tile(w, t);
  alignas(32) float acc[kRowRun][kTile] = {};
  if constexpr (Scheme == kAffine) {
    if (rows == 2) affine_rows<2, Bits>(w, tile, q, r0, acc);
    else affine_rows<1, Bits>(w, tile, q, r0, acc);
  } else {
    if (rows == 2) super_rows<2, Bits, Scheme>(w, tile, q, r0, acc);
    else super_rows<1, Bits, Scheme>(w, tile, q, r0, acc);
  }
  for (int64_t r = 0; r < rows; ++r) store_lanes(acc[r], t, r0 + r, out, valid);
}

static_assert(kRowRun == 2, "tile_run instantiates runs of 1 and 2 rows");

}  // namespace pagedserve_groups
