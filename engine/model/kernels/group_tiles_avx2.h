// The group-quantized linear's tiles on AVX2 (x86 CPUs without AVX-512: AMD before Zen 4,
// Intel's client cores): group_tiles_scalar.h's arithmetic, 8 outputs per vector.
//
// AVX2 has no VPDPBUSD: VPMADDUBSW multiplies 32 unsigned code bytes by signed input bytes
// and adds adjacent pairs into int16, and VPMADDWD multiplies those pairs by int16 factors
// and adds them into the int32 sum of each output's 4 inputs. The int16 sums are exact while
// they stay below 2^15: a pair of 4-bit codes gives at most 2 * 15 * 127 = 3,810, so a
// group's 8 code vectors add up in int16 before one widening; 5-bit codes widen every 4
// code vectors, 6-bit every 2, and 8-bit codes (which one pair could overflow) are split
// into nibbles, code = low + 16 high (decoded tiles take them signed: `add_signed`). The
// widening multiplies by ones, or by a super-block group's small scale (exact: at most
// 2 * 32,004 * 128 < 2^31). So the integer sums are exact, the float arithmetic runs in the
// scalar order, and the bits are the scalar code's.
//
// Below 8 rows (decode), a tile's two halves of 8 outputs run together, in runs of up to 2
// rows (AVX2 has 16 vector registers), so each broadcast input serves 16 outputs. At one row
// the kernel is memory-bound, and the hardware prefetchers alone leave it short of what the
// cores can stream: each group asks the L2 for the codes `kPrefetchBytes` ahead (`python -m
// bench.linear_kernels` measures it). With more rows (prefill, batched decode) the kernel is
// compute-bound, and every format runs on decoded tiles (`decoded_tile`), which pay
// from `kDecodedMinRows` rows on (below it decoding a tile costs more than it saves), in
// runs of `kDecodedRun` rows: runs of 8 rows beat runs of 6 (4-bit codes) and of 4 (5- and
// 6-bit codes) by 15-35% a core, though their sums no longer all fit AVX2's 16 registers.

#pragma once

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "group_formats.h"

namespace pagedserve_groups {

constexpr int64_t kRowRun = 2;  // rows sharing one pass over a tile's codes
// Calls of at least kDecodedMinRows rows run codes of 4 to 6 bits on decoded tiles, in runs
// of up to kDecodedRun rows (see `decoded_tile`), from x's rows interleaved kInterleave at a
// time (a run's rows in one block).
constexpr int64_t kDecodedMinRows = 8;
constexpr int64_t kDecodedRun = 8;
constexpr int64_t kInterleave = kDecodedRun;
// How far ahead of the group being computed its codes are prefetched into the L2: between
// the distances that run fastest (16 to 24 KB).
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
  const auto pair = [](int32_t first, int32_t second) {
    return static_cast<int32_t>((static_cast<uint32_t>(first) & 0xFFFF) |
                                (static_cast<uint32_t>(second) << 16));
  };
  int32_t* pairs = q.pair_sums.get() + (r * (k / kSuper) + b) * QuantizedRows::kPairSums;
  for (int p = 0; p < 4; ++p) {
    pairs[p] = pair(sums[4 * p] + sums[4 * p + 1], sums[4 * p + 2] + sums[4 * p + 3]);
  }
  for (int p = 0; p < 8; ++p) pairs[4 + p] = pair(sums[2 * p], sums[2 * p + 1]);
}

