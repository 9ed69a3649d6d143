// Group-quantized linear on the CPU, at every row count: y = x W^T, where W is stored as
// unsigned codes of 8 or 4 bits with a scale and an offset per group of 32 inputs:
// W[n][k] = scales[n][g] * codes[n][k] + offsets[n][g], g = k / 32. With 4 bits this is
// llama.cpp's Q4_1 format; 8 bits is its asymmetric 8-bit twin.
//
// Why. At decode a linear streams every weight from memory once per step, so its time is
// the weights' bytes over the memory bandwidth, if the arithmetic keeps up. Widening each
// code to fp32 and multiplying it in fp32 did not keep up on 2 cores (a second row cost
// almost as much as the first). So, as llama.cpp does, each row of x is quantized per group
// of 32 to int8 (scale = max|x| / 127) and the products are integer dot products: AVX512-VNNI
// multiplies 64 code bytes into 16 int32 sums in one instruction.
//
// Arithmetic. For an output n and a row m of x, over the groups g in order:
//   isum = sum_{k in g} codes[n][k] * xq[m][k]                  (int32, exact)
//   acc  = fma(float(isum), scales[n][g] * xs[m][g], acc)
//   acc  = fma(offsets[n][g], xsum[m][g], acc)
// where xq, xs are x's int8 codes and scale and xsum is the group's plain fp32 sum of x
// (in order), so the offsets meet the exact inputs. The integer sums are exact and the
// float operations run in this order for every output, in the vector code and the scalar
// code alike, so a row's bits depend only on that row and the weights, never on the number
// of rows, the other rows, the thread count or the instruction set.
//
// AMX. With many rows (prefill chunks, decode batches) the kernel is compute-bound, not
// memory-bound: on VNNI each group of 16 outputs x 32 inputs x 1 row takes 8 dot-product
// instructions (plus the nibble unpacking) before its 4-operation epilogue. Where the
// compiler targets AMX-INT8 (-march=native on such a CPU) and Linux grants the tile data
// (ARCH_REQ_XCOMP_PERM, asked once per process), a call of at least `kAmxMinRows` rows
// runs its blocks of 16 rows on AMX: per group, A = 16 rows x 32 bytes of x's codes, B = the
// tile's codes for the group (8 rows x 64 bytes: the 8-bit layout as it is, 4-bit codes
// unpacked once per tile and chunk of rows), one TDPBSUD makes the 16 x 16 exact int32
// group sums, and the same vector epilogue (`accumulate`) takes them row by row; the other
// rows run on VNNI. The arithmetic is unchanged: the sums are exact integers either way and
// the epilogue is the same operations in the same order, so the bits are the same (tests/
// engine/test_group_linear_amx.py). x is quantized with gathers (a lane per group, its
// inputs in order), the same operations as the scalar loop. Measured (bench.linear_kernels,
// 1 thread, bf16, a SmolLM2 step's linears, int4): 16 rows 21.9 -> 17.6 ms, 64 rows 65.9 ->
// 40.1 ms, 512 rows 455 -> 319 ms; AMX beats VNNI from 16 rows on (the smallest block), so
// kAmxMinRows = 16. The epilogue (a multiply, a conversion and two FMAs per output and
// group, on the one 512-bit FMA port of the CPU measured) now bounds it, with the tile loads
// and stores, which do not overlap it: oneDNN's AMX-bf16 matmul stays about 2x faster at 512
// rows.
//
// Layout (made by group_linear.py's `pack`): outputs in tiles of 16. 8-bit codes are
// [tiles, K / 4, 16, 4]: 64 bytes hold 4 consecutive inputs of each of the tile's 16
// outputs, the operand of one VNNI instruction. 4-bit codes are [tiles, K / 8, 16, 4]: the
// low nibbles hold inputs 8j..8j+3 and the high nibbles 8j+4..8j+7. Scales and offsets are
// fp16 [tiles, K / 32, 16], as GGUF stores them. The last tile may be partly padding
// (outputs >= N, not written).
//
// Inputs: x [M, K] fp32 or bf16 with K a multiple of 32, an optional bias [N]; returns
// [M, N] in x's dtype: the fp32 result plus the bias, rounded once.
//
// The op `pagedserve::quantized_linear(x, handle)` runs a registered layer (`register_layer`:
// its packed weight, bias and row threshold) in C++ from end to end, with no Python between
// the caller and the kernel: `quantized_linear.QuantizedLinear` calls it in eager steps and
// compiled graphs alike (211 calls a SmolLM2 step). A call of more rows than the layer's
// threshold calls back the Python function given to `set_dense_fallback` (the layer's dense
// path), where a call's arithmetic outweighs that cost.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

