// bf16 linear on the CPU whose rows are row-invariant: y = x W^T (+ bias), x and W bf16,
// products summed in fp32, the bias added in fp32 and the sum rounded once to bf16.
//
// Why. oneDNN's packed bf16 linear picks its blocking, and with it each output's order of
// summation, by the call's row count, on some CPUs (AMX and AVX512-BF16 ones among them):
// a row of a 3-row call then differs from the same row of a 600-row call, and a request's
// output would depend on what else the engine runs. Here every output element is summed in
// one order fixed by the layer alone, whatever the number of rows, the other rows, the
// task split or the thread count.
//
// Arithmetic, two instruction sets, one per process (never one per row count: their fp32
// sums round differently, so their bits differ):
// - AVX512-BF16: one fp32 accumulator per output element, over the input pairs in order,
//   `acc = vdpbf16ps(acc, x pair, w pair)` (each instruction adds a pair's two products to
//   the accumulator, as the instruction rounds them).
// - AMX-BF16, where the compiler targets it and Linux grants this process the tile data:
//   per block of 16 rows, one C tile per 16 outputs accumulates TDPBF16PS over the inputs
//   in steps of 32, in order. Every call runs whole 16-row tiles: a block of fewer rows
//   (a decode step, a call's last rows) is copied into a zeroed 16-row buffer first, so
//   that each row runs the very same instruction sequence at any row count. It needs K a
//   multiple of 32; a layer without runs the AVX512-BF16 code at every row count.
// `set_amx(false)` turns AMX off for the process (tests check both sets' invariance).
// Why AMX at every row count where there is AMX: it is as fast as AVX512-BF16 at decode,
// far faster from 16 rows on, and near oneDNN in prefill (`python -m bench.linear_kernels
// --dtypes bfloat16`, with and without `--without-amx`, measures them); mixing the two by
// row count would break the row invariance.
//
// Blocking, which never changes an element's arithmetic: tasks of at::parallel_for take
// runs of output tiles; AVX512-BF16 takes 4 rows x 4 tiles at a time (16 accumulators,
// each weight vector loaded once per 4 rows); AMX takes two blocks of 16 rows x 2 tiles
// where a call has more than 16 rows (each A and B tile loaded once for two tile
// products), else one block x 2 tiles with its A and B tiles double-buffered so that a
// step's loads never wait for the previous step's tile products.
//
// Layout (made by bf16_linear.py's `pack`): outputs in tiles of 16, W as [tiles, K / 2,
// 16, 2]: the 64 bytes at [t, j] hold inputs 2j and 2j + 1 of each of the tile's 16
// outputs, the operand of one VDPBF16PS and one row of an AMX B tile (16 of them make the
// B tile of 32 inputs). The last tile may be partly padding (outputs >= N, not written).
//
// Inputs: x [M, K] bf16, K even; an optional bias [N]; returns y [M, N] bf16.
//
// The op `pagedserve::bf16_linear(x, handle)` runs a registered layer (`register_layer`:
// its packed weight and bias) in C++ from end to end, with no Python between the caller and
// the kernel, in eager steps and compiled graphs alike; `bf16_linear_group(x, handles)`
// runs layers that read one x as one call (linear_groups.py makes those in compiled graphs).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEDSERVE_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#define PAGEDSERVE_AMX 1
#endif
#endif