// Rows r of `codes` [m, k] into `runs`, interleaved as QuantizedRows states.
inline void interleave_row(const int8_t* codes, int64_t r, int64_t k, int8_t* runs) {
  int8_t* out = runs + (r / kInterleave) * kInterleave * k + (r % kInterleave) * 4;
  for (int64_t i = 0; i < k; i += 4) std::memcpy(out + i * kInterleave, codes + r * k + i, 4);
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k, bool groups, bool supers) {
  QuantizedRows q(m, k, groups, supers);
  const bool runs = m >= kDecodedMinRows;
  const int64_t padded = (m + kInterleave - 1) / kInterleave * kInterleave * k;
  if (runs && groups) q.runs.reset(new int8_t[padded]());
  if (runs && groups) q.code_sums.reset(new int32_t[m * (k / kGroup)]);
  if (runs && supers) q.runs256.reset(new int8_t[padded]());
  if (supers) q.pair_sums.reset(new int32_t[m * (k / kSuper) * QuantizedRows::kPairSums]);
  const int64_t grain = std::max<int64_t>(1, 16 * 1024 / k);
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (groups) quantize_row(x, r, k, q);
      for (int64_t b = 0; supers && b < k / kSuper; ++b) {
        quantize_super_block8(x + r * k + b * kSuper, r, b, k, q);
      }
      if (runs && groups) interleave_row(q.codes.get(), r, k, q.runs.get());
      if (runs && supers) interleave_row(q.codes256.get(), r, k, q.runs256.get());
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
// (`pairs`: the row's pairs of them, `QuantizedRows::pair_sums`), a super-block's mins or
// centring term, exact in int32.
inline __m256i weighted_sums(const __m256i (*factor)[2], int h, const int32_t* pairs,
                             int count) {
  __m256i total = _mm256_setzero_si256();
  for (int pair = 0; pair < count; ++pair) {
    total = _mm256_add_epi32(total, _mm256_madd_epi16(factor[pair][h], _mm256_set1_epi32(pairs[pair])));
  }
  return total;
}

// Group g's share of one row's 8 outputs of half h (`a`): its integer sums `isum` times the
// group's scale and the row's (the row's group `row` of q), plus the offset times the row's
// sum. The same operations in the same order on every path.
inline void affine_epilogue(const Tile& tile, int64_t g, const QuantizedRows& q, int64_t row,
                            int h, __m256i isum, float* a) {
  const __m256 s = load_halves8(tile.scales + g * kTile + 8 * h);
  const __m256 z = load_halves8(tile.offsets + g * kTile + 8 * h);
  const __m256 step = _mm256_mul_ps(s, _mm256_set1_ps(q.scales[row]));
  const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), step, _mm256_loadu_ps(a));
  _mm256_storeu_ps(a, _mm256_fmadd_ps(z, _mm256_set1_ps(q.sums[row]), v));
}

// Super-block b's share of row `row`'s 8 outputs of half h (`a`): the integer sums `isum`
// (already times the small scales) times d and the row's scale, less the minimums' term
// (SUPER_MIN), or less the centring term first (SUPER_SIGNED), as group_tiles_scalar.h.
template <int64_t Bits, int64_t Scheme, int Pairs>
inline void super_epilogue(const Tile& tile, int64_t b, const QuantizedRows& q, int64_t k,
                           int64_t row, int h, const __m256i (*factor)[2], __m256i isum,
                           float* a) {
  const int64_t blocks = k / kSuper;
  const int32_t* pairs = q.pair_sums.get() + (row * blocks + b) * QuantizedRows::kPairSums;
  const __m256 xs = _mm256_set1_ps(q.scales256[row * blocks + b]);
  const __m256 step = _mm256_mul_ps(load_halves8(tile.scales + b * kTile + 8 * h), xs);
  if constexpr (Scheme == kSuperMin) {
    const __m256i msum = weighted_sums(factor, h, pairs, Pairs);
    const __m256 mstep = negated(_mm256_mul_ps(load_halves8(tile.offsets + b * kTile + 8 * h), xs));
    const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), step, _mm256_loadu_ps(a));
    _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), mstep, v));
  } else {
    const __m256i centring = weighted_sums(factor, h, pairs + 4, Pairs);
    const __m256i sum = _mm256_sub_epi32(isum, _mm256_slli_epi32(centring, Bits - 1));
    _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), step, _mm256_loadu_ps(a)));
  }
}

// Pairs of a super-block's small scales per half for `weighted_sums`: its groups' minimums
// (SUPER_MIN) or its sub-blocks' scales (SUPER_SIGNED).
template <int64_t Scheme, int Pairs>
inline void super_factors(const Tile& tile, int64_t b, __m256i (*factor)[2]) {
  if constexpr (Scheme == kSuperMin) {
    scale_pairs(tile.sub + b * (kSuper / kGroup) * 2 * kTile + kTile, 2 * kTile, Pairs, false,
                factor);
  } else {
    scale_pairs(tile.sub + b * (kSuper / kHalf) * kTile, kTile, Pairs, true, factor);
  }
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
      for (int64_t r = 0; r < Rows; ++r) {
        affine_epilogue(tile, g, q, (r0 + r) * groups + g, h, isum[r][h], acc[r] + 8 * h);
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
    super_factors<Scheme, pairs>(tile, b, factor);
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
      for (int h = 0; h < 2; ++h) {
        super_epilogue<Bits, Scheme, pairs>(tile, b, q, k, r0 + r, h, factor, isum[r][h],
                                            acc[r] + 8 * h);
      }
    }
  }
}