// PAGEDSERVE_SCALAR_TWIN builds the scalar code on any CPU and leaves the op out: the
// tests build that twin to check that both give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    !defined(PAGEDSERVE_SCALAR_TWIN)
#include <immintrin.h>
#define PAGEDSERVE_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include "amx_tiles.h"
#define PAGEDSERVE_AMX 1
#endif
#endif

namespace {

constexpr int64_t kTile = 16;   // outputs per tile: one vector of 16 int32 or fp32 lanes
constexpr int64_t kGroup = 32;  // inputs per scale group
constexpr int64_t kRowRun = 8;  // rows sharing one pass over a tile's codes (2 x 8 accumulators
// fit the 32 vector registers; runs of 8 against 4: a SmolLM2 step's int4 linears at 8
// rows 8.08 -> 7.23 ms, 1 thread, AVX512-VNNI without AMX; 1 row unchanged)
// Bytes of codes per task of at::parallel_for: smaller layers run on the calling thread.
constexpr int64_t kGrainBytes = 32 * 1024;

// One row per `k` inputs: int8 codes, and per group the scale and the plain sum.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> codes;  // [m, k], uninitialized until quantized
  std::unique_ptr<float[]> scales;  // [m, k / 32]
  std::unique_ptr<float[]> sums;    // [m, k / 32]

  QuantizedRows(int64_t m, int64_t k)
      : codes(new int8_t[m * k]), scales(new float[m * (k / 32)]), sums(new float[m * (k / 32)]) {}
};

// Row r of x into q: per group of 32, scale = max|x| / 127, the codes x * (127 / max|x|)
// rounded to nearest even, and the sum of x in order.
template <typename T>
void quantize_row(const T* x, int64_t r, int64_t k, QuantizedRows& q) {
  const int64_t groups = k / 32;
  float values[32];
  for (int64_t g = 0; g < groups; ++g) {
    const T* p = x + r * k + g * 32;
    float amax = 0.0f;
    float sum = 0.0f;
    for (int64_t i = 0; i < 32; ++i) {
      values[i] = static_cast<float>(p[i]);
      amax = std::max(amax, std::fabs(values[i]));
      sum += values[i];
    }
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* out = q.codes.get() + r * k + g * 32;
    for (int64_t i = 0; i < 32; ++i) {
      out[i] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
    }
    q.scales[r * groups + g] = amax / 127.0f;
    q.sums[r * groups + g] = sum;
  }
}

#ifdef PAGEDSERVE_VNNI

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
// group, taking its 32 inputs in turn, so that each lane's sum adds them in order and its
// max is std::max's (amax stays where |x| is NaN or equal).
template <typename T>
void quantize_groups(const T* x, int64_t j0, int64_t count, QuantizedRows& q) {
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(std::is_same_v<T, float> ? kGroup : kGroup / 2));
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  const T* base = x + j0 * kGroup;
  __m512 amax = _mm512_setzero_ps();
  __m512 sum = _mm512_setzero_ps();
  auto take = [&](__m512 v) {
    amax = _mm512_max_ps(_mm512_and_ps(v, magnitude), amax);
    sum = _mm512_add_ps(sum, v);
  };
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
  _mm512_mask_storeu_ps(q.sums.get() + j0, mask, sum);
  for (int64_t j = 0; j < count; ++j) {
    const __m512 scale = _mm512_set1_ps(inverses[j]);
    int8_t* out = q.codes.get() + (j0 + j) * kGroup;
    for (int half = 0; half < 2; ++half) {
      const __m512 v = load16(base + j * kGroup + half * 16);
      // Rounded to nearest even (the default rounding, as std::nearbyint), then narrowed.
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v, scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + half * 16), _mm512_cvtepi32_epi8(codes));
    }
  }
}

