// Weight-only int8 linear on the CPU for a few rows: y = x (codes * scales)^T, where the
// weight is stored as int8 codes [N, K] with one scale per output channel [N].
//
// Why. At decode a linear reads every weight once per step, so its time is the time to
// stream the weights from memory: int8 codes are a quarter of fp32 weights. PyTorch's own
// `_weight_int8pack_mm` is vectorized for bf16 activations only and dequantizes per block
// of 4 rows (on a 2-core AVX2 CPU, 2.5x slower than this kernel on one decode step's
// linears at one row). This kernel widens each code to fp32 in registers and multiplies
// it into up to kRowRun rows per pass over a weight row, whose later passes find the row
// in cache, so the weights stream from memory once per call; the arithmetic is fp32.
//
// Invariance. An output element y[m][n] = scales[n] * sum_k x[m][k] * codes[n][k] is
// computed by one thread with the same operations for every row count and every other
// row: its sum runs over k in a fixed order (kUnroll vector accumulators of kLanes lanes,
// each taking every kUnroll-th vector of the row, added pairwise, then reduced by a fixed
// shuffle tree, then the scalar tail in order) and is multiplied by the scale once. So a
// row's bits depend only on the row and the weights, never on the rows beside it.
//
// Parallelism: output channels are split into contiguous ranges over torch's threads
// (at::parallel_for); a range's codes are one contiguous piece of memory.
//
// Inputs: x [M, K] fp32 or bf16, contiguous; codes [N, K] int8, contiguous; scales [N]
// fp32 or bf16. Output [M, N] in x's dtype (bf16 rounds the fp32 result once).

#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kUnroll = 2;
// Rows computed together against one pass over a weight row; more rows take more passes.
constexpr int64_t kRowRun = 4;
// Output channels per task of at::parallel_for: a few KB of codes.
constexpr int64_t kGrain = 16;

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using Vec8 = float __attribute__((vector_size(8 * sizeof(float))));
using Vec4 = float __attribute__((vector_size(4 * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes codes widened to fp32 (exact: |code| <= 127). On x86 with the sign-extending
// loads: GCC lowers its generic vector conversion from int8 lanes one lane at a time,
// which made the kernel 5x slower on AVX2.
inline Vec load_codes(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
#elif defined(__AVX2__)
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
#else
  using Codes = int8_t __attribute__((vector_size(kLanes)));
  using Ints = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
  Codes codes;
  std::memcpy(&codes, p, sizeof(codes));
  return __builtin_convertvector(__builtin_convertvector(codes, Ints), Vec);
#endif
}

inline float reduce_sum(Vec v) {
#ifdef __AVX512F__
  const Vec8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const Vec8 v8 = v;
#endif
  const Vec4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                  __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// out[r * out_stride] = scale * <x[r], w> for the `rows` (<= kRowRun) rows of x at
// x + r * k, over one weight row w of k codes. The template fixes the row count so that
// the accumulators stay in registers.
template <int64_t Rows>
inline void dot_rows(const float* x, const int8_t* w, int64_t k, float scale, float* out,
                     int64_t out_stride) {
  Vec acc[Rows][kUnroll] = {};
  constexpr int64_t kStep = kLanes * kUnroll;
  const int64_t main_end = k / kStep * kStep;
  for (int64_t i = 0; i < main_end; i += kStep) {
    for (int64_t u = 0; u < kUnroll; ++u) {
      const Vec wv = load_codes(w + i + u * kLanes);
      for (int64_t r = 0; r < Rows; ++r) {
        acc[r][u] += wv * load(x + r * k + i + u * kLanes);
      }
    }
  }
  const int64_t vec_end = k / kLanes * kLanes;
  if (main_end < vec_end) {  // one vector left over (kUnroll = 2)
    const Vec wv = load_codes(w + main_end);
    for (int64_t r = 0; r < Rows; ++r) {
      acc[r][0] += wv * load(x + r * k + main_end);
    }
  }
  for (int64_t r = 0; r < Rows; ++r) {
    float sum = reduce_sum(acc[r][0] + acc[r][1]);
    for (int64_t i = vec_end; i < k; ++i) {
      sum += x[r * k + i] * static_cast<float>(w[i]);
    }
    out[r * out_stride] = sum * scale;
  }
}

static_assert(kUnroll == 2, "dot_rows adds two accumulators");

void dot_run(const float* x, int64_t rows, const int8_t* w, int64_t k, float scale,
             float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return dot_rows<1>(x, w, k, scale, out, out_stride);
    case 2: return dot_rows<2>(x, w, k, scale, out, out_stride);
    case 3: return dot_rows<3>(x, w, k, scale, out, out_stride);
    default: return dot_rows<4>(x, w, k, scale, out, out_stride);
  }
}

static_assert(kRowRun == 4, "dot_run instantiates runs of 1 to 4 rows");

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scales.dim() == 1,
              "int8_linear takes x [M, K], codes [N, K] and scales [N]");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "int8_linear runs on the CPU");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "codes must be int8");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int8_linear takes float32 or bfloat16 rows, not ", x.scalar_type());
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  const int64_t n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && scales.size(0) == n, "int8_linear: shapes do not match");
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const torch::Tensor sf = scales.to(torch::kFloat32).contiguous();
  const torch::Tensor cc = codes.contiguous();
  torch::Tensor out = torch::empty({m, n}, xf.options());
  const float* x_data = xf.data_ptr<float>();
  const int8_t* w_data = cc.data_ptr<int8_t>();
  const float* s_data = sf.data_ptr<float>();
  float* o_data = out.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r = 0; r < m; r += kRowRun) {
        dot_run(x_data + r * k, std::min(kRowRun, m - r), w_data + j * k, k, s_data[j],
                o_data + r * n + j, n);
      }
    }
  });
  return out.to(x.scalar_type());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x [M, K] @ (codes [N, K] * scales [N, 1])^T -> [M, N]",
        py::arg("x"), py::arg("codes"), py::arg("scales"));
}