// Many rows: decoded tiles. From `kDecodedMinRows` rows on, a call is compute-bound, and
// decoding a group's codes for every run of 2 rows, with 16 outputs' sums live at once, left
// the kernel spilling registers. So a tile's codes are decoded once per chunk of
// `kChunkGroups` groups into 8-bit code vectors (16 KB, held in the L1), and runs of up to
// `kDecodedRun` rows take them half by half (8 outputs): per pair of code vectors, two
// loads, and per row two broadcasts (from `QuantizedRows::runs`, the rows interleaved, so
// one pointer reaches a run's rows), two VPMADDUBSW and two adds.
// The integer sums are the same exact integers, widened on the same schedule, and each
// row's float operations are `affine_epilogue`'s or `super_epilogue`'s in the same order,
// so the bits are those of the runs above. 8-bit codes decode to code - 128, whose products
// with x need no split into nibbles (`add_signed`: 1.2-1.4x the split's speed at 64 to
// 4,480 rows of MiniLM's shapes, two cores), and the epilogue adds back 128 times the sum
// of the row's codes.
constexpr int64_t kChunkGroups = 32;
constexpr int64_t kDecodedGroup = 2 * 4 * 64;  // bytes: [half][pair][low, high][32]

// Group g's code vectors (`c`: its packed codes) into `out`, as `kDecodedGroup` bytes.
template <int64_t Bits>
inline void decode_group(const uint8_t* c, uint8_t* out) {
  if constexpr (Bits == 8) {  // code vector v's half h at h * 256 + v * 32, as code - 128
    const __m256i centre = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < 2; ++h) {
      for (int v = 0; v < 8; ++v) {
        const __m256i codes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + v * 64 + 32 * h));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + h * 256 + v * 32),
                           _mm256_xor_si256(codes, centre));
      }
    }
    return;
  }
  const auto store = [&](int h, int j, __m256i lo, __m256i hi) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + h * 256 + j * 64), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + h * 256 + j * 64 + 32), hi);
  };
  for (int h = 0; h < 2; ++h) {
    __m256i lo, hi;
    decode_pair<Bits, 0>(c + 32 * h, lo, hi);
    store(h, 0, lo, hi);
    decode_pair<Bits, 1>(c + 32 * h, lo, hi);
    store(h, 1, lo, hi);
    decode_pair<Bits, 2>(c + 32 * h, lo, hi);
    store(h, 2, lo, hi);
    decode_pair<Bits, 3>(c + 32 * h, lo, hi);
    store(h, 3, lo, hi);
  }
}

// Decoded pair J of one half (`d`: the half's 256 bytes) against `Rows` rows of a run, into
// s16[r] (`x`: the run's interleaved codes of the group).
template <int64_t Rows, int J>
__attribute__((always_inline)) inline void add_decoded(const uint8_t* d, const int8_t* x,
                                                       __m256i* s16) {
  const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(d + J * 64));
  const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(d + J * 64 + 32));
  for (int64_t r = 0; r < Rows; ++r) {
    const int8_t* at = x + 8 * kInterleave * J + 4 * r;
    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, broadcast4(at)));
    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, broadcast4(at + 4 * kInterleave)));
    // A running sum, its row's loads not moved ahead: left free, GCC loads every row's
    // inputs first and adds the products in a tree, which needs more registers than AVX2
    // has, and spills.
    asm("" : "+x"(s16[r]));
  }
}