#endif

// Rows of `k` inputs at least this many per task of at::parallel_for when quantizing.
constexpr int64_t kQuantizeGrainInputs = 16 * 1024;

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k) {
  QuantizedRows q(m, k);
#ifdef PAGEDSERVE_VNNI
  const int64_t runs = (m * (k / kGroup) + 15) / 16;  // runs of 16 groups
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrainInputs / (16 * kGroup));
  at::parallel_for(0, runs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) {
      quantize_groups(x, run * 16, std::min<int64_t>(16, m * (k / kGroup) - run * 16), q);
    }
  });
#else
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrainInputs / k);
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x, r, k, q);
  });
#endif
  return q;
}

// Where a tile's results go: rows of `stride` elements, fp32 or bf16 (rounded to nearest
// even, as torch rounds), after adding the fp32 bias (or nothing).
struct Output {
  void* data;
  bool bf16;
  int64_t stride;
  const float* bias;
};

struct Weights {
  const uint8_t* codes;
  const at::Half* scales;
  const at::Half* offsets;
  int64_t k;
  int64_t bits;
  int64_t tile_bytes() const { return kTile * k * bits / 8; }
};

// Tile t's codes, and its scales and offsets [K / 32, 16].
struct Tile {
  const uint8_t* codes;
  const at::Half* scales;
  const at::Half* offsets;

  Tile(const Weights& w, int64_t t)
      : codes(w.codes + t * w.tile_bytes()),
        scales(w.scales + t * (w.k / kGroup) * kTile),
        offsets(w.offsets + t * (w.k / kGroup) * kTile) {}
};

#ifdef PAGEDSERVE_VNNI

inline __m512 load_halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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

// The epilogue of one group for one row: acc + isum * (scales * xs) + offsets * xsum, in
// the stated order; the AMX path runs this very function.
inline __m512 accumulate(__m512 acc, __m512i isum, __m512 scales, __m512 offsets, float xs,
                         float xsum) {
  const __m512 step = _mm512_mul_ps(scales, _mm512_set1_ps(xs));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), step, acc);
  return _mm512_fmadd_ps(offsets, _mm512_set1_ps(xsum), acc);
}

// acc[r] plus the bias into row r0 + r of `out`, tile t's columns (the first `valid`).
template <int64_t Rows>
__attribute__((always_inline)) inline void store_rows(const __m512* acc, int64_t t, int64_t r0, const Output& out,
                       int64_t valid) {
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

// Rows r0..r0+Rows-1 against tile t, into the tile's columns of those rows of `out`.
template <int64_t Rows, int64_t Bits>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, const Output& out,
               int64_t valid) {
  const int64_t k = w.k;
  const int64_t groups = k / kGroup;
  const auto [codes, scales, offsets] = Tile(w, t);
  const int8_t* xq = q.codes.get() + r0 * k;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[Rows];
  for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i isum[Rows];
    for (int64_t r = 0; r < Rows; ++r) isum[r] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * kGroup;
    if constexpr (Bits == 8) {
      const uint8_t* c = codes + g * kGroup * kTile;
      for (int64_t quad = 0; quad < kGroup / 4; ++quad) {
        const __m512i wv = _mm512_loadu_si512(c + quad * 64);
        for (int64_t r = 0; r < Rows; ++r) {
          isum[r] = _mm512_dpbusd_epi32(isum[r], wv, broadcast4(xg + r * k + quad * 4));
        }
      }
    } else {
      const uint8_t* c = codes + g * kGroup * kTile / 2;
      for (int64_t pair = 0; pair < kGroup / 8; ++pair) {
        const __m512i packed = _mm512_loadu_si512(c + pair * 64);
        const __m512i lo = _mm512_and_si512(packed, low_nibbles);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
        for (int64_t r = 0; r < Rows; ++r) {
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, broadcast4(xg + r * k + pair * 8));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, broadcast4(xg + r * k + pair * 8 + 4));
        }
      }
    }
    const __m512 s = load_halves(scales + g * kTile);
    const __m512 z = load_halves(offsets + g * kTile);
    for (int64_t r = 0; r < Rows; ++r) {
      const int64_t row = (r0 + r) * groups + g;
      acc[r] = accumulate(acc[r], isum[r], s, z, q.scales[row], q.sums[row]);
    }
  }
  store_rows<Rows>(acc, t, r0, out, valid);
}

