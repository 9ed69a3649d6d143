// Group-quantized linear on the CPU for a few rows (decode): y = x W^T, where W is stored as
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

// PAGEDSERVE_SCALAR_TWIN builds the scalar code on any CPU and leaves the op out: the
// tests build that twin to check that both give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    !defined(PAGEDSERVE_SCALAR_TWIN)
#include <immintrin.h>
#define PAGEDSERVE_VNNI 1
#endif

namespace {

constexpr int64_t kTile = 16;   // outputs per tile: one vector of 16 int32 or fp32 lanes
constexpr int64_t kGroup = 32;  // inputs per scale group
constexpr int64_t kRowRun = 4;  // rows sharing one pass over a tile's codes
// Bytes of codes per task of at::parallel_for: smaller layers run on the calling thread.
constexpr int64_t kGrainBytes = 32 * 1024;

// One row per `k` inputs: int8 codes, and per group the scale and the plain sum.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<float> sums;
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedRows q{std::vector<int8_t>(m * k), std::vector<float>(m * groups),
                  std::vector<float>(m * groups)};
  float values[kGroup];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* p = x + r * k + g * kGroup;
      float amax = 0.0f;
      float sum = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) {
        values[i] = static_cast<float>(p[i]);
        amax = std::max(amax, std::fabs(values[i]));
        sum += values[i];
      }
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* out = q.codes.data() + r * k + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) {
        out[i] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
      }
      q.scales[r * groups + g] = amax / 127.0f;
      q.sums[r * groups + g] = sum;
    }
  }
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

// Rows r0..r0+Rows-1 against tile t, into the tile's columns of those rows of `out`.
template <int64_t Rows, int64_t Bits>
void tile_rows(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r0, const Output& out,
               int64_t valid) {
  const int64_t k = w.k;
  const int64_t groups = k / kGroup;
  const auto [codes, scales, offsets] = Tile(w, t);
  const int8_t* xq = q.codes.data() + r0 * k;
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
      const __m512 step = _mm512_mul_ps(s, _mm512_set1_ps(q.scales[row]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), step, acc[r]);
      acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(q.sums[row]), acc[r]);
    }
  }
  const __mmask16 mask = valid >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bias = out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + t * kTile)
                                          : _mm512_setzero_ps();
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
    default: return tile_rows<4, Bits>(w, t, q, r0, out, valid);
  }
}

static_assert(kRowRun == 4, "tile_run instantiates runs of 1 to 4 rows");

torch::Tensor group_linear(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& scales, const torch::Tensor& offsets,
                           int64_t bits, int64_t n, const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "group_linear takes x [M, K]");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "group_linear runs on the CPU");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat32,
              "group_linear takes float32 or bfloat16 rows, not ", x.scalar_type());
  TORCH_CHECK(bits == 8 || bits == 4, "group_linear takes 8- or 4-bit codes");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(),
              "codes must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  offsets.scalar_type() == torch::kHalf && offsets.is_contiguous(),
              "scales and offsets must be contiguous float16");
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % kGroup == 0, "group_linear needs K a multiple of 32, not ", k);
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
  const QuantizedRows q = bf16 ? quantize_rows(xc.data_ptr<at::BFloat16>(), m, k)
                               : quantize_rows(xc.data_ptr<float>(), m, k);
  torch::Tensor y = torch::empty({m, n}, x.options());
  const Output out{y.data_ptr(), bf16, n, bias.has_value() ? bias32.data_ptr<float>() : nullptr};
  const Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                  offsets.data_ptr<at::Half>(), k, bits};
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / w.tile_bytes());
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min(kTile, n - t * kTile);
      for (int64_t r = 0; r < m; r += kRowRun) {
        const int64_t rows = std::min(kRowRun, m - r);
        if (bits == 8) {
          tile_run<8>(w, t, q, r, rows, out, valid);
        } else {
          tile_run<4>(w, t, q, r, rows, out, valid);
        }
      }
    }
  });
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
#ifdef PAGEDSERVE_VNNI
  m.attr("instruction_set") = "avx512-vnni";
#else
  m.attr("instruction_set") = "scalar";
#endif
}

#ifndef PAGEDSERVE_SCALAR_TWIN
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quantized_linear(Tensor x, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
}
#endif
