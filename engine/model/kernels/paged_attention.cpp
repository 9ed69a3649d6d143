// Paged attention on the CPU: every query row, decoded or prefilled, attends over its
// sequence's keys and values read in place from the paged KV cache, with one arithmetic.
//
// Shapes: q [T, H, D], the step's query tokens packed sequence by sequence; k_cache,
// v_cache [num_blocks, block_size, Hkv, D] (one layer of the paged KV tensor);
// block_tables [B, max_blocks]; query_start [B + 1]; context_lens [B]; output [T, H, D].
// Sequence b owns query rows [query_start[b], query_start[b + 1]), the last rows of its
// context of context_lens[b] tokens: its row i sits at position
// p = context_lens[b] - query_start[b + 1] + i and attends to positions 0..p (causal).
// A decode row is a sequence with one query row. Token t of sequence b lives at block
// block_tables[b][t / block_size], offset t % block_size. Query head h reads KV head
// h / G, where G = H / Hkv (grouped-query attention; G = 1 is plain multi-head attention).
//
// Features, each off at its neutral value: a sliding window W >= 1 (0: none) limits row p
// to positions p - W < t <= p (transformers' sliding_window_overlay); a softcap cap > 0
// (0: none) turns each score s into cap * tanh(s / cap) before the softmax (Gemma 2);
// sinks, fp32 [H] (none: null), add one logit sinks[h] to head h's softmax whose
// probability is dropped: exp(sinks[h] - m) joins the denominator only (gpt-oss's s_aux).
// Without a window or a softcap the kernel runs the instantiation that has no code for
// them (kMasked = false), so the plain case's loops are what they were; sinks only set
// the initial state.
//
// Invariance. A row's result depends only on its query, its position and its context's
// K/V, never on the other rows of the step: how many rows its sequence has this step (a
// decode, a prefill chunk of any length, a recomputation after preemption), where the
// chunk starts, or what other sequences run. Every row walks its context one KV block at
// a time, always split at the same block boundaries, from block 0 (with a window: from
// the block holding its first visible position p - W + 1; blocks wholly before it are
// never read), and folds each block into an online softmax with the same operations, per
// query head h, starting from m = -inf, l = 0, acc = 0 (with sinks: m = sinks[h], l = 1):
//   s[t]  = <scale * q[h], k[t]>                 for the block's visible tokens t
//   s[t]  = cap * tanh(s[t] / cap)               with a softcap cap
//   m'    = max(m, max_t s[t])                   running maximum
//   c     = exp(m - m')                          rescales what was summed under m
//   l     = c * l + sum_t exp(s[t] - m')         running sum
//   acc   = c * acc + sum_t exp(s[t] - m') * v[t]
// and finally out[h] = acc / l. A row folds only blocks in which it sees a token, so its
// state never meets a block of scores that are all -inf. The tokens of a block after p
// (not yet written, or belonging to later rows) are never read, and neither are the
// values of tokens before the window. Rows are computed together only to share the
// loads of K and V: a run of query vectors (heads of one KV head, of one or more rows,
// that see the same tokens of the block) goes through `attend_tile` together, and each
// vector's arithmetic there is the same for any run length (the tests compare the bits).
// All arithmetic is fp32, and the result is rounded once when stored.
//
// Memory. Nothing is gathered or padded. The K rows of all KV heads of a token are
// adjacent, so one work item reads each block as one contiguous piece; while a decode row
// computes a block it prefetches the next. A prefill chunk is cut into tiles of kRowTile
// rows: a tile reads each block of its context once for all its rows, from cache. In
// bf16 the query vectors of a KV head are computed in runs of up to four (see kMaxRun).
//
// Speed (`bench.attention_kernel` measures it): decode rows far faster than gathering K/V
// for torch; a whole prompt as fast as SDPA's flash kernel at a few hundred tokens and
// slower on long ones, where a GEMM micro-kernel's register blocking would pay.
//
// Parallelism. Work items (a decode row, or a tile of a prefill chunk) go to OpenMP
// threads (torch's pool and thread count) with dynamic scheduling, because context
// lengths differ and a static split of a batch ordered by age would give one thread all
// the long sequences. A row's query heads of one KV head are computed by one thread from
// start to end; where a step has fewer items than threads (one sequence decoding), an
// item's KV heads are split among them.
//
// Vectors. The inner loops use GCC/Clang vector extensions: a `Vec` is one register of
// fp32 lanes under -march=native, 16 with AVX-512 and 8 without (see kLanes). head_dim is a
// multiple of 32 and fixed at compile time per instantiation, so that a query row and an
// accumulator row stay in registers. Each 2 * kLanes values of a row are handled as a `Pair` of
// Vecs; for bf16 the pair holds the even and the odd elements, because splitting 32-bit
// words into their two bf16 halves widens them with one operation each and no shuffle.
// Queries and accumulators use the same order, which a dot product does not see, and the
// output is written back in natural order. Dot products are reduced kLanes at a time with
// a shuffle tree, and exp() is a short polynomial, because neither auto-vectorises without
// -ffast-math. The source is C++17, the oldest standard torch's extension builder uses.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "bf16 loads assume little endian");

