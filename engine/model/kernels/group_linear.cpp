// Group-quantized linear on the CPU, at every row count: y = x W^T, where W is stored in the
// formats of group_formats.h: 4-, 5-, 6- or 8-bit codes in groups of 32 inputs, with an fp16
// scale and offset per group (affine: llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and
// pagedserve's own int4/int8) or with small integer scales under an fp16 scale per 256
// inputs (llama.cpp's K-quants: Q4_K, Q5_K, Q6_K). Each format holds a GGUF tensor's blocks
// exactly, so the kernel computes the file's own model.
//
// Why. At decode a linear streams every weight from memory once per step, so its time is the
// weights' bytes over the memory bandwidth, if the arithmetic keeps up. Widening each code to
// fp32 and multiplying it in fp32 did not keep up on 2 cores (a second row cost almost as
// much as the first). So, as llama.cpp does, each row of x is quantized per group of 32 to
// int8 (scale = max|x| / 127) and the products are integer dot products: AVX512-VNNI
// multiplies 64 code bytes into 16 int32 sums in one instruction, AVX2 in two
// (group_tiles_avx2.h).
//
// Arithmetic: group_tiles_scalar.h states it. The integer sums are exact and the float
// operations run in one order for every output, in the vector code and the scalar code
// alike, so a row's bits depend only on that row and the weights, never on the number of
// rows, the other rows, the thread count or the instruction set.
//
// AMX. With many rows (prefill chunks, decode batches) the kernel is compute-bound, not
// memory-bound. Where the compiler targets AMX-INT8 (-march=native on such a CPU) and Linux
// grants the tile data (ARCH_REQ_XCOMP_PERM, asked once per process), a call of at least
// `kAmxMinRows` rows runs its blocks of 16 rows of affine 4- and 8-bit weights on AMX
// (group_tiles_amx.h): per group, A = 16 rows x 32 bytes of x's codes, B = the tile's codes
// for the group (8 rows x 64 bytes), one TDPBSUD makes the 16 x 16 exact int32 group sums,
// and the same vector epilogue (`accumulate`) takes them row by row; the other rows and
// formats run on VNNI. The sums are exact integers either way and the epilogue is the same
// operations in the same order, so the bits are the same
// (tests/engine/model/kernels/test_group_linear_amx.py). AMX beats VNNI from 16 rows on
// (the smallest block; `python -m bench.linear_kernels` measures both), so kAmxMinRows = 16.
//
// Inputs: x [M, K] fp32 or bf16 with K a multiple of 32 (of 256 for the super-block
// schemes), an optional bias [N]; returns [M, N] in x's dtype: the fp32 result plus the
// bias, rounded once.
//
// The op `pagedserve::quantized_linear(x, handle)` runs a registered layer (`register_layer`:
// its packed weight, bias and row threshold) in C++ from end to end, with no Python between
// the caller and the kernel: `quantized_linear.QuantizedLinear` calls it in eager steps and
// compiled graphs alike (211 calls a SmolLM2 step). A call of more rows than the layer's
// threshold calls back the Python function given to `set_dense_fallback` (the layer's dense
// path), where a call's arithmetic outweighs that cost. `pagedserve::quantized_embedding(ids,
// handle)` reads rows of a registered layer's weight as an embedding table (a GGUF's
// quantized token embedding).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

// PAGEDSERVE_SCALAR_TWIN builds the scalar code on any CPU and leaves the ops out: the
// tests build that twin to check that every path gives the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && !defined(PAGEDSERVE_SCALAR_TWIN)
#define PAGEDSERVE_INSTRUCTIONS "avx512-vnni"
#include "group_tiles_avx512.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGEDSERVE_AMX 1
#include "group_tiles_amx.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !defined(PAGEDSERVE_SCALAR_TWIN)
#define PAGEDSERVE_INSTRUCTIONS "avx2"
#include "group_tiles_avx2.h"
#else
#define PAGEDSERVE_INSTRUCTIONS "scalar"
#include "group_tiles_scalar.h"
#endif