#ifdef PAGEDSERVE_AMX

// AMX-INT8 for blocks of 16 rows. Per group of 32 inputs: A = 16 rows x 32 bytes of x's
// codes (stride k), B = 8 rows x 64 bytes, the tile's codes for the group in VNNI layout (4
// consecutive inputs of each of the 16 outputs per row), and one TDPBSUD makes the group's
// 16 x 16 exact int32 sums (signed A, unsigned B), which `accumulate` then takes row by row.
// Tiles: tmm0-1 A, tmm2-3 B, tmm4-7 C.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxChunkRows = 128;  // rows per pass over a task's tiles
constexpr int64_t kGroupBytes = kGroup * kTile;  // one group's B: 8 rows x 64 bytes

using pagedserve_amx::amx_permitted;
using pagedserve_amx::TileConfig;

void configure_tiles() {
  alignas(64) TileConfig config{};
  config.palette = 1;
  for (int i = 0; i < 8; ++i) {
    const bool a = i < 2, b = i >= 2 && i < 4;
    config.rows[i] = b ? kGroup / 4 : kAmxRows;
    config.colsb[i] = a ? kGroup : 64;
  }
  _tile_loadconfig(&config);
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


#endif

#else

// The same arithmetic in scalar code, for CPUs without AVX512-VNNI.
template <int64_t Rows, int64_t Bits>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, const Output& out,
               int64_t valid) {
  const int64_t k = w.k;
  const int64_t groups = k / kGroup;
  const auto [codes, scales, offsets] = Tile(w, t);
  float acc[Rows][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    int32_t isum[Rows][kTile] = {};
    for (int64_t i = 0; i < kGroup; ++i) {
      const int64_t input = g * kGroup + i;
      for (int64_t lane = 0; lane < kTile; ++lane) {
        int32_t code;
        if constexpr (Bits == 8) {
          code = codes[(input / 4) * 64 + lane * 4 + input % 4];
        } else {
          const uint8_t byte = codes[(input / 8) * 64 + lane * 4 + input % 4];
          code = (input % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
        }
        for (int64_t r = 0; r < Rows; ++r) {
          isum[r][lane] += code * q.codes[(r0 + r) * k + input];
        }
      }
    }
    for (int64_t r = 0; r < Rows; ++r) {
      const int64_t row = (r0 + r) * groups + g;
      for (int64_t lane = 0; lane < kTile; ++lane) {
        const float scale = static_cast<float>(scales[g * kTile + lane]);
        const float offset = static_cast<float>(offsets[g * kTile + lane]);
        acc[r][lane] = std::fmaf(static_cast<float>(isum[r][lane]), scale * q.scales[row],
                                 acc[r][lane]);
        acc[r][lane] = std::fmaf(offset, q.sums[row], acc[r][lane]);
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r) {
    const int64_t first = (r0 + r) * out.stride + t * kTile;
    for (int64_t lane = 0; lane < std::min(valid, kTile); ++lane) {
      const float y = acc[r][lane] + (out.bias != nullptr ? out.bias[t * kTile + lane] : 0.0f);
      if (out.bf16) {
        static_cast<at::BFloat16*>(out.data)[first + lane] = at::BFloat16(y);
      } else {
        static_cast<float*>(out.data)[first + lane] = y;
      }
    }
  }
}

#endif

template <int64_t Bits>
void tile_run(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, int64_t rows,
              const Output& out, int64_t valid) {
  switch (rows) {
    case 1: return tile_rows<1, Bits>(w, t, q, r0, out, valid);
    case 2: return tile_rows<2, Bits>(w, t, q, r0, out, valid);
    case 3: return tile_rows<3, Bits>(w, t, q, r0, out, valid);
    case 4: return tile_rows<4, Bits>(w, t, q, r0, out, valid);
    case 5: return tile_rows<5, Bits>(w, t, q, r0, out, valid);
    case 6: return tile_rows<6, Bits>(w, t, q, r0, out, valid);
    case 7: return tile_rows<7, Bits>(w, t, q, r0, out, valid);
    default: return tile_rows<8, Bits>(w, t, q, r0, out, valid);
  }
}

static_assert(kRowRun == 8, "tile_run instantiates runs of 1 to 8 rows");

// Calls of at least this many rows run their blocks of 16 rows on AMX (measured faster than
// VNNI from 16 rows on: see the header). `set_amx(false)` turns AMX off, for tests that
// compare both paths' bits.
constexpr int64_t kAmxMinRows = 16;
std::atomic<bool> amx_enabled{true};

bool amx_available() {
#ifdef PAGEDSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

void set_amx(bool enabled) { amx_enabled = enabled; }

bool use_amx(int64_t m) { return m >= kAmxMinRows && amx_enabled && amx_available(); }

// One layer's share of a call: its packed weight, where its outputs go (columns of a
// possibly wider output) and its output count.
struct Part {
  Weights w;
  Output out;
  int64_t n;
  int64_t tiles() const { return (n + kTile - 1) / kTile; }
};

// Every part's output tiles for the m quantized rows `q`, in one parallel loop over the
// parts' tiles side by side. Each output element is computed alone, in the fixed order of
// the header, whatever the parts, the task split or the instruction set.
void run_parts(const std::vector<Part>& parts, const QuantizedRows& q, int64_t m) {
  // No rows (a step in which every chunk is part of a prefill samples none: the LM head
  // gets 0 rows): nothing to compute, and the grain below would divide by zero runs.
  if (m == 0) return;
  std::vector<int64_t> first_tile{0};  // of each part, in the loop's index; then the total
  for (const Part& part : parts) first_tile.push_back(first_tile.back() + part.tiles());
  const auto part_of = [&](int64_t tile) {
    return static_cast<size_t>(
        std::upper_bound(first_tile.begin(), first_tile.end(), tile) - first_tile.begin() - 1);
  };
  const int64_t k = parts.front().w.k;
  // Rows in blocks of 16 run on AMX where it is on and the call has enough rows; the rest
  // (and every row without AMX) in runs of up to kRowRun on VNNI or the scalar code.
  const int64_t amx_rows = use_amx(m) ? m / 16 * 16 : 0;
  // Tasks of about kGrainBytes of codes per run of kRowRun rows.
  const int64_t runs = (m + kRowRun - 1) / kRowRun;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (parts.front().w.tile_bytes() * runs));
  at::parallel_for(0, first_tile.back(), grain, [&](int64_t begin, int64_t end) {
#ifdef PAGEDSERVE_AMX
    std::unique_ptr<uint8_t[], void (*)(void*)> unpacked(nullptr, std::free);
    if (amx_rows > 0) {
      configure_tiles();  // per task: other code on this thread (oneDNN) may configure its own
      unpacked.reset(static_cast<uint8_t*>(std::aligned_alloc(64, k / kGroup * kGroupBytes)));
    }
    // Chunks of rows over the task's tiles, so that a chunk's codes stay in the cache.
    for (int64_t r0 = 0; r0 < amx_rows; r0 += kAmxChunkRows) {
      for (int64_t tile = begin; tile < end; ++tile) {
        const Part& part = parts[part_of(tile)];
        const int64_t t = tile - first_tile[part_of(tile)];
        const int64_t valid = std::min(kTile, part.n - t * kTile);
        const uint8_t* b = part.w.codes + t * part.w.tile_bytes();
        if (part.w.bits == 4) {
          unpack_nibbles(b, k, unpacked.get());
          b = unpacked.get();
        }
        for (int64_t r = r0; r < std::min(r0 + kAmxChunkRows, amx_rows); r += kAmxRows) {
          tile_rows_amx(part.w, t, b, q, r, part.out, valid);
        }
      }
    }
#endif
    for (int64_t tile = begin; tile < end; ++tile) {
      const Part& part = parts[part_of(tile)];
      const int64_t t = tile - first_tile[part_of(tile)];
      const int64_t valid = std::min(kTile, part.n - t * kTile);
      for (int64_t r = amx_rows; r < m; r += kRowRun) {
        const int64_t rows = std::min(kRowRun, m - r);
        if (part.w.bits == 8) {
          tile_run<8>(part.w, t, q, r, rows, part.out, valid);
        } else {
          tile_run<4>(part.w, t, q, r, rows, part.out, valid);
        }
      }
    }
#ifdef PAGEDSERVE_AMX
    if (amx_rows > 0) _tile_release();
#endif
  });
}

// The checks every call's input passes; returns whether x is bf16.
bool check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "group_linear takes x [M, K]");
  TORCH_CHECK(x.device().is_cpu(), "group_linear runs on the CPU");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat32,
              "group_linear takes float32 or bfloat16 rows, not ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kGroup == 0, "group_linear needs K a multiple of 32, not ", x.size(1));
  return bf16;
}

QuantizedRows quantize(const torch::Tensor& x, bool bf16) {
  return bf16 ? quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1))
              : quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1));
}