// The bits of `from` as a `To` (std::bit_cast, which is C++20).
template <typename To, typename From>
inline To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as needs types of one size");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// One vector register of fp32 lanes: 16 with AVX-512, else 8. Wider GCC vectors than the
// target's registers are split for arithmetic but lowered lane by lane for shuffles,
// which would make the reductions below several times slower on AVX2.
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kPairLanes = 2 * kLanes;
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IntVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
using Vec8 = float __attribute__((vector_size(8 * sizeof(float))));
using Vec4 = float __attribute__((vector_size(4 * sizeof(float))));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Pair {
  Vec first;
  Vec second;
};

inline Vec splat(float x) { return Vec{} + x; }

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// 2 * kLanes fp32 values in order.
inline Pair load_pair(const float* p) { return {load(p), load(p + kLanes)}; }

// 2 * kLanes bf16 values as fp32: the even and the odd elements. A bf16 value is the upper
// half of the fp32 value with the same bits, and a little-endian 32-bit word holds element 2i in
// its low half and 2i + 1 in its high half.
inline Pair load_pair(const at::BFloat16* p) {
  IntVec words;
  std::memcpy(&words, p, sizeof(words));
  return {bits_as<Vec>(words << 16), bits_as<Vec>(words & int32_t(0xFFFF0000))};
}

inline void store_pair(float* p, const Pair& v) {
  store(p, v.first);
  store(p + kLanes, v.second);
}

inline void store_pair(at::BFloat16* p, const Pair& v) {
  for (int64_t i = 0; i < kLanes; ++i) {
    p[2 * i] = at::BFloat16(v.first[i]);  // rounds to nearest even, as torch does
    p[2 * i + 1] = at::BFloat16(v.second[i]);
  }
}