namespace {

using namespace pagedserve_groups;

// Bytes of codes per task of at::parallel_for: smaller layers run on the calling thread.
constexpr int64_t kGrainBytes = 32 * 1024;

// Rows r_begin..r_end-1 against tile t of `w`, by its format.
void run_tile(const Weights& w, int64_t t, const QuantizedRows& q, int64_t r_begin, int64_t r_end,
              const Output& out, int64_t valid) {
  if (w.scheme == kSuperMin) {
    if (w.bits == 4) return tile_rows<4, kSuperMin>(w, t, q, r_begin, r_end, out, valid);
    return tile_rows<5, kSuperMin>(w, t, q, r_begin, r_end, out, valid);
  }
  if (w.scheme == kSuperSigned) {
    return tile_rows<6, kSuperSigned>(w, t, q, r_begin, r_end, out, valid);
  }
  if (w.bits == 4) return tile_rows<4, kAffine>(w, t, q, r_begin, r_end, out, valid);
  if (w.bits == 5) return tile_rows<5, kAffine>(w, t, q, r_begin, r_end, out, valid);
  return tile_rows<8, kAffine>(w, t, q, r_begin, r_end, out, valid);
}

// Calls of at least this many rows run their blocks of 16 rows on AMX (faster than VNNI
// from 16 rows on: see the header). `set_amx(false)` turns AMX off, for tests that
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

// One layer's share of a call: its packed weight, where its outputs go (columns of a
// possibly wider output) and its output count.
struct Part {
  Weights w;
  Output out;
  int64_t n;
  int64_t tiles() const { return (n + kTile - 1) / kTile; }
  // Rows of a call of m rows that run on AMX: blocks of 16, affine 4- and 8-bit weights only.
  int64_t amx_rows(int64_t m) const {
    const bool amx = m >= kAmxMinRows && amx_enabled && amx_available() &&
                     w.scheme == kAffine && (w.bits == 4 || w.bits == 8);
    return amx ? m / 16 * 16 : 0;
  }
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
  // Tasks of about kGrainBytes of codes per run of kRowRun rows.
  const int64_t runs = (m + kRowRun - 1) / kRowRun;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (parts.front().w.tile_bytes() * runs));
  at::parallel_for(0, first_tile.back(), grain, [&](int64_t begin, int64_t end) {
#ifdef PAGEDSERVE_AMX
    const int64_t k = parts.front().w.k;
    const bool any_amx = std::any_of(parts.begin(), parts.end(),
                                     [&](const Part& part) { return part.amx_rows(m) > 0; });
    std::unique_ptr<uint8_t[], void (*)(void*)> unpacked(nullptr, std::free);
    if (any_amx) {
      configure_tiles();  // per task: other code on this thread (oneDNN) may configure its own
      unpacked.reset(static_cast<uint8_t*>(std::aligned_alloc(64, k / kGroup * kGroupBytes)));
    }
    // Chunks of rows over the task's tiles, so that a chunk's codes stay in the cache.
    for (int64_t r0 = 0; any_amx && r0 < m / 16 * 16; r0 += kAmxChunkRows) {
      for (int64_t tile = begin; tile < end; ++tile) {
        const Part& part = parts[part_of(tile)];
        const int64_t amx_rows = part.amx_rows(m);
        if (r0 >= amx_rows) continue;
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
#ifdef PAGEDSERVE_AMX
      const int64_t first_row = part.amx_rows(m);
#else
      const int64_t first_row = 0;
#endif
      run_tile(part.w, t, q, first_row, m, part.out, valid);
    }
#ifdef PAGEDSERVE_AMX
    if (any_amx) _tile_release();
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

// x quantized as the parts' weights need it: per group for affine weights, per super-block
// for the others.
QuantizedRows quantize(const torch::Tensor& x, bool bf16, const std::vector<Part>& parts) {
  bool groups = false, supers = false;
  for (const Part& part : parts) {
    groups = groups || part.w.scheme == kAffine;
    supers = supers || part.w.scheme != kAffine;
  }
  return bf16 ? quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), groups, supers)
              : quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), groups, supers);
}

// A packed weight as the Python side holds it (group_linear.PackedWeight).
struct Packed {
  torch::Tensor codes, scales, offsets, sub;
  int64_t bits, scheme, k, n;