// A layer's part of a call whose output `y` [M, stride] holds its columns from `column`;
// `bias32` is the fp32 bias (or undefined), kept alive by the caller.
Part part_of_call(const torch::Tensor& codes, const torch::Tensor& scales,
                  const torch::Tensor& offsets, int64_t bits, int64_t k, int64_t n,
                  const torch::Tensor& bias32, torch::Tensor& y, int64_t column, bool bf16) {
  char* data = static_cast<char*>(y.data_ptr()) + column * y.element_size();
  return Part{Weights{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                      offsets.data_ptr<at::Half>(), k, bits},
              Output{data, bf16, y.size(1), bias32.defined() ? bias32.data_ptr<float>() : nullptr},
              n};
}

torch::Tensor group_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& offsets,
                           int64_t bits, int64_t n, const std::optional<torch::Tensor>& bias) {
  const bool bf16 = check_rows(x);
  TORCH_CHECK(codes.device().is_cpu(), "group_linear runs on the CPU");
  TORCH_CHECK(bits == 8 || bits == 4, "group_linear takes 8- or 4-bit codes");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(),
              "codes must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  offsets.scalar_type() == torch::kHalf && offsets.is_contiguous(),
              "scales and offsets must be contiguous float16");
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(codes.numel() == tiles * kTile * k * bits / 8 &&
                  scales.numel() == tiles * (k / kGroup) * kTile &&
                  offsets.numel() == scales.numel(),
              "group_linear: the packed weight does not match x [M, ", k, "] and N = ", n);
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "group_linear: the bias must have N elements");
    bias32 = bias->to(torch::kFloat32).contiguous();
  }
  const torch::Tensor xc = x.contiguous();
  const QuantizedRows q = quantize(xc, bf16);
  torch::Tensor y = torch::empty({m, n}, x.options());
  run_parts({part_of_call(codes, scales, offsets, bits, k, n, bias32, y, 0, bf16)}, q, m);
  return y;
}