namespace {

constexpr int64_t kTile = 16;       // outputs per tile: one vector of 16 fp32 lanes
constexpr int64_t kBlockTiles = 4;  // tiles sharing one pass over a run of rows
constexpr int64_t kRowRun = 4;      // rows sharing one pass over a block's weights
constexpr int64_t kAmxRows = 16;    // rows of an AMX tile
constexpr int64_t kAmxDepth = 32;   // inputs per TDPBF16PS
// Bytes of weights times runs of rows per task of at::parallel_for: smaller calls run on
// the calling thread.
constexpr int64_t kGrainBytes = 32 * 1024;

std::atomic<bool> amx_enabled{true};

// One layer's part of a call: its packed weight, its rows' outputs at `y` (rows of
// `stride` elements) and its fp32 bias (or nullptr).
struct Part {
  const uint16_t* w;
  int64_t n;
  const float* bias;
  uint16_t* y;
  int64_t stride;
  int64_t tiles() const { return (n + kTile - 1) / kTile; }
};

#ifdef PAGEDSERVE_BF16

inline __mmask16 valid_mask(const Part& part, int64_t t) {
  const int64_t valid = part.n - t * kTile;
  return valid >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
}

// acc plus the bias, rounded to bf16 (nearest even), into row `row` of tile t's columns.
inline void store_row(__m512 acc, const Part& part, int64_t row, int64_t t) {
  const __mmask16 mask = valid_mask(part, t);
  if (part.bias != nullptr) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, part.bias + t * kTile));
  const __m256i y = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc));
  _mm256_mask_storeu_epi16(part.y + row * part.stride + t * kTile, mask, y);
}

// Rows r0..r0+Rows-1 of x [M, K] against tiles t0..t0+Tiles-1: one accumulator per output
// element, over the input pairs in order.
template <int64_t Rows, int64_t Tiles>
void dot_block(const uint16_t* x, int64_t k, const Part& part, int64_t r0, int64_t t0) {
  const int64_t pairs = k / 2;
  const uint16_t* w = part.w + t0 * pairs * 32;
  __m512 acc[Rows][Tiles];
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < Tiles; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh wv[Tiles];
#pragma GCC unroll 16
    for (int64_t c = 0; c < Tiles; ++c) {
      wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (c * pairs + j) * 32));
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < Rows; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (r0 + r) * k + 2 * j, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 16
      for (int64_t c = 0; c < Tiles; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < Tiles; ++c) store_row(acc[r][c], part, r0 + r, t0 + c);
  }
}

template <int64_t Tiles>
void dot_rows(const uint16_t* x, int64_t k, const Part& part, int64_t r0, int64_t rows,
              int64_t t0) {
  switch (rows) {
    case 1: return dot_block<1, Tiles>(x, k, part, r0, t0);
    case 2: return dot_block<2, Tiles>(x, k, part, r0, t0);
    case 3: return dot_block<3, Tiles>(x, k, part, r0, t0);
    default: return dot_block<4, Tiles>(x, k, part, r0, t0);
  }
}

static_assert(kRowRun == 4 && kBlockTiles == 4, "dot_run instantiates 1 to 4 rows and tiles");

// Every row of x against tiles t0..t0+tiles-1 (at most kBlockTiles), on AVX512-BF16.
void dot_tiles(const uint16_t* x, int64_t m, int64_t k, const Part& part, int64_t t0,
               int64_t tiles) {
  for (int64_t r = 0; r < m; r += kRowRun) {
    const int64_t rows = std::min(kRowRun, m - r);
    switch (tiles) {
      case 1: dot_rows<1>(x, k, part, r, rows, t0); break;
      case 2: dot_rows<2>(x, k, part, r, rows, t0); break;
      case 3: dot_rows<3>(x, k, part, r, rows, t0); break;
      default: dot_rows<4>(x, k, part, r, rows, t0); break;
    }
  }
}

#endif

#ifdef PAGEDSERVE_AMX

using pagedserve_amx::amx_permitted;
using pagedserve_amx::load_tile_config;
using pagedserve_amx::TileConfig;

// Every tile 16 rows of 64 bytes: tmm0 A (16 rows x 32 inputs), tmm1-3 B (16 input pairs x
// 16 outputs), tmm4-7 C (16 rows x 16 fp32 outputs).
void configure_tiles() {
  alignas(64) TileConfig config{};
  config.palette = 1;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = kAmxRows;
    config.colsb[i] = 64;
  }
  load_tile_config(config);
}