// A decoded half of 8-bit codes (`d`: its code vectors as s = code - 128) against `Rows` rows
// of a run, into isum[r] as sum s * x. VPMADDUBSW takes |s| (VPABSB leaves -128 as the byte
// 0x80, which it reads as the unsigned 128) times x with s's sign (VPSIGNB), so each int16
// pair is at most 2 * 128 * 127 < 2^15, exact, and is widened at once.
template <int64_t Rows>
__attribute__((always_inline)) inline void add_signed(const uint8_t* d, const int8_t* x,
                                                      __m256i* isum) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int v = 0; v < 8; ++v) {
    const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(d + v * 32));
    const __m256i magnitude = _mm256_abs_epi8(s);
    for (int64_t r = 0; r < Rows; ++r) {
      const __m256i signed_x = _mm256_sign_epi8(broadcast4(x + 4 * kInterleave * v + 4 * r), s);
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, ones));
    }
  }
}

template <int64_t Rows>
__attribute__((always_inline)) inline void widen_half(__m256i factor, __m256i* s16,
                                                      __m256i* isum) {
  for (int64_t r = 0; r < Rows; ++r) {
    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], factor));
    s16[r] = _mm256_setzero_si256();
  }
}

// Half h's 8 small scales (`p`: the 16 of a group or sub-block) as `pair_scales` makes them.
inline __m256i half_scales(const uint8_t* p, int h, bool is_signed) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h));
  const __m128i twice = _mm_unpacklo_epi8(bytes, bytes);
  return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

// Group g's decoded half h against `Rows` rows of a run, added into isum[r] (times the
// group's small scales for the super-block schemes), widened as `group_sums` and
// `scaled_group_sums` do.
template <int64_t Rows, int64_t Bits, int64_t Scheme>
__attribute__((always_inline)) inline void decoded_group_sums(const Tile& tile, int64_t g, int h,
                                                              const uint8_t* d, const int8_t* x,
                                                              __m256i* isum) {
  if constexpr (Bits == 8) return add_signed<Rows>(d, x, isum);
  __m256i s16[Rows];
  for (int64_t r = 0; r < Rows; ++r) s16[r] = _mm256_setzero_si256();
  __m256i first = _mm256_set1_epi16(1), second = first;
  if constexpr (Scheme == kSuperMin) {
    first = second = half_scales(tile.sub + g * 2 * kTile, h, false);
  } else if constexpr (Scheme == kSuperSigned) {
    first = half_scales(tile.sub + 2 * g * kTile, h, true);
  }
  add_decoded<Rows, 0>(d, x, s16);
  if constexpr (Bits == 6) widen_half<Rows>(first, s16, isum);
  add_decoded<Rows, 1>(d, x, s16);
  if constexpr (Bits >= 5) widen_half<Rows>(first, s16, isum);
  if constexpr (Scheme == kSuperSigned) second = half_scales(tile.sub + (2 * g + 1) * kTile, h, true);
  add_decoded<Rows, 2>(d, x, s16);
  if constexpr (Bits == 6) widen_half<Rows>(second, s16, isum);
  add_decoded<Rows, 3>(d, x, s16);
  widen_half<Rows>(second, s16, isum);
}

// Row r0's inputs of group g in the interleaved rows `runs` (a run's rows follow it, 4 bytes
// apart, in the same block of kInterleave rows).
inline const int8_t* run_inputs(const int8_t* runs, int64_t k, int64_t r0, int64_t g) {
  return runs + (r0 / kInterleave) * kInterleave * k + g * kGroup * kInterleave +
         (r0 % kInterleave) * 4;
}