// Layers registered for the op, by handle (the Python layer's `OpaqueLinear.handle`).
struct Layer {
  torch::Tensor codes, scales, offsets;
  int64_t bits, in_features, out_features;
  int64_t kernel_rows;  // < 0: the kernel at every row count
  std::optional<torch::Tensor> bias;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Layer> registry;
// The Python function (x, handle) -> y for calls above a layer's threshold; never freed
// (it would outlive the interpreter as a static).
py::object* dense_fallback = nullptr;

void register_layer(int64_t handle, torch::Tensor codes, torch::Tensor scales,
                    torch::Tensor offsets, int64_t bits, int64_t in_features,
                    int64_t out_features, int64_t kernel_rows, std::optional<torch::Tensor> bias) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry[handle] = Layer{codes, scales, offsets, bits, in_features, out_features, kernel_rows,
                           bias};
}

void unregister_layer(int64_t handle) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
}

void set_dense_fallback(py::object function) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  delete dense_fallback;
  dense_fallback = new py::object(std::move(function));
}

torch::Tensor quantized_linear(const torch::Tensor& x, int64_t handle) {
  Layer layer;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    const auto found = registry.find(handle);
    TORCH_CHECK(found != registry.end(), "quantized_linear: no layer ", handle);
    layer = found->second;
  }
  const int64_t rows = x.numel() / layer.in_features;
  if (layer.kernel_rows >= 0 && rows > layer.kernel_rows) {
    TORCH_CHECK(dense_fallback != nullptr, "quantized_linear: no dense fallback is set");
    py::gil_scoped_acquire gil;
    return (*dense_fallback)(x, handle).cast<torch::Tensor>();
  }
  const torch::Tensor y = group_linear(x.reshape({rows, layer.in_features}), layer.codes,
                                       layer.scales, layer.offsets, layer.bits,
                                       layer.out_features, layer.bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = layer.out_features;
  return y.view(shape);
}