// 16 rows of `a` (row stride `a_stride` elements, K a multiple of 32) against tiles
// t0..t0+Tiles-1 (1 or 2), their fp32 sums into c [Tiles][16 rows][16]. Tiles: tmm0 and
// tmm1 A of even and odd steps, tmm2-3 and tmm4-5 their B, tmm6-7 C: a step's loads never
// wait for the previous step's products to release a tile.
template <int64_t Tiles>
void amx_block(const uint16_t* a, int64_t a_stride, int64_t k, const uint16_t* w, int64_t t0,
               float* c) {
  const int64_t pairs = k / 2;
  const auto b = [&](int64_t tile, int64_t step) {
    return w + ((t0 + tile) * pairs + step * (kAmxDepth / 2)) * 32;
  };
  const int64_t a_bytes = a_stride * 2;
  _tile_zero(6);
  if constexpr (Tiles > 1) _tile_zero(7);
  const int64_t steps = k / kAmxDepth;
  int64_t step = 0;
  for (; step + 1 < steps; step += 2) {
    _tile_loadd(0, a + step * kAmxDepth, a_bytes);
    _tile_loadd(2, b(0, step), 64);
    if constexpr (Tiles > 1) _tile_loadd(3, b(1, step), 64);
    _tile_dpbf16ps(6, 0, 2);
    if constexpr (Tiles > 1) _tile_dpbf16ps(7, 0, 3);
    _tile_loadd(1, a + (step + 1) * kAmxDepth, a_bytes);
    _tile_loadd(4, b(0, step + 1), 64);
    if constexpr (Tiles > 1) _tile_loadd(5, b(1, step + 1), 64);
    _tile_dpbf16ps(6, 1, 4);
    if constexpr (Tiles > 1) _tile_dpbf16ps(7, 1, 5);
  }
  if (step < steps) {
    _tile_loadd(0, a + step * kAmxDepth, a_bytes);
    _tile_loadd(2, b(0, step), 64);
    if constexpr (Tiles > 1) _tile_loadd(3, b(1, step), 64);
    _tile_dpbf16ps(6, 0, 2);
    if constexpr (Tiles > 1) _tile_dpbf16ps(7, 0, 3);
  }
  _tile_stored(6, c, 64);
  if constexpr (Tiles > 1) _tile_stored(7, c + kAmxRows * kTile, 64);
}

// Two blocks of 16 rows, a0 and a1, against tiles t0 and t0 + 1: each A and B tile loaded
// once per step for two tile products (tmm0-1 A, tmm2-3 B, tmm4-7 C), their fp32 sums into
// c0 and c1 [2][16 rows][16], as `amx_block<2>` computes them.
void amx_block_pair(const uint16_t* a0, const uint16_t* a1, int64_t k, const uint16_t* w,
                    int64_t t0, float* c0, float* c1) {
  const int64_t pairs = k / 2;
  const auto b = [&](int64_t tile, int64_t step) {
    return w + ((t0 + tile) * pairs + step * (kAmxDepth / 2)) * 32;
  };
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t step = 0; step < k / kAmxDepth; ++step) {
    _tile_loadd(0, a0 + step * kAmxDepth, k * 2);
    _tile_loadd(2, b(0, step), 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, b(1, step), 64);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(1, a1 + step * kAmxDepth, k * 2);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, c0, 64);
  _tile_stored(5, c0 + kAmxRows * kTile, 64);
  _tile_stored(6, c1, 64);
  _tile_stored(7, c1 + kAmxRows * kTile, 64);
}

// The rows of x against tiles t0..t0+tiles-1 on AMX, two blocks of 16 rows at a time where
// there are two: whole blocks read x in place; the last rows short of a block (fewer than
// 16) read `padded` [16, K], their copy.
void amx_tiles(const uint16_t* x, int64_t m, int64_t k, const uint16_t* padded,
               const Part& part, int64_t t0, int64_t tiles) {
  constexpr int64_t kTileFloats = kAmxRows * kTile;
  alignas(64) float c[2][kBlockTiles * kTileFloats];
  const int64_t whole = m / kAmxRows * kAmxRows;
  const auto block = [&](int64_t r0) { return r0 < whole ? x + r0 * k : padded; };
  for (int64_t r0 = 0; r0 < m; r0 += 2 * kAmxRows) {
    const int64_t blocks = r0 + kAmxRows < m ? 2 : 1;
    for (int64_t tile = 0; tile < tiles; tile += 2) {
      if (blocks == 2 && tiles - tile >= 2) {
        amx_block_pair(block(r0), block(r0 + kAmxRows), k, part.w, t0 + tile,
                       c[0] + tile * kTileFloats, c[1] + tile * kTileFloats);
        continue;
      }
      for (int64_t i = 0; i < blocks; ++i) {
        const uint16_t* a = block(r0 + i * kAmxRows);
        if (tiles - tile >= 2) {
          amx_block<2>(a, k, k, part.w, t0 + tile, c[i] + tile * kTileFloats);
        } else {
          amx_block<1>(a, k, k, part.w, t0 + tile, c[i] + tile * kTileFloats);
        }
      }
    }
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t first = r0 + i * kAmxRows;
      const int64_t rows = std::min(kAmxRows, m - first);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        for (int64_t r = 0; r < rows; ++r) {
          store_row(_mm512_load_ps(c[i] + tile * kTileFloats + r * kTile), part, first + r,
                    t0 + tile);
        }
      }
    }
  }
}