// The lower and upper half of v, as vectors of 4 lanes once v is down to 8.
inline Vec4 low4(Vec8 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
inline Vec4 high4(Vec8 v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }

inline Vec8 as8_sum(Vec v) {
#ifdef __AVX512F__
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}

inline Vec8 as8_max(Vec v) {
#ifdef __AVX512F__
  const Vec8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const Vec8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return lo > hi ? lo : hi;
#else
  return v;
#endif
}

inline float reduce_sum(Vec v) {
  const Vec8 v8 = as8_sum(v);
  const Vec4 v4 = low4(v8) + high4(v8);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

inline float reduce_max(Vec v) {
  const Vec8 v8 = as8_max(v);
  const Vec4 lo4 = low4(v8);
  const Vec4 hi4 = high4(v8);
  const Vec4 v4 = lo4 > hi4 ? lo4 : hi4;
  return std::max(std::max(v4[0], v4[1]), std::max(v4[2], v4[3]));
}

#ifdef __AVX512F__
// Lane i of the result is the sum of the lanes of p[i], for 16 vectors at once: a tree of
// 15 two-input shuffles and adds (each level halves the vectors and doubles the sums one
// vector holds), about 3 operations per vector instead of 8 for one reduce_sum each.
inline Vec reduce_sum_lanes(Vec (&p)[kLanes]) {
  for (int64_t i = 0; i < 8; ++i) {
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int64_t i = 0; i < 4; ++i) {
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  }
  for (int64_t i = 0; i < 2; ++i) {
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(p[0], p[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(p[0], p[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}
#else
// The same tree for 8 vectors of 8 lanes: 7 two-input shuffles and adds.
inline Vec reduce_sum_lanes(Vec (&p)[kLanes]) {
  for (int64_t i = 0; i < 4; ++i) {
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int64_t i = 0; i < 2; ++i) {
    p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(p[0], p[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(p[0], p[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// exp(x) for x <= 0, the only arguments an online softmax produces; relative error
// about 2e-7 (the Cephes expf polynomial), exactly 0 below -87 where fp32 denormals
// start, and exp(-inf) = 0.
inline Vec exp_nonpositive(Vec x) {
  const Vec clamped = x < -87.0f ? splat(-87.0f) : x;
  // n = round(x / ln 2); the magic constant rounds to nearest for |x / ln 2| < 2^22.
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const Vec n = (clamped * 1.44269504088896341f + kRound) - kRound;
  // r = x - n ln 2 with ln 2 split so that n * 0.693359375 is exact; |r| <= ln(2) / 2.
  const Vec r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Multiply by 2^n by building its exponent field; n >= -126 keeps it a normal number.
  const IntVec bits = (__builtin_convertvector(n, IntVec) + 127) << 23;
  const Vec result = p * bits_as<Vec>(bits);
  return x < -87.0f ? Vec{} : result;
}

// The online-softmax state of one query head: running max, running sum and the
// accumulator row (in pair order).
struct HeadState {
  float max;
  float sum;
  float* acc;
};

// Folds tokens [skip, tile) of one KV block into the states of kGroup query vectors that
// share one KV head. `q` holds their kGroup scaled query rows (kPairs pairs each); `keys`
// and `values` point at the KV head's vector of the block's first token; `scores` has
// room for kGroup tiles rounded up to whole vectors. Each K and V vector is loaded (and,
// for bf16, widened) once and used by all kGroup vectors, and each vector's operations and
// their order are the same for any kGroup. Without kMasked, `skip` is 0 and `softcap` 0
// whatever is passed, and this is the plain kernel's code; with it, a row in its window's
// first block skips tokens before the window (their scores are -inf and their values are
// not read) and a softcap > 0 caps the scores. Tokens [0, tile) are scored a kLanes
// chunk at a time from the chunk holding `skip`, so a token's lane is its offset in the
// block whatever `skip` is.
template <typename scalar_t, int64_t kPairs, int64_t kGroup, bool kMasked>
inline void attend_tile(const Pair* q, const scalar_t* keys, const scalar_t* values,
                        int64_t token_stride, int64_t skip, int64_t tile, int64_t padded_tile,
                        float* scores, HeadState* states, float softcap) {
  const int64_t first = kMasked ? skip : 0;  // the first visible token
  const int64_t first_chunk = first / kLanes * kLanes;
  for (int64_t t0 = first_chunk; t0 < tile; t0 += kLanes) {
    const int64_t n = std::min(kLanes, tile - t0);
    Vec partial[kGroup][kLanes];
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* k = keys + (t0 + i) * token_stride;
      Vec sum[kGroup] = {};
      for (int64_t c = 0; c < kPairs; ++c) {
        const Pair kc = load_pair(k + c * kPairLanes);
        for (int64_t g = 0; g < kGroup; ++g) {
          sum[g] += q[g * kPairs + c].first * kc.first;
          sum[g] += q[g * kPairs + c].second * kc.second;
        }
      }
      for (int64_t g = 0; g < kGroup; ++g) {
        partial[g][i] = sum[g];
      }
    }
    for (int64_t g = 0; g < kGroup; ++g) {
      std::fill(partial[g] + n, partial[g] + kLanes, Vec{});
      store(scores + g * padded_tile + t0, reduce_sum_lanes(partial[g]));
    }
  }

  float correction[kGroup];
  for (int64_t g = 0; g < kGroup; ++g) {
    float* s = scores + g * padded_tile;
    if constexpr (kMasked) {
      if (softcap > 0.0f) {
        for (int64_t t = first; t < tile; ++t) {
          s[t] = softcap * std::tanh(s[t] / softcap);
        }
      }
      std::fill(s + first_chunk, s + first, kNegInf);  // before the window: no weight
    }
    std::fill(s + tile, s + padded_tile, kNegInf);  // exp(-inf) = 0: no weight
    Vec tile_max = load(s + first_chunk);
    for (int64_t t = first_chunk + kLanes; t < padded_tile; t += kLanes) {
      tile_max = tile_max > load(s + t) ? tile_max : load(s + t);
    }
    HeadState& state = states[g];
    const float new_max = std::max(state.max, reduce_max(tile_max));
    // exp(-inf) = 0 on the first tile, while the sum and the accumulator are still 0.
    correction[g] = exp_nonpositive(splat(state.max - new_max))[0];
    Vec tile_sum{};
    for (int64_t t = first_chunk; t < padded_tile; t += kLanes) {
      const Vec p = exp_nonpositive(load(s + t) - new_max);
      store(s + t, p);
      tile_sum += p;
    }
    state.max = new_max;
    state.sum = correction[g] * state.sum + reduce_sum(tile_sum);
  }

  Pair acc[kGroup][kPairs];
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t c = 0; c < kPairs; ++c) {
      acc[g][c] = load_pair(states[g].acc + c * kPairLanes);
      acc[g][c].first *= correction[g];
      acc[g][c].second *= correction[g];
    }
  }
  for (int64_t t = first; t < tile; ++t) {
    const scalar_t* v = values + t * token_stride;
    for (int64_t c = 0; c < kPairs; ++c) {
      const Pair vc = load_pair(v + c * kPairLanes);
      for (int64_t g = 0; g < kGroup; ++g) {
        const float w = scores[g * padded_tile + t];
        acc[g][c].first += w * vc.first;
        acc[g][c].second += w * vc.second;
      }
    }
  }
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t c = 0; c < kPairs; ++c) {
      store_pair(states[g].acc + c * kPairLanes, acc[g][c]);
    }
  }
}

// The query vectors of one KV head go through attend_tile in runs of at most kMaxRun (a
// compile-time count, so that the loops over them unroll); a group of G is split
// greedily, e.g. 7 = 4 + 3. Only bf16 runs several vectors at once: its vectors need
// widening, which a run shares; fp32 vectors need none, and there the burst of
// prefetches a run issues costs more than the shared loads save (`bench.attention_kernel`),
// and prefill rows gain nothing from runs either.
template <typename scalar_t>
constexpr int64_t kMaxRun = std::is_same_v<scalar_t, float> ? 1 : 4;

// Rows of a prefill chunk per work item.
constexpr int64_t kRowTile = 16;

template <typename scalar_t, int64_t kPairs, bool kMasked>
inline void attend_run(int64_t run, const Pair* q, const scalar_t* keys, const scalar_t* values,
                       int64_t token_stride, int64_t skip, int64_t tile, int64_t padded_tile,
                       float* scores, HeadState* states, float softcap) {
  switch (run) {
    case 1:
      return attend_tile<scalar_t, kPairs, 1, kMasked>(q, keys, values, token_stride, skip, tile,
                                                       padded_tile, scores, states, softcap);
    case 2:
      return attend_tile<scalar_t, kPairs, 2, kMasked>(q, keys, values, token_stride, skip, tile,
                                                       padded_tile, scores, states, softcap);
    case 3:
      return attend_tile<scalar_t, kPairs, 3, kMasked>(q, keys, values, token_stride, skip, tile,
                                                       padded_tile, scores, states, softcap);
    default:
      return attend_tile<scalar_t, kPairs, 4, kMasked>(q, keys, values, token_stride, skip, tile,
                                                       padded_tile, scores, states, softcap);
  }
}

// Prefetches share `part` of `parts` of a KV block's keys and values (`count` values each)
// into L2. A decode row asks for the next block's shares while it computes this block's
// heads, so that the block streams in during the computation; asking for all of it at
// once overflows the queue of outstanding misses and loses most of the prefetches.
template <typename scalar_t>
inline void prefetch_share(const scalar_t* keys, const scalar_t* values, int64_t count,
                           int64_t part, int64_t parts) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // values per cache line
  for (int64_t i = count * part / parts / kLine * kLine; i < count * (part + 1) / parts;
       i += kLine) {
    __builtin_prefetch(keys + i, 0, 1);
    __builtin_prefetch(values + i, 0, 1);
  }
}

// The first position a row at `position` sees under a sliding window (0: none).
inline int64_t first_visible(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// Raises a clear error instead of reading outside q or the cache when a caller's tables
// disagree with them; costs one pass over B * max_blocks integers. Only the blocks the
// step reads are checked: with a window, a sequence's blocks wholly before its first
// row's window are never read and may hold anything.
void check_inputs(const int64_t* tables, const int64_t* starts, const int64_t* lens, int64_t batch,
                  int64_t num_rows, int64_t max_blocks, int64_t block_size, int64_t num_blocks,
                  int64_t window) {
  TORCH_CHECK(starts[0] == 0 && starts[batch] == num_rows, "query_start must run from 0 to ",
              num_rows, ", the number of query rows");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    const int64_t queries = starts[b + 1] - starts[b];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "context_lens[", b, "] = ", len,
                " is outside [1, ", max_blocks * block_size, "]");
    TORCH_CHECK(queries >= 1 && queries <= len, "sequence ", b, " has ", queries,
                " query rows for a context of ", len);
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t i = first_visible(len - queries, window) / block_size; i < used; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, "][", i, "] = ", block,
                  " is not a block of a ", num_blocks, "-block cache");
    }
  }
}

// A thread's buffers for the kernel, kept between calls (a decode step calls it once per
// layer): the scaled query rows, the accumulator rows, the online-softmax states and one
// tile of scores per vector of a run. Grown where a call needs more, never shrunk; the
// kernel writes each part before it reads it.
struct Scratch {
  std::vector<Pair> q_rows;
  std::vector<float> acc;
  std::vector<HeadState> states;
  std::vector<float> scores;

  // Room for `vectors` query vectors of `head_dim` values and a scores tile of `tile`.
  void reserve(int64_t vectors, int64_t head_dim, int64_t tile) {
    const auto grow = [](auto& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    grow(q_rows, vectors * head_dim / kPairLanes);
    grow(acc, vectors * head_dim);
    grow(states, vectors);
    grow(scores, tile);
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Fewer work items than this a thread are split by KV heads (see work_items).
constexpr int64_t kItemsPerThread = 4;

// Consecutive query rows of one sequence, for the KV heads [kv_first, kv_end) and their
// query heads, computed by one thread.
struct WorkItem {
  int64_t seq;
  int64_t first_row;  // index into q
  int64_t rows;
  int64_t first_position;  // of the first row
  int64_t kv_first;
  int64_t kv_end;
};

// The step's work items: a decode row or a tile of kRowTile rows of a prefill chunk, for
// all KV heads; where that gives fewer than kItemsPerThread items a thread (a decode step
// of one or two sequences, a compiled batch-1 step's padding row among them), each item
// is split into ranges of KV heads, which changes no bits (the query heads of one KV head
// never meet the others').
std::vector<WorkItem> work_items(const int64_t* starts, const int64_t* lens, int64_t batch,
                                 int64_t num_kv_heads, int64_t threads) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first_position = lens[b] - (starts[b + 1] - starts[b]);
    for (int64_t row = starts[b]; row < starts[b + 1]; row += kRowTile) {
      const int64_t rows = std::min(kRowTile, starts[b + 1] - row);
      items.push_back({b, row, rows, first_position + row - starts[b], 0, num_kv_heads});
    }
  }
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t wanted = kItemsPerThread * threads;
  if (count == 0 || count >= wanted || num_kv_heads == 1) {
    return items;
  }
  const int64_t parts = std::min(num_kv_heads, (wanted + count - 1) / count);
  std::vector<WorkItem> split;
  for (const WorkItem& item : items) {
    for (int64_t part = 0; part < parts; ++part) {
      WorkItem piece = item;
      piece.kv_first = num_kv_heads * part / parts;
      piece.kv_end = num_kv_heads * (part + 1) / parts;
      split.push_back(piece);
    }
  }
  return split;
}

// The optional features (see the header), at their neutral values when off.
struct Features {
  int64_t window;      // 0: none
  float softcap;       // 0: none
  const float* sinks;  // [H], or null: none
};

// head_dim = kPairLanes * kPairs; kMasked: a window or a softcap is on.
template <typename scalar_t, int64_t kPairs, bool kMasked>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& query_start, const torch::Tensor& context_lens,
                          float scale, const Features& features, torch::Tensor& out) {
  constexpr int64_t kHeadDim = kPairs * kPairLanes;
  const int64_t num_rows = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t batch = context_lens.size(0);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * kHeadDim;  // between tokens of one block
  const int64_t block_stride = block_size * token_stride;
  const int64_t padded_tile = (block_size + kLanes - 1) / kLanes * kLanes;
  // Constants 0 without kMasked, so that the plain instantiation has no code for them.
  const int64_t window = kMasked ? features.window : 0;
  const float softcap = kMasked ? features.softcap : 0.0f;
  const float* sinks = features.sinks;

  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();

  check_inputs(tables, starts, lens, batch, num_rows, max_blocks, block_size, k_cache.size(0),
               window);

  const std::vector<WorkItem> items =
      work_items(starts, lens, batch, num_kv_heads, at::get_num_threads());
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int num_threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_items));
#pragma omp parallel num_threads(num_threads)
  {
    // Per-thread scratch, reused across items, laid out [kv head][row][head of group] so
    // that the query vectors of one KV head are adjacent across rows: the scaled query
    // rows, the online-softmax states with their accumulator rows, and one tile of
    // scores per vector of a run.
    const int64_t vectors = kRowTile * num_heads;
    Scratch& scratch = thread_scratch();
    scratch.reserve(vectors, kHeadDim, kMaxRun<scalar_t> * padded_tile);
    Pair* const q_rows = scratch.q_rows.data();
    float* const acc = scratch.acc.data();
    HeadState* const states = scratch.states.data();
    float* const scores = scratch.scores.data();

#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < num_items; ++i) {
      const WorkItem item = items[i];
      const int64_t rows = item.rows;
      const int64_t* table = tables + item.seq * max_blocks;
      // Vector (kv, r, g) is query head kv * group + g of row r.
      const auto vector = [&](int64_t kv, int64_t r, int64_t g) {
        return (kv * rows + r) * group + g;
      };
      std::fill(acc, acc + rows * num_heads * kHeadDim, 0.0f);
      const int64_t first_head = item.kv_first * group;
      const int64_t end_head = item.kv_end * group;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = first_head; h < end_head; ++h) {
          const int64_t v = vector(h / group, r, h % group);
          // A sink is a logit already summed: exp(sinks[h] - m) = 1 under m = sinks[h].
          states[v] = sinks == nullptr ? HeadState{kNegInf, 0.0f, &acc[v * kHeadDim]}
                                       : HeadState{sinks[h], 1.0f, &acc[v * kHeadDim]};
          const scalar_t* q_row = q_data + ((item.first_row + r) * num_heads + h) * kHeadDim;
          for (int64_t c = 0; c < kPairs; ++c) {
            Pair qc = load_pair(q_row + c * kPairLanes);
            qc.first *= scale;
            qc.second *= scale;
            q_rows[v * kPairs + c] = qc;
          }
        }
      }

      const int64_t last_position = item.first_position + rows - 1;
      // From the block holding the first row's first visible position: 0 without a window.
      const int64_t first_start =
          first_visible(item.first_position, window) / block_size * block_size;
      for (int64_t start = first_start; start <= last_position; start += block_size) {
        const int64_t block_offset = table[start / block_size] * block_stride;
        const bool has_next = start + block_size <= last_position;
        const int64_t next_offset = has_next ? table[start / block_size + 1] * block_stride : 0;
        // Rows before `first_active` end before this block, and rows from `end_active` on
        // (with a window) start after it. Of the rows between, those in [first_full,
        // full_end) see all of it and go through together; the others see part of it and
        // go one by one: a row before first_full sees its first (position - start + 1)
        // tokens, and a row whose window starts inside the block skips the tokens before.
        // Without a window, end_active = full_end = rows.
        const int64_t first_active = std::max<int64_t>(0, start - item.first_position);
        const int64_t first_full =
            std::min(rows, std::max<int64_t>(0, start + block_size - 1 - item.first_position));
        int64_t end_active = rows;
        int64_t full_end = rows;
        if (window > 0) {
          end_active = std::min(rows, start + block_size - 1 + window - item.first_position);
          full_end = std::clamp(start + window - item.first_position, first_full, end_active);
        }
        const int64_t active_vectors = (end_active - first_active) * (end_head - first_head);
        int64_t done = 0;  // vectors of this block computed so far, for the prefetch shares
        const auto attend = [&](int64_t kv, int64_t first, int64_t count, int64_t skip,
                                int64_t tile) {
          const int64_t kv_offset = block_offset + kv * kHeadDim;
          for (int64_t v = first; v < first + count;) {
            const int64_t run = std::min(kMaxRun<scalar_t>, first + count - v);
            for (int64_t part = done; has_next && part < done + run; ++part) {
              prefetch_share(k_data + next_offset, v_data + next_offset, block_stride, part,
                             active_vectors);
            }
            attend_run<scalar_t, kPairs, kMasked>(run, &q_rows[v * kPairs], k_data + kv_offset,
                                                  v_data + kv_offset, token_stride, skip, tile,
                                                  padded_tile, scores, &states[v],
                                                  softcap);
            v += run;
            done += run;
          }
        };
        // One row, seeing tokens [skip, tile) of the block.
        const auto attend_row = [&](int64_t kv, int64_t r) {
          const int64_t position = item.first_position + r;
          const int64_t skip = std::max<int64_t>(0, first_visible(position, window) - start);
          const int64_t tile = std::min(position + 1 - start, block_size);
          attend(kv, vector(kv, r, 0), group, skip, tile);
        };
        for (int64_t kv = item.kv_first; kv < item.kv_end; ++kv) {
          for (int64_t r = first_active; r < first_full; ++r) {
            attend_row(kv, r);
          }
          if (first_full < full_end) {
            attend(kv, vector(kv, first_full, 0), (full_end - first_full) * group, 0, block_size);
          }
          for (int64_t r = full_end; r < end_active; ++r) {
            attend_row(kv, r);
          }
        }
      }

      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = first_head; h < end_head; ++h) {
          const HeadState& state = states[vector(h / group, r, h % group)];
          const float inv_sum = 1.0f / state.sum;
          scalar_t* out_row = out_data + ((item.first_row + r) * num_heads + h) * kHeadDim;
          for (int64_t c = 0; c < kPairs; ++c) {
            Pair o = load_pair(state.acc + c * kPairLanes);
            o.first *= inv_sum;
            o.second *= inv_sum;
            store_pair(out_row + c * kPairLanes, o);
          }
        }
      }
    }
  }
}