// The layers `handles` over one x, as one call: x quantized once and every layer's tiles
// in one parallel loop; returns [..., sum of their out_features], their outputs side by
// side in the order given (linear_groups.py slices them apart). Where a layer has a row
// threshold below the call's rows, each layer runs as `quantized_linear` and the results
// are concatenated.
torch::Tensor quantized_linear_group(const torch::Tensor& x, std::vector<int64_t> handles) {
  TORCH_CHECK(!handles.empty(), "quantized_linear_group: no layers");
  std::vector<Layer> layers;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    for (const int64_t handle : handles) {
      const auto found = registry.find(handle);
      TORCH_CHECK(found != registry.end(), "quantized_linear_group: no layer ", handle);
      layers.push_back(found->second);
    }
  }
  const int64_t k = layers.front().in_features;
  const int64_t rows = x.numel() / k;
  int64_t total = 0;
  bool thresholds = false;
  for (const Layer& layer : layers) {
    TORCH_CHECK(layer.in_features == k, "quantized_linear_group: layers of different inputs");
    total += layer.out_features;
    thresholds = thresholds || (layer.kernel_rows >= 0 && rows > layer.kernel_rows);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  if (thresholds) {
    std::vector<torch::Tensor> outputs;
    for (const int64_t handle : handles) outputs.push_back(quantized_linear(x, handle));
    return torch::cat(outputs, -1);
  }
  const torch::Tensor xc = x.reshape({rows, k}).contiguous();
  const bool bf16 = check_rows(xc);
  const QuantizedRows q = quantize(xc, bf16);
  torch::Tensor y = torch::empty({rows, total}, x.options());
  std::vector<torch::Tensor> biases;  // fp32, alive until the parts have run
  std::vector<Part> parts;
  int64_t column = 0;
  for (const Layer& layer : layers) {
    biases.push_back(layer.bias.has_value() ? layer.bias->to(torch::kFloat32).contiguous()
                                            : torch::Tensor());
    parts.push_back(part_of_call(layer.codes, layer.scales, layer.offsets, layer.bits, k,
                                 layer.out_features, biases.back(), y, column, bf16));
    column += layer.out_features;
  }
  run_parts(parts, q, rows);
  return y.view(shape);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_layer", &register_layer, "register a layer for the op under `handle`");
  m.def("unregister_layer", &unregister_layer, "forget the layer registered under `handle`");
  m.def("set_dense_fallback", &set_dense_fallback,
        "the Python function (x, handle) -> y for calls above a layer's row threshold");
  m.def("group_linear", &group_linear,
        "x [M, K] @ W^T (+ bias) for W packed as group-quantized codes -> [M, N]",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("bits"),
        py::arg("n"), py::arg("bias") = py::none());
  m.def("amx_available", &amx_available,
        "whether calls of many rows can run on AMX-INT8 (built with it, and Linux lets this "
        "process use it)");
  m.def("set_amx", &set_amx, "run calls of many rows on AMX where available (the default), or not",
        py::arg("enabled"));
  m.attr("amx_min_rows") = kAmxMinRows;
#ifdef PAGEDSERVE_VNNI
  m.attr("instruction_set") = "avx512-vnni";
#else
  m.attr("instruction_set") = "scalar";
#endif
}

#ifndef PAGEDSERVE_SCALAR_TWIN
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quantized_linear(Tensor x, int handle) -> Tensor");
  m.def("quantized_linear_group(Tensor x, int[] handles) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("quantized_linear_group", &quantized_linear_group);
}
#endif