#endif

bool amx_available() {
#ifdef PAGEDSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

void set_amx(bool enabled) { amx_enabled = enabled; }

// Whether calls with K inputs run on AMX in this process (never a matter of row counts).
bool runs_amx(int64_t k) { return k % kAmxDepth == 0 && amx_enabled && amx_available(); }

// Every part's output tiles for the m rows of x [m, k], in one parallel loop over the
// parts' tiles side by side, in blocks of up to kBlockTiles tiles of one part.
void run_parts(const std::vector<Part>& parts, const uint16_t* x, int64_t m, int64_t k) {
#ifdef PAGEDSERVE_BF16
  std::vector<int64_t> first_tile{0};  // of each part, in the loop's index; then the total
  for (const Part& part : parts) first_tile.push_back(first_tile.back() + part.tiles());
  const bool amx = runs_amx(k);
  // The last rows short of a whole AMX tile, zero-padded to 16 rows.
  std::vector<uint16_t> padded;
  if (amx && m % kAmxRows != 0) {
    padded.assign(kAmxRows * k, 0);
    const int64_t whole = m / kAmxRows * kAmxRows;
    std::memcpy(padded.data(), x + whole * k, (m - whole) * k * sizeof(uint16_t));
  }
  const int64_t runs = (m + kRowRun - 1) / kRowRun;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (k * kTile * 2 * runs));
  at::parallel_for(0, first_tile.back(), grain, [&](int64_t begin, int64_t end) {
#ifdef PAGEDSERVE_AMX
    if (amx) configure_tiles();  // per task: other code on this thread may configure its own
#endif
    int64_t tile = begin;
    while (tile < end) {
      const size_t p = static_cast<size_t>(
          std::upper_bound(first_tile.begin(), first_tile.end(), tile) - first_tile.begin() - 1);
      const int64_t t0 = tile - first_tile[p];
      const int64_t tiles = std::min({kBlockTiles, end - tile, first_tile[p + 1] - tile});
#ifdef PAGEDSERVE_AMX
      if (amx) {
        amx_tiles(x, m, k, padded.data(), parts[p], t0, tiles);
      } else {
        dot_tiles(x, m, k, parts[p], t0, tiles);
      }
#else
      dot_tiles(x, m, k, parts[p], t0, tiles);
#endif
      tile += tiles;
    }
#ifdef PAGEDSERVE_AMX
    if (amx) _tile_release();
#endif
  });
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16");
#endif
}

torch::Tensor check_rows(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu(), "bf16_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "bf16_linear takes bfloat16 rows, not ",
              x.scalar_type());
  TORCH_CHECK(k % 2 == 0 && x.size(-1) == k, "bf16_linear: x's last axis must be K = ", k,
              " (even), not ", x.size(-1));
  return x.reshape({-1, k}).contiguous();
}