template <typename scalar_t>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& query_start, const torch::Tensor& context_lens,
                       float scale, const Features& features, torch::Tensor& out) {
  const bool masked = features.window > 0 || features.softcap > 0.0f;
  const auto run = [&](auto pairs) {
    constexpr int64_t kPairs = decltype(pairs)::value;
    if (masked) {
      paged_attention_impl<scalar_t, kPairs, true>(q, k_cache, v_cache, block_tables,
                                                   query_start, context_lens, scale, features,
                                                   out);
    } else {
      paged_attention_impl<scalar_t, kPairs, false>(q, k_cache, v_cache, block_tables,
                                                    query_start, context_lens, scale, features,
                                                    out);
    }
  };
  switch (q.size(2)) {
    case 32: return run(std::integral_constant<int64_t, 32 / kPairLanes>{});
    case 64: return run(std::integral_constant<int64_t, 64 / kPairLanes>{});
    case 96: return run(std::integral_constant<int64_t, 96 / kPairLanes>{});
    case 128: return run(std::integral_constant<int64_t, 128 / kPairLanes>{});
    case 256: return run(std::integral_constant<int64_t, 256 / kPairLanes>{});
    case 512: return run(std::integral_constant<int64_t, 512 / kPairLanes>{});
    default: TORCH_CHECK(false, "paged_attention: unsupported head_dim ", q.size(2));
  }
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start,
                              const torch::Tensor& context_lens, double scale,
                              int64_t sliding_window, double softcap,
                              const std::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4,
              "q must be [T, H, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache and v_cache must share one dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches differ in head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads ", q.size(1),
              " is not a multiple of num_kv_heads ", k_cache.size(2));
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && query_start.dim() == 1 &&
                  block_tables.size(0) == context_lens.size(0) &&
                  query_start.size(0) == context_lens.size(0) + 1,
              "block_tables must be [B, max_blocks], context_lens [B] and query_start [B + 1]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous");
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: none), not ",
              sliding_window);
  const float fsoftcap = static_cast<float>(softcap);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(fsoftcap),
              "paged_attention: softcap must be finite and >= 0 (0: none), not ", softcap);
  torch::Tensor sinks_c;
  if (sinks.has_value()) {
    const torch::Tensor& s = *sinks;
    TORCH_CHECK(s.device().is_cpu(), "paged_attention: sinks must be on the CPU, not on ",
                s.device());
    TORCH_CHECK(s.scalar_type() == torch::kFloat, "paged_attention: sinks must be float32, not ",
                s.scalar_type());
    TORCH_CHECK(s.dim() == 1 && s.size(0) == q.size(1),
                "paged_attention: sinks must be [H] = [", q.size(1), "], one per query head, not ",
                s.sizes());
    sinks_c = s.contiguous();
  }

  const torch::Tensor q_c = q.contiguous();
  const torch::Tensor tables = block_tables.to(torch::kLong).contiguous();
  const torch::Tensor starts = query_start.to(torch::kLong).contiguous();
  const torch::Tensor lens = context_lens.to(torch::kLong).contiguous();
  torch::Tensor out = torch::empty_like(q_c);
  if (lens.size(0) == 0) {
    TORCH_CHECK(q.size(0) == 0, "query rows without sequences");
    return out;
  }
  const float fscale = static_cast<float>(scale);
  // A window as long as the longest context the tables can hold is no window (and its
  // arithmetic below could overflow).
  const int64_t window =
      sliding_window >= block_tables.size(1) * k_cache.size(1) ? 0 : sliding_window;
  const Features features{window, fsoftcap,
                          sinks_c.defined() ? sinks_c.data_ptr<float>() : nullptr};
  switch (q.scalar_type()) {
    case at::ScalarType::Float:
      dispatch_head_dim<float>(q_c, k_cache, v_cache, tables, starts, lens, fscale, features,
                               out);
      break;
    case at::ScalarType::BFloat16:
      dispatch_head_dim<at::BFloat16>(q_c, k_cache, v_cache, tables, starts, lens, fscale,
                                      features, out);
      break;
    default:
      TORCH_CHECK(false, "paged_attention takes float32 or bfloat16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

// Writes key and value [T, Hkv, D] into layer `layer` of the KV tensor [L, 2, blocks,
// block_size, Hkv, D] at the flat slots [T]; a token whose slot is negative (a padding row
// of a compiled step) is not written. One copy per token row, no masks or host syncs: the
// compiled forward's store, 30 calls a SmolLM2 step.
void store_kv(const torch::Tensor& key, const torch::Tensor& value,
              const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.device().is_cpu(),
              "store_kv takes a contiguous CPU KV tensor [L, 2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() &&
                  key.size(1) == kv_cache.size(4) && key.size(2) == kv_cache.size(5),
              "store_kv: key and value must be [T, Hkv, D] of the cache's heads");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "store_kv: key, value and cache dtypes differ");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == key.size(0),
              "store_kv: slots must be int64 [T]");
  const torch::Tensor k = key.contiguous(), v = value.contiguous(), s = slots.contiguous();
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t slots_per_layer = kv_cache.size(2) * kv_cache.size(3);
  auto* base = static_cast<char*>(kv_cache.data_ptr());
  char* k_layer = base + (layer * 2) * slots_per_layer * row_bytes;
  char* v_layer = k_layer + slots_per_layer * row_bytes;
  const auto* k_rows = static_cast<const char*>(k.data_ptr());
  const auto* v_rows = static_cast<const char*>(v.data_ptr());
  const int64_t* slot = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK(slot[t] < slots_per_layer, "store_kv: slot ", slot[t], " is out of range");
    std::memcpy(k_layer + slot[t] * row_bytes, k_rows + t * row_bytes, row_bytes);
    std::memcpy(v_layer + slot[t] * row_bytes, v_rows + t * row_bytes, row_bytes);
  }
}