// Rows r0..r0+Rows-1 against groups g0..g1 of a tile (`decoded`: their codes, decoded), into
// acc (rows of kTile floats).
template <int64_t Rows, int64_t Bits, int64_t Scheme>
void decoded_rows(const Weights& w, const Tile& tile, const QuantizedRows& q, int64_t r0,
                  int64_t g0, int64_t g1, const uint8_t* decoded, float* acc) {
  const int64_t k = w.k;
  for (int h = 0; h < 2; ++h) {
    if constexpr (Scheme == kAffine) {
      for (int64_t g = g0; g < g1; ++g) {
        __m256i isum[Rows];
        for (int64_t r = 0; r < Rows; ++r) isum[r] = _mm256_setzero_si256();
        const int8_t* x = run_inputs(q.runs.get(), k, r0, g);
        decoded_group_sums<Rows, Bits, Scheme>(
            tile, g, h, decoded + (g - g0) * kDecodedGroup + h * 256, x, isum);
        for (int64_t r = 0; r < Rows; ++r) {
          if constexpr (Bits == 8) {  // sum code * x = sum (code - 128) * x + 128 sum x
            const int32_t sum = q.code_sums[(r0 + r) * (k / kGroup) + g];
            isum[r] = _mm256_add_epi32(isum[r], _mm256_set1_epi32(128 * sum));
          }
          affine_epilogue(tile, g, q, (r0 + r) * (k / kGroup) + g, h, isum[r],
                          acc + r * kTile + 8 * h);
        }
      }
    } else {
      constexpr int pairs = Scheme == kSuperMin ? kSuper / kGroup / 2 : kSuper / kHalf / 2;
      __m256i factor[pairs][2];
      for (int64_t b = g0 / (kSuper / kGroup); b < g1 / (kSuper / kGroup); ++b) {
        super_factors<Scheme, pairs>(tile, b, factor);
        __m256i isum[Rows];
        for (int64_t r = 0; r < Rows; ++r) isum[r] = _mm256_setzero_si256();
        for (int64_t g = b * (kSuper / kGroup); g < (b + 1) * (kSuper / kGroup); ++g) {
          const int8_t* x = run_inputs(q.runs256.get(), k, r0, g);
          decoded_group_sums<Rows, Bits, Scheme>(
              tile, g, h, decoded + (g - g0) * kDecodedGroup + h * 256, x, isum);
        }
        for (int64_t r = 0; r < Rows; ++r) {
          super_epilogue<Bits, Scheme, pairs>(tile, b, q, k, r0 + r, h, factor, isum[r],
                                              acc + r * kTile + 8 * h);
        }
      }
    }
  }
}

// Rows r_begin..r_end-1 (at least kDecodedMinRows) against tile t, chunk by chunk of groups
// (r_begin a multiple of kInterleave).
template <int64_t Bits, int64_t Scheme>
void decoded_tile(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r_begin,
                  int64_t r_end, const Output& out, int64_t valid) {
  static_assert(kChunkGroups % (kSuper / kGroup) == 0, "chunks hold whole super-blocks");
  alignas(32) static thread_local uint8_t decoded[kChunkGroups * kDecodedGroup];
  static thread_local std::vector<float> acc;
  const Tile tile(w, t);
  acc.assign((r_end - r_begin) * kTile, 0.0f);
  const int64_t groups = w.k / kGroup;
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t g1 = std::min(groups, g0 + kChunkGroups);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* c = tile.codes + g * w.group_bytes();
      prefetch_group(c, w.group_bytes());
      decode_group<Bits>(c, decoded + (g - g0) * kDecodedGroup);
    }
    for (int64_t r0 = r_begin; r0 < r_end;) {
      float* a = acc.data() + (r0 - r_begin) * kTile;
      const int64_t rows = std::min(kDecodedRun, r_end - r0);
      static_assert(kDecodedRun == 8, "the cases below instantiate runs of 1 to 8 rows");
      switch (rows) {
        case 8: decoded_rows<8, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        case 7: decoded_rows<7, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        case 6: decoded_rows<6, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        case 5: decoded_rows<5, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        case 4: decoded_rows<4, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        case 3: decoded_rows<3, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        case 2: decoded_rows<2, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a); break;
        default: decoded_rows<1, Bits, Scheme>(w, tile, q, r0, g0, g1, decoded, a);
      }
      r0 += rows;
    }
  }
  for (int64_t r = r_begin; r < r_end; ++r) {
    store_lanes(acc.data() + (r - r_begin) * kTile, t, r, out, valid);
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

// Rows r_begin..r_end-1 against tile t: decoded tiles from kDecodedMinRows rows on, else runs
// of kRowRun rows over the packed codes.
template <int64_t Bits, int64_t Scheme>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r_begin,
               int64_t r_end, const Output& out, int64_t valid) {
  if (r_end - r_begin >= kDecodedMinRows) {
    return decoded_tile<Bits, Scheme>(w, t, q, r_begin, r_end, out, valid);
  }
  for (int64_t r = r_begin; r < r_end; r += kRowRun) {
    tile_run<Bits, Scheme>(w, t, q, r, std::min(kRowRun, r_end - r), out, valid);
  }
}

}  // namespace pagedserve_groups