const uint16_t* bits_of(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

torch::Tensor fp32_bias(const std::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return torch::Tensor();
  TORCH_CHECK(bias->numel() == n, "bf16_linear: the bias must have N elements");
  return bias->to(torch::kFloat32).contiguous();
}

Part part_of_call(const torch::Tensor& packed, int64_t n, const torch::Tensor& bias32,
                  torch::Tensor& y, int64_t column) {
  return Part{bits_of(packed), n, bias32.defined() ? bias32.data_ptr<float>() : nullptr,
              reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + column, y.size(1)};
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const std::optional<torch::Tensor>& bias) {
  const int64_t k = x.size(-1);
  const torch::Tensor xc = check_rows(x, k);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 &&
                  packed.is_contiguous(),
              "bf16_linear: the packed weight must be contiguous bfloat16");
  TORCH_CHECK(packed.numel() == (n + kTile - 1) / kTile * kTile * k,
              "bf16_linear: the packed weight does not match x [M, ", k, "] and N = ", n);
  const torch::Tensor bias32 = fp32_bias(bias, n);
  const int64_t m = xc.size(0);
  torch::Tensor y = torch::empty({m, n}, xc.options());
  if (m > 0) run_parts({part_of_call(packed, n, bias32, y, 0)}, bits_of(xc), m, k);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.view(shape);
}

// Layers registered for the op, by handle (the Python layer's `OpaqueLinear.handle`).
struct Layer {
  torch::Tensor packed;
  int64_t in_features, out_features;
  torch::Tensor bias32;  // undefined: no bias
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Layer> registry;

void register_layer(int64_t handle, torch::Tensor packed, int64_t in_features,
                    int64_t out_features, std::optional<torch::Tensor> bias) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry[handle] = Layer{packed, in_features, out_features, fp32_bias(bias, out_features)};
}

void unregister_layer(int64_t handle) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
}

std::vector<Layer> layers_of(const std::vector<int64_t>& handles) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<Layer> layers;
  for (const int64_t handle : handles) {
    const auto found = registry.find(handle);
    TORCH_CHECK(found != registry.end(), "bf16_linear: no layer ", handle);
    layers.push_back(found->second);
  }
  return layers;
}

// The layers `handles` over one x, as one call: every layer's tiles in one parallel loop;
// returns [..., sum of their out_features], their outputs side by side in the order given.
torch::Tensor bf16_linear_group(const torch::Tensor& x, std::vector<int64_t> handles) {
  TORCH_CHECK(!handles.empty(), "bf16_linear_group: no layers");
  const std::vector<Layer> layers = layers_of(handles);
  const int64_t k = layers.front().in_features;
  int64_t total = 0;
  for (const Layer& layer : layers) {
    TORCH_CHECK(layer.in_features == k, "bf16_linear_group: layers of different inputs");
    total += layer.out_features;
  }
  const torch::Tensor xc = check_rows(x, k);
  const int64_t m = xc.size(0);
  torch::Tensor y = torch::empty({m, total}, xc.options());
  std::vector<Part> parts;
  int64_t column = 0;
  for (const Layer& layer : layers) {
    parts.push_back(part_of_call(layer.packed, layer.out_features, layer.bias32, y, column));
    column += layer.out_features;
  }
  if (m > 0) run_parts(parts, bits_of(xc), m, k);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = total;
  return y.view(shape);
}

torch::Tensor registered_linear(const torch::Tensor& x, int64_t handle) {
  return bf16_linear_group(x, {handle});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_layer", &register_layer, "register a layer for the op under `handle`");
  m.def("unregister_layer", &unregister_layer, "forget the layer registered under `handle`");
  m.def("bf16_linear", &bf16_linear, "x [..., K] @ W^T (+ bias) for W packed -> [..., N]",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("amx_available", &amx_available,
        "whether calls can run on AMX-BF16 (built with it, and Linux lets this process use it)");
  m.def("set_amx", &set_amx, "run calls on AMX where available (the default), or not",
        py::arg("enabled"));
#ifdef PAGEDSERVE_BF16
  m.attr("instruction_set") = "avx512-bf16";
#else
  m.attr("instruction_set") = "none";
#endif
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("bf16_linear(Tensor x, int handle) -> Tensor");
  m.def("bf16_linear_group(Tensor x, int[] handles) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("bf16_linear", &registered_linear);
  m.impl("bf16_linear_group", &bf16_linear_group);
}