  // Checked once, where a weight enters C++.
  void check() const {
    TORCH_CHECK(scheme == kAffine ? (bits == 4 || bits == 5 || bits == 8)
                                  : (scheme == kSuperMin ? (bits == 4 || bits == 5)
                                                         : (scheme == kSuperSigned && bits == 6)),
                "group_linear: no format of ", bits, "-bit codes under scheme ", scheme);
    TORCH_CHECK(k % (scheme == kAffine ? kGroup : kSuper) == 0,
                "group_linear: K = ", k, " is not a whole number of blocks");
    const Weights w = weights();
    const int64_t tiles = (n + kTile - 1) / kTile;
    const auto sized = [](const torch::Tensor& t, at::ScalarType type, int64_t numel) {
      return t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu() &&
             t.numel() == numel;
    };
    TORCH_CHECK(sized(codes, torch::kUInt8, tiles * w.tile_bytes()) &&
                    sized(scales, torch::kHalf, tiles * w.scale_rows() * kTile) &&
                    (scheme == kSuperSigned ||
                     sized(offsets, torch::kHalf, tiles * w.scale_rows() * kTile)) &&
                    (scheme == kAffine || sized(sub, torch::kUInt8, tiles * w.sub_bytes())),
                "group_linear: the packed weight does not match K = ", k, " and N = ", n);
  }

  Weights weights() const {
    return Weights{codes.data_ptr<uint8_t>(),
                   scales.data_ptr<at::Half>(),
                   scheme == kSuperSigned ? nullptr : offsets.data_ptr<at::Half>(),
                   scheme == kAffine ? nullptr : sub.data_ptr<uint8_t>(),
                   k,
                   bits,
                   scheme};
  }
};

// A layer's part of a call whose output `y` [M, stride] holds its columns from `column`;
// `bias32` is the fp32 bias (or undefined), kept alive by the caller.
Part part_of_call(const Packed& weight, const torch::Tensor& bias32, torch::Tensor& y,
                  int64_t column, bool bf16) {
  char* data = static_cast<char*>(y.data_ptr()) + column * y.element_size();
  return Part{weight.weights(),
              Output{data, bf16, y.size(1), bias32.defined() ? bias32.data_ptr<float>() : nullptr},
              weight.n};
}

torch::Tensor bias_fp32(const std::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return torch::Tensor();
  TORCH_CHECK(bias->numel() == n, "group_linear: the bias must have N elements");
  return bias->to(torch::kFloat32).contiguous();
}

torch::Tensor linear(const torch::Tensor& x, const Packed& weight,
                     const std::optional<torch::Tensor>& bias) {
  const bool bf16 = check_rows(x);
  TORCH_CHECK(x.size(1) == weight.k, "group_linear: x has ", x.size(1), " inputs, not ", weight.k);
  const torch::Tensor bias32 = bias_fp32(bias, weight.n);
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({x.size(0), weight.n}, x.options());
  const std::vector<Part> parts{part_of_call(weight, bias32, y, 0, bf16)};
  run_parts(parts, quantize(xc, bf16, parts), x.size(0));
  return y;
}

torch::Tensor group_linear(const torch::Tensor& x, torch::Tensor codes, torch::Tensor scales,
                           torch::Tensor offsets, torch::Tensor sub, int64_t bits, int64_t scheme,
                           int64_t n, const std::optional<torch::Tensor>& bias) {
  const Packed weight{codes, scales, offsets, sub, bits, scheme, x.size(1), n};
  weight.check();
  return linear(x, weight, bias);
}

// Rows `rows` of a packed weight [N, K] as fp32 [len(rows), K]: GGML's dequantization.
torch::Tensor dequantize_rows(const Packed& weight, const torch::Tensor& rows) {
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1,
              "dequantize_rows takes a 1-d int64 tensor of rows");
  const torch::Tensor ids = rows.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t count = ids.numel();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < weight.n, "row ", id[i], " is out of range [0, ", weight.n, ")");
  }
  torch::Tensor out = torch::empty({count, weight.k}, torch::kFloat32);
  float* data = out.data_ptr<float>();
  const Weights w = weight.weights();
  at::parallel_for(0, count, std::max<int64_t>(1, 16 * 1024 / weight.k), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dequantize_row(w, id[i], data + i * weight.k);
  });
  return out;
}

torch::Tensor group_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                               torch::Tensor sub, int64_t bits, int64_t scheme, int64_t k,
                               int64_t n, const torch::Tensor& rows) {
  const Packed weight{codes, scales, offsets, sub, bits, scheme, k, n};
  weight.check();
  return dequantize_rows(weight, rows);
}

// Layers registered for the ops, by handle (the Python layer's `OpaqueLinear.handle`).
struct Layer {
  Packed weight;
  int64_t kernel_rows;  // < 0: the kernel at every row count
  std::optional<torch::Tensor> bias;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Layer> registry;
// The Python function (x, handle) -> y for calls above a layer's threshold; never freed
// (it would outlive the interpreter as a static).
py::object* dense_fallback = nullptr;

void register_layer(int64_t handle, torch::Tensor codes, torch::Tensor scales,
                    torch::Tensor offsets, torch::Tensor sub, int64_t bits, int64_t scheme,
                    int64_t in_features, int64_t out_features, int64_t kernel_rows,
                    std::optional<torch::Tensor> bias) {
  const Packed weight{codes, scales, offsets, sub, bits, scheme, in_features, out_features};
  weight.check();
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry[handle] = Layer{weight, kernel_rows, bias};
}

void unregister_layer(int64_t handle) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
}