// paged_attention over layer `layer` of the whole KV tensor [L, 2, blocks, block_size, Hkv,
// D]: the op compiled forwards call (see the ops below).
torch::Tensor paged_attention_layer(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                    int64_t layer, const torch::Tensor& block_tables,
                                    const torch::Tensor& query_start,
                                    const torch::Tensor& context_lens, double scale,
                                    int64_t sliding_window, double softcap,
                                    const std::optional<torch::Tensor>& sinks) {
  const torch::Tensor caches = kv_cache.select(0, layer);
  return paged_attention(q, caches.select(0, 0), caches.select(0, 1), block_tables, query_start,
                         context_lens, scale, sliding_window, softcap, sinks);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Causal attention over a paged KV cache for decode rows and prefill chunks, with an "
        "optional sliding window, logit softcap and attention sinks: q [T, H, D] -> [T, H, D]",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("query_start"), py::arg("context_lens"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
}

// The compiled forward's ops, in C++ from end to end: a compiled graph calls them through
// the dispatcher with no Python in between (kernels/custom_ops.py gives them their fakes).
// They take the whole KV tensor and a layer index, not one layer's K and V views: Inductor
// mishandled an op that mutates two views of one base.
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, int layer, Tensor slots) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, int layer, Tensor block_tables, "
      "Tensor query_start, Tensor context_lens, float scale, int sliding_window, float softcap, "
      "Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("paged_attention", &paged_attention_layer);
}