Layer registered(int64_t handle) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  const auto found = registry.find(handle);
  TORCH_CHECK(found != registry.end(), "quantized_linear: no layer ", handle);
  return found->second;
}

void set_dense_fallback(py::object function) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  delete dense_fallback;
  dense_fallback = new py::object(std::move(function));
}

torch::Tensor quantized_linear(const torch::Tensor& x, int64_t handle) {
  const Layer layer = registered(handle);
  const int64_t rows = x.numel() / layer.weight.k;
  if (layer.kernel_rows >= 0 && rows > layer.kernel_rows) {
    TORCH_CHECK(dense_fallback != nullptr, "quantized_linear: no dense fallback is set");
    py::gil_scoped_acquire gil;
    return (*dense_fallback)(x, handle).cast<torch::Tensor>();
  }
  const torch::Tensor y = linear(x.reshape({rows, layer.weight.k}), layer.weight, layer.bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = layer.weight.n;
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
  for (const int64_t handle : handles) layers.push_back(registered(handle));
  const int64_t k = layers.front().weight.k;
  const int64_t rows = x.numel() / k;
  int64_t total = 0;
  bool thresholds = false;
  for (const Layer& layer : layers) {
    TORCH_CHECK(layer.weight.k == k, "quantized_linear_group: layers of different inputs");
    total += layer.weight.n;
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
  torch::Tensor y = torch::empty({rows, total}, x.options());
  std::vector<torch::Tensor> biases;  // fp32, alive until the parts have run
  std::vector<Part> parts;
  int64_t column = 0;
  for (const Layer& layer : layers) {
    biases.push_back(bias_fp32(layer.bias, layer.weight.n));
    parts.push_back(part_of_call(layer.weight, biases.back(), y, column, bf16));
    column += layer.weight.n;
  }
  run_parts(parts, quantize(xc, bf16, parts), rows);
  return y.view(shape);
}

// Rows `ids` (any shape) of a registered layer's weight [n, k], as an embedding table's
// lookup: [..., k] in fp32.
torch::Tensor quantized_embedding(const torch::Tensor& ids, int64_t handle) {
  const Layer layer = registered(handle);
  const torch::Tensor rows = dequantize_rows(layer.weight, ids.reshape({-1}).to(torch::kLong));
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(layer.weight.k);
  return rows.view(shape);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_layer", &register_layer, "register a layer for the ops under `handle`");
  m.def("unregister_layer", &unregister_layer, "forget the layer registered under `handle`");
  m.def("set_dense_fallback", &set_dense_fallback,
        "the Python function (x, handle) -> y for calls above a layer's row threshold");
  m.def("group_linear", &group_linear,
        "x [M, K] @ W^T (+ bias) for W packed in a group format -> [M, N]", py::arg("x"),
        py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("sub"), py::arg("bits"),
        py::arg("scheme"), py::arg("n"), py::arg("bias") = py::none());
  m.def("dequantize", &group_dequantize,
        "rows `rows` of W [N, K] packed in a group format, in fp32 -> [len(rows), K]",
        py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("sub"), py::arg("bits"),
        py::arg("scheme"), py::arg("k"), py::arg("n"), py::arg("rows"));
  m.def("amx_available", &amx_available,
        "whether calls of many rows can run on AMX-INT8 (built with it, and Linux lets this "
        "process use it)");
  m.def("set_amx", &set_amx, "run calls of many rows on AMX where available (the default), or not",
        py::arg("enabled"));
  m.attr("amx_min_rows") = kAmxMinRows;
  m.attr("row_run") = kRowRun;
  m.attr("instruction_set") = PAGEDSERVE_INSTRUCTIONS;
}

#ifndef PAGEDSERVE_SCALAR_TWIN
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quantized_linear(Tensor x, int handle) -> Tensor");
  m.def("quantized_linear_group(Tensor x, int[] handles) -> Tensor");
  m.def("quantized_embedding(Tensor ids, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("quantized_linear_group", &quantized_linear_group);
  m.impl("quantized_embedding", &quantized_embedding);
}
#endif
